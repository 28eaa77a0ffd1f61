"""The GPU report's two timed steps after the test tier, without a GPU: the bench's runs under its budget
(bench/bench_gpu_report.py: which runs start, in which order, what the page says of those left out) and the offload
step's choice of length (harness/gpu_measure_step.py: 128K when its predicted run fits the time left, else the
longest that does, said so), each page from canned logs. The expected figures are worked out by hand here from the
estimates and bands the canned inputs give, not read back from the code."""
from __future__ import annotations

import json

import pytest

from bench.bench_gpu_report import RUN_ESTIMATES_S, plan_runs, run_plan
from harness.gpu_measure_step import FIRST_STEP_SLACK, OFFLOAD_SETUP_S, offload_step, pick_seq_len
from harness.report_summary import BENCH_NOT_RUN, BENCH_ROW, FIGURES, FOOTER_EXIT, HEADER, summarize


def _log(name: str, kind: str, body: str, limit: float = 85, rc: int = 0, seconds: float = 70.0) -> str:
    return (HEADER.format(name=name, kind=kind, limit=limit, command="python ...") + "\n" + body + "\n"
            + FOOTER_EXIT.format(rc=rc, seconds=seconds) + "\n")


class Clock:
    """Time that moves only when a run ends: each run takes its own estimate, as if the estimates were exact."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bench_starts_a_run_only_while_its_estimate_fits_and_says_which_it_left_out(capsys):
    """78 s of budget, runs taking their estimates (ours 20, transformers 15, documents 20 at 8K): 78 - 55 = 23 s
    are left when the compiled 8K run (30 s) is next, so it and every 64K run (25-40 s) are left out; a failing
    peer gives its row one line and the runs after it go on."""
    clock = Clock()
    ran = []

    def measure(seq, side, timeout_s):
        ran.append((seq, side, timeout_s))
        clock.now += RUN_ESTIMATES_S[(seq, side)]
        if side == "transformers":
            raise RuntimeError("transformers' run failed: CUDA out of memory\nmore")
        return {"system": side, "tok_s": 1.0, "peak_gib": 1.0, "mfu_logged": None, "mfu_causal": 0.1,
                "mfu_full": 0.2}

    run_plan(plan_runs(torchtitan=False), 78, measure, clock)
    assert [(seq, side) for seq, side, _ in ran] == [(8192, "ours"), (8192, "transformers"), (8192, "ours-documents")]
    assert [timeout for *_, timeout in ran] == [78, 58, 43]  # each run may use what is left, no more
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line[len(BENCH_ROW):]) for line in lines if line.startswith(BENCH_ROW)]
    assert rows[1] == {"seq": 8192, "side": "transformers", "error": "transformers' run failed: CUDA out of memory"}
    left_out = [json.loads(line[len(BENCH_NOT_RUN):]) for line in lines if line.startswith(BENCH_NOT_RUN)]
    assert [(r["seq"], r["side"], r["left_s"]) for r in left_out] == [
        (8192, "ours-compiled", 23), (65536, "ours-documents", 23), (65536, "ours", 23), (65536, "transformers", 23),
        (65536, "ours-compiled", 23)]


def test_without_a_budget_every_run_runs_and_torchtitan_only_where_it_imports():
    assert len(plan_runs(torchtitan=False)) == 8 and len(plan_runs(torchtitan=True)) == 9
    assert plan_runs(torchtitan=True)[:4] == [(8192, "ours"), (8192, "transformers"), (8192, "ours-documents"),
                                              (8192, "torchtitan")]
    ran = []
    run_plan(plan_runs(torchtitan=True), 0, lambda seq, side, t: ran.append(side) or {
        "system": side, "tok_s": 1.0, "peak_gib": None, "mfu_logged": None, "mfu_causal": 0.0, "mfu_full": 0.0})
    assert len(ran) == 9


BENCH = _log("bench_gpu", "bench", "NVIDIA H200, torch 2.11.0+cu130; command: bench/bench_gpu_report.py\n"
             "TorchTitan: TorchTitan is not installed; torch 2.11.0+cu130 needs TorchTitan 0.2.2; comparing with "
             "transformers only\n" + "\n".join(BENCH_ROW + json.dumps(row) for row in [
                 {"seq": 8192, "side": "ours", "system": "ours (train.py), causal", "tok_s": 109469.0,
                  "peak_gib": 11.02, "mfu_logged": 0.3, "mfu_causal": 0.3012, "mfu_full": 0.3456, "seconds": 19.6},
                 {"seq": 8192, "side": "transformers", "system": "transformers LlamaForCausalLM, causal",
                  "tok_s": 87575.2, "peak_gib": 14.5, "mfu_logged": None, "mfu_causal": 0.241, "mfu_full": 0.2763,
                  "seconds": 14.2},
                 {"seq": 65536, "side": "transformers", "error": "transformers' run failed: CUDA out | of memory"}])
             + "\n" + BENCH_NOT_RUN + json.dumps({"seq": 65536, "side": "ours-compiled", "estimate_s": 40,
                                                  "left_s": 12}))


def test_the_bench_rows_reach_the_page_as_one_table_with_ours_against_transformers():
    page = summarize([BENCH])
    assert ("| 8,192 | ours (train.py), causal | 109,469 | 11.02 | 30.1% | 34.6% | 1.250 | 20 |") in page, page
    assert "| 8,192 | transformers LlamaForCausalLM, causal | 87,575 | 14.50 | 24.1% | 27.6% | - | 14 |" in page
    assert "| 65,536 | transformers | failed: transformers' run failed: CUDA out / of memory |" in page
    assert "- not run: ours-compiled at 65,536 tokens (estimated 40 s, 12 s left of the bench's budget)" in page
    assert "- TorchTitan: TorchTitan is not installed; torch 2.11.0+cu130 needs TorchTitan 0.2.2" in page


H100_128K = [30.88, 31.03]  # the dry run's band for the 3B offload recipe at 131,072 tokens on h100-sxm


def test_the_offload_step_takes_128k_when_its_predicted_run_fits_else_the_longest_that_does():
    need_128k = OFFLOAD_SETUP_S + 31.03 * FIRST_STEP_SLACK  # 50 + 38.8 = 88.8 s
    assert round(need_128k) == 89
    assert pick_seq_len({131072: H100_128K}, 100)[0] == 131072
    seq, line = pick_seq_len({131072: H100_128K, 98304: [18.0, 19.0]}, 80)  # 50 + 19 x 1.25 = 73.75 s fits 80
    assert seq == 98304
    assert line == "98,304 tokens: ~74 s predicted of 80 s left (131,072 did not fit: its run needs ~89 s)"
    seq, line = pick_seq_len({131072: H100_128K, 65536: [10.0, 12.0]}, 60)  # 50 + 15 = 65 s: neither fits 60
    assert seq is None and line == "no length fits 60 s left: 131,072 needs ~89 s, 65,536 needs ~65 s"


CHOSEN = "131,072 tokens: ~89 s predicted of 104 s left"
OFFLOAD = _log("offload_3b", "step", f"offload step: {CHOSEN}\n" + FIGURES + json.dumps({
    "recipe": "llama3_8b_500k_1gpu.toml", "shape": "model llama3_2_3b", "seq_len": 131072, "steps": 1,
    "accelerator": "h100-sxm", "device": "NVIDIA H100 80GB HBM3", "note": CHOSEN,
    "cpu_offload": True, "predicted_peak_gib": 27.01, "predicted_host_gib": 69.18, "predicted_pinned_gib": 21.0,
    "predicted_step_s": 30.96, "predicted_step_s_band": [30.88, 31.03], "measured_peak_gib": 30.0,
    "measured_host_gib": 60.0, "measured_pinned_gib": 21.0, "measured_step_s": 40.0}), limit=115, seconds=101.0)


def test_the_offload_steps_device_and_host_peaks_reach_the_page():
    page = summarize([OFFLOAD])
    assert "| device peak, GiB | 27.01 | 30.00 | 0.90 |" in page, page  # 27.01 / 30
    assert "| host peak (resident set), GiB | 69.18 | 60.00 | 1.15 |" in page, page  # 69.18 / 60 = 1.153
    assert "| pinned activation arena, GiB | 21.00 | 21.00 | 1.00 |" in page, page
    assert "| step time, s | 30.960 (band 30.880..31.030) | 40.000 | 0.77 |" in page, page  # 30.96 / 40 = 0.774
    assert "training.cpu_offload; 131,072 tokens" in page and "its one step (warm-up included)" in page, page
    assert "- offload step: 131,072 tokens: ~89 s predicted of 104 s left" in page, page


@pytest.mark.slow
def test_the_offload_steps_plumbing_on_the_cpu_with_a_tiny_model(tmp_path, capsys):
    """The offload step's code as on the GPU (the 1-GPU offload recipe, its dry run, train.py under torchrun) with the
    debug model at 512 tokens on the CPU, so the keys it reads (dry_run.json's host peak, metrics.jsonl's host_memory)
    cannot rot where no GPU is. On the CPU the dry run's host peak is the whole process, so it must land near the
    measured resident set (0.45 against 0.45 GiB here). Slow tier: a dry run and a launch, ~20 s."""
    assert offload_step(str(tmp_path), limit_s=200, lengths=(512,), shape_overrides=[
        "--model.name", "debug", "--hardware.device", "cpu"]) == 0
    out = capsys.readouterr().out
    figures = json.loads([line for line in out.splitlines() if line.startswith(FIGURES)][-1][len(FIGURES):])
    assert figures["cpu_offload"] and figures["seq_len"] == 512, figures
    assert 0.5 < figures["predicted_host_gib"] / figures["measured_host_gib"] < 2.0, figures
    page = summarize([_log("offload_3b", "step", out)])
    assert "| host peak (resident set), GiB |" in page and "- offload step: 512 tokens: ~" in page, page
