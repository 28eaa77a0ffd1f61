"""`./run_tests.sh --gpu --report DIR` without a GPU: the summary page from canned logs (pytest's closing line, a
timeout, a crash with no closing line, a wheel install refused, a bench log, the 64K step's figures), the runner on
real processes (pytest's own closing line and pytest-timeout's stack dump, a process group killed at its limit),
the 64K step's plumbing on the CPU with a tiny shape, the CPU twin of the whole command (`--fake`: the runner, the
compiled-op step and the page), the test files' lanes side by side, the limits adding up to the 9 minutes the
report promises, the bench's runs under its budget and the offload step's choice of length.
The entry itself (one line and exit 0 without a GPU) is tested in tests/gpu/test_gpu_tier_entry.py."""
from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest

from harness.gpu_measure_step import measure_step
from harness.gpu_report import (LANES, NOT_IN_REPORT, TOTAL_LIMIT_S, Step, gpu_test_files, lanes_of, plan, run_step,
                                wall_limit_s)
from harness.launch_env import ROOT
from harness.report_summary import (FIGURES, FOOTER_EXIT, FOOTER_KILLED, HEADER, all_ok, bench_lines, parse_step,
                                    summarize)


def _log(name: str, kind: str, body: str, limit: float = 25, rc: int | None = 0, seconds: float = 12.5) -> str:
    head = HEADER.format(name=name, kind=kind, limit=limit, command="python -m pytest ...")
    foot = FOOTER_EXIT.format(rc=rc, seconds=seconds) if rc is not None else FOOTER_KILLED.format(
        limit=limit, seconds=seconds)
    return f"{head}\n{body}\n{foot}\n"


PASSED = _log("test_gpu_block_kernels.py", "pytest", "tests/gpu/test_gpu_block_kernels.py .s.\n"
              "SKIPPED [1] tests/gpu/test_gpu_cp.py:30: needs 2 GPU(s), 1 visible\n"
              "============ 3 passed, 2 skipped, 4 deselected in 11.31s ============")
QUIET = _log("test_gpu_varlen.py", "pytest", "1 passed, 1 deselected in 75.02s (0:01:15)")
FAILED = _log("test_gpu_memory.py", "pytest", "E   AssertionError: (4.1, 5.3)\n"
              "====== 1 failed, 1 error, 2 deselected in 40.00s ======", rc=1)
NOTHING = _log("test_gpu_x.py", "pytest", "============ 3 deselected in 0.41s ============", rc=5)
TIMEOUT = _log("test_gpu_trainer.py", "pytest", "tests/gpu/test_gpu_trainer.py .+++++++++++ Timeout ++++++++++++\n"
               "~~~~~ Stack of MainThread (1) ~~~~~\n"
               '  File "/r/tests/gpu/test_gpu_trainer.py", line 80, in test_resume_from_a_checkpoint\n'
               "    train(device, straight_dir, *args)\n+++++++++++ Timeout ++++++++++++", rc=1, seconds=105.2)
KILLED = _log("test_gpu_cp.py", "pytest", "tests/gpu/test_gpu_cp.py ..", rc=None, seconds=25.0)
CRASH = _log("test_gpu_varlen.py", "pytest", "tests/gpu/test_gpu_varlen.py \nFatal Python error: Segmentation fault\n"
             "\nCurrent thread 0x01 (most recent call first):\n  File \"x.py\", line 3 in f", rc=-11, seconds=3.0)
WHEELS_REFUSED = _log("wheels", "wheels", "error: externally-managed-environment\n\n"
                      "× This environment is externally managed", rc=1, seconds=1.0)
WHEELS_OK = _log("wheels", "wheels", "Processing ./w/torchdata-0.11.0-py3-none-any.whl\n"
                 "Successfully installed torchdata-0.11.0 tyro-0.9.1", seconds=2.0)
BENCH = _log("bench_gpu", "bench", "NVIDIA H100 80GB HBM3, torch 2.11.0+cu128; command: bench/bench_gpu.py --short\n"
             "\nring at CP=1 / SDPA, causal fwd+bwd, bf16: 4.10 ms / 3.90 ms = 1.051 (fastest of 3 each)\n"
             "TorchTitan: --short leaves TorchTitan out (about a minute per run); comparing with transformers only\n"
             "round 1 ours: 50,000 tok/s\nround 1 transformers: 40,000 tok/s\n\n"
             "Llama dim 2048, 8 layers, 16/8 heads of 128, vocab 2048, seq 8192, batch 1, bf16\n"
             "| system | tok/s | peak GiB |\n|---|---|---|\n| ours (train.py), causal | 50,000 | 9.10 |\n"
             "| transformers LlamaForCausalLM, causal | 40,000 | 12.00 |\n"
             "ours / transformers LlamaForCausalLM: tok/s 1.250, peak memory 0.758", limit=75, seconds=58.0)
STEP = _log("step_64k", "step", "dry run ...\nstep 3/3 ...\n" + FIGURES + json.dumps({
    "shape": "dim 2048, n_layers 8, n_heads 16, n_kv_heads 8", "seq_len": 65536, "steps": 3,
    "accelerator": "h100-sxm", "device": "NVIDIA H100 80GB HBM3", "predicted_peak_gib": 51.84,
    "predicted_step_s": 1.295, "predicted_step_s_band": [1.204, 1.402], "measured_peak_gib": 50.0,
    "measured_step_s": 1.4}), limit=60, seconds=40.0)


def _row(page: str, name: str) -> list[str]:
    line = next(line for line in page.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_pytests_closing_line_gives_the_counts_and_the_runner_the_seconds():
    page = summarize([PASSED, QUIET, FAILED, NOTHING])
    assert _row(page, "test_gpu_block_kernels.py") == ["test_gpu_block_kernels.py", "passed", "3", "0", "2", "12.5",
                                                       "25"]
    assert _row(page, "test_gpu_varlen.py")[1:3] == ["passed", "1"]
    assert _row(page, "test_gpu_memory.py")[1:4] == ["FAILED", "0", "1 + 1 error(s)"]
    assert _row(page, "test_gpu_x.py")[1] == "no GPU tests in it"
    assert "3 of 4 steps ok; not ok: test_gpu_memory.py. 50 s spent of 100 s of limits." in page


def test_a_timeout_and_a_crash_are_named_not_counted():
    timeout, killed, crash = (parse_step(text) for text in (TIMEOUT, KILLED, CRASH))
    assert timeout.result.startswith("timed out in test_resume_from_a_checkpoint: a test passed its pytest-timeout")
    assert killed.result == "timed out: the file passed its limit" and killed.seconds == 25.0
    assert crash.result == "crashed (signal 11), no closing line: Fatal Python error: Segmentation fault"
    assert not any(r.ok for r in (timeout, killed, crash)) and not all_ok([PASSED, CRASH]) and all_ok([PASSED])


def test_the_wheel_step_says_what_it_installed_or_how_to_fix_a_refusal():
    assert parse_step(WHEELS_OK).result == "installed 2 wheel(s)"
    refused = parse_step(WHEELS_REFUSED)
    assert not refused.ok and "PIP_BREAK_SYSTEM_PACKAGES=1" in refused.result, refused.result


def test_the_bench_figures_and_the_prediction_table_reach_the_page():
    page = summarize([PASSED, BENCH, STEP], title="1 x NVIDIA H100 80GB HBM3, torch 2.11.0+cu128")
    assert page.splitlines()[2] == "1 x NVIDIA H100 80GB HBM3, torch 2.11.0+cu128"
    lines = bench_lines(BENCH)
    assert "| ours (train.py), causal | 50,000 | 9.10 |" in lines and "round 1 ours: 50,000 tok/s" not in lines
    assert "- ours / transformers LlamaForCausalLM: tok/s 1.250, peak memory 0.758" in lines
    assert any(line.startswith("- TorchTitan: --short leaves") for line in lines)
    assert "| device peak, GiB | 51.84 | 50.00 | 1.04 |" in page  # predicted / measured, as every report
    assert "| step time, s | 1.295 (band 1.204..1.402) | 1.400 | 0.93 |" in page
    assert "hardware.accelerator = h100-sxm" in page


def test_a_step_without_figures_says_why():
    page = summarize([_log("step_64k", "step", "CUDA out of memory. Tried to allocate ...\nRuntimeError: OOM", rc=1)])
    assert "no figures: FAILED (exit 1): RuntimeError: OOM" in page


def test_the_runner_reads_pytests_real_closing_line_and_pytest_timeouts_stack_dump(tmp_path):
    case = tmp_path / "test_case.py"
    case.write_text("import time\n\ndef test_ok():\n    pass\n\ndef test_hangs():\n    time.sleep(60)\n")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--timeout=2", "--timeout-method=thread"]
    passed = run_step(Step("case", "pytest", [*command, "-k", "ok", str(case)], 60), str(tmp_path / "ok.log"))
    hung = run_step(Step("case", "pytest", [*command, str(case)], 60), str(tmp_path / "hung.log"))
    assert parse_step(passed).result == "passed" and parse_step(passed).counts == {"passed": 1, "deselected": 1}
    assert parse_step(hung).result.startswith("timed out in test_hangs: a test passed its pytest-timeout limit")


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaps in a container counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _grandchild_step(tmp_path, name: str, parent_sleeps: int, limit: float) -> tuple[str, int]:
    """A step as the GPU tier makes them: the step's process (pytest) starts a middle process in its group
    (torchrun), which starts a long-lived rank in a process group of its own (as torchrun does); the step's
    process then sleeps for `parent_sleeps` seconds and exits. Returns (log, the rank's pid)."""
    pid_file = tmp_path / f"{name}.pid"
    rank = "import time; time.sleep(60)"
    middle = (f"import subprocess, sys, time; rank = subprocess.Popen([sys.executable, '-c', {rank!r}], "
              f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(rank.pid)); time.sleep(60)")
    script = (f"import subprocess, sys, time, os\nsubprocess.Popen([sys.executable, '-c', {middle!r}])\n"
              f"while not os.path.exists({str(pid_file)!r}):\n    time.sleep(0.05)\n"
              f"print('started', flush=True)\ntime.sleep({parent_sleeps})\n")
    text = run_step(Step(name, "bench", [sys.executable, "-c", script], limit), str(tmp_path / f"{name}.log"))
    return text, int(pid_file.read_text())


def test_nothing_a_step_started_outlives_it(tmp_path):
    """Killed at its limit, or ended with a child still running (pytest-timeout exits without waiting for a test's
    trainer processes): either way the step's whole process group is gone before the next step starts."""
    killed, at_limit = _grandchild_step(tmp_path, "sleeper", parent_sleeps=60, limit=3)
    ended, left_behind = _grandchild_step(tmp_path, "leaver", parent_sleeps=0, limit=30)
    assert parse_step(killed).result == "timed out" and "started" in killed
    assert parse_step(ended).result == "ran"
    assert _gone(at_limit) and _gone(left_behind)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Not running, or gone within `within_s` (SIGKILL is asynchronous: a busy box can take a moment to reap)."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_limits_add_up_to_9_minutes_and_every_gpu_test_file_is_in_the_report():
    steps = plan("/out", ["w.whl"])
    assert wall_limit_s(steps) <= TOTAL_LIMIT_S == 540, [(s.name, s.limit_s, s.lane) for s in steps]
    names = {s.name for s in steps}
    on_disk = {f for f in os.listdir(os.path.join(ROOT, "tests", "gpu")) if f.startswith("test_gpu_")
               and f.endswith(".py")}
    assert on_disk - NOT_IN_REPORT == {os.path.basename(f) for f in gpu_test_files()} <= names
    assert [s.kind for s in steps][:2] == ["wheels", "compiled"]  # the compiled op settles the most: first
    assert [s.name for s in steps][-2:] == ["bench_gpu", "offload_3b"]
    bench = steps[-2]  # the bench's own budget ends before its step's limit, so it prints its last rows itself
    assert bench.command[1] == os.path.join("bench", "bench_gpu_report.py")
    assert float(bench.command[bench.command.index("--budget-s") + 1]) < bench.limit_s
    assert steps[0].command[1:] == ["-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                                    "w.whl"]  # into the interpreter itself: no --target folder to put on a path
    tests = [s for s in steps if s.kind == "pytest"]
    assert all(s.lane is not None for s in tests) and all(s.lane is None for s in steps if s.kind != "pytest")
    assert {s.lane for s in tests} == set(range(LANES))
    for s in tests:  # the marker's limit (tests/gpu/devices.py) and the command line's: below the file's
        assert f"--timeout={int(s.limit_s) - 5}" in s.command and s.env == {"GPU_TEST_LIMIT_S": str(int(s.limit_s) - 5)}
    assert wall_limit_s(steps) < sum(s.limit_s for s in steps)


def test_lanes_start_with_the_longest_and_even_out():
    assert lanes_of({"a": 100, "b": 60, "c": 50, "d": 40, "e": 10}, lanes=2) == {"a": 0, "b": 1, "c": 1, "d": 0,
                                                                                "e": 1}


def test_the_lanes_run_side_by_side_and_the_page_keeps_the_plans_order(tmp_path, monkeypatch, capsys):
    """Four lane steps in two lanes between two lone 1-second steps: about 5 s of wall time, not 7 in a row (lane 0:
    two 1-s steps; lane 1: one ended at its 2-s limit, then a 1-s one); each step's own limit
    still holds in its lane (the third lane step is ended at 2 s and the step after it in that lane runs); the page
    lists the steps in plan order whatever order they ended in; a lane step gets its own variables."""
    import harness.gpu_report as gpu_report

    def python(code: str) -> list[str]:
        return [sys.executable, "-c", code]

    sleep = python("import os, time; time.sleep(1); print(os.environ.get('MARK', '-'))")
    steps = [Step("first", "bench", sleep, 30), Step("a", "bench", sleep, 30, 0, {"MARK": "lane a"}),
             Step("b", "bench", sleep, 30, 0), Step("c", "bench", python("import time; time.sleep(60)"), 2, 1),
             Step("d", "bench", sleep, 30, 1), Step("last", "bench", sleep, 30)]
    monkeypatch.setattr(gpu_report, "plan", lambda out_dir, wheels, fake=False: steps)
    start = time.perf_counter()
    assert gpu_report.report(str(tmp_path), [], "lanes") == 1  # c timed out
    assert time.perf_counter() - start < 6.5  # 5 s and six interpreter starts (5.55 s once in a loaded CI)
    page = (tmp_path / "summary.md").read_text()
    rows = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["first", "a", "b", "c", "d", "last"], page
    assert _row(page, "c")[1] == "timed out" and "lane a" in (tmp_path / "a.log").read_text()
    assert "d, lane 2: ran" in capsys.readouterr().out


@pytest.mark.slow
def test_the_64k_steps_prediction_and_measurement_on_the_cpu_with_a_tiny_shape(tmp_path, capsys):
    """The same code as on the GPU (dry run, then train.py under torchrun) at 256 tokens, so its plumbing (the keys
    of dry_run.json and metrics.jsonl) cannot rot on machines without GPUs. Slow tier since issue 56 (the fast tier runs
    in minutes; CI runs both): a dry run and a measured step, 20 s."""
    figures = measure_step(str(tmp_path), seq_len=256, shape={"dim": 64, "n_layers": 2, "n_heads": 4,
                                                               "n_kv_heads": 2}, steps=2)
    assert all(math.isfinite(figures[k]) and figures[k] > 0 for k in ("predicted_peak_gib", "predicted_step_s",
                                                                         "measured_peak_gib", "measured_step_s"))
    page = summarize([_log("step_64k", "step", capsys.readouterr().out)])
    assert "| device peak, GiB |" in page and "| step time, s |" in page, page


COMPILED = _log("compiled_op", "compiled", "step 2/2 ...\n" + FIGURES + json.dumps({
    "kind": "compiled_op", "shape": "dim 2048, n_layers 8, n_heads 16, n_kv_heads 8", "seq_len": 8192,
    "dtype": "bfloat16", "steps": 2, "documents_kernel": "cudnn_thd", "bound": 1e-3, "runs": {
        "eager": {"loss": [7.6, 7.5], "peak_gib": 9.1, "step_s": 0.41},
        "compiled": {"loss": [7.6, 7.5], "peak_gib": 8.0, "step_s": 0.33, "loss_rel": 2e-4, "grad_norm_rel": 3e-3,
                     "graphs": 1, "graph_breaks": 0, "first_step_s": 41.0}}})
                 + "\ncompiled op: compiled: loss 2.0e-04 / grad norm 3.0e-03 from eager, bound 1e-03", rc=1,
                 limit=70, seconds=61.0)


def test_the_compiled_op_step_reaches_the_page_with_what_failed():
    page = summarize([COMPILED])
    assert "| compiled_op | FAILED (exit 1): " in page, page
    assert "## compiled_op: compiled against eager" in page and "(cudnn_thd)" in page
    assert "| compiled | 2.0e-04 | 3.0e-03 | 1 | 0 | 41.0 | 0.330 | 8.00 |" in page, page
    assert "| eager | - | - | - | - | - | 0.410 | 9.10 |" in page, page
    assert "- compiled op: compiled: loss 2.0e-04 / grad norm 3.0e-03 from eager, bound 1e-03" in page, page


@pytest.mark.timeout(300)
def test_the_cpu_twin_runs_the_compiled_op_step_and_writes_the_page(tmp_path):
    """`python -m harness.gpu_report --fake OUTDIR`: the report's runner, its first step (harness/gpu_compiled_op.py:
    eager, compiled and compiled under `op` AC, on one CPU rank at a tiny shape, float32) and the summary page, so the
    GPU command cannot rot where no GPU is. Its bounds hold on the CPU too: compiled within 1e-3 of eager, one graph,
    no break, none built after step 1."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "harness.gpu_report", "--fake", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    page = (tmp_path / "summary.md").read_text()
    assert "1 of 1 steps ok" in page and "## compiled_op: compiled against eager" in page, page
    log = (tmp_path / "compiled_op.log").read_text()
    figures = json.loads([line for line in log.splitlines() if line.startswith(FIGURES)][-1][len(FIGURES):])
    assert set(figures["runs"]) == {"eager", "compiled", "compiled, op AC"}, figures
    for name in ("compiled", "compiled, op AC"):
        run = figures["runs"][name]
        assert run["loss_rel"] <= 1e-3 and run["grad_norm_rel"] <= 1e-3 and run["graph_breaks"] == 0, figures
        assert run["graphs"] >= 1, figures


def test_with_no_folder_named_the_report_goes_where_the_committed_ones_are(tmp_path):
    """`./run_tests.sh --gpu --report` alone: bench/measurements/<gpu>_gpu_report_<date>, named as the committed
    reports are, and a second run that day gets a folder of its own."""
    import datetime

    from harness.gpu_report import default_report_folder

    day = datetime.date(2026, 12, 5)
    first = default_report_folder("NVIDIA H100 80GB HBM3", day, root=str(tmp_path))
    assert first == str(tmp_path / "bench" / "measurements" / "h100_gpu_report_2026-12-05")
    os.makedirs(first)
    assert default_report_folder("NVIDIA H100 80GB HBM3", day, root=str(tmp_path)) == first + "_2"
    h200 = default_report_folder("NVIDIA H200", day, root=str(tmp_path))
    assert os.path.basename(h200) == "h200_gpu_report_2026-12-05"
