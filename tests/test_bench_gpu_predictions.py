"""bench/bench_gpu.py prints the dry run's prediction beside each of our measured runs (issue 37): the accelerator a
CUDA device name maps to, the dry run run with our side's own overrides, and the rows' ratios. Run here on a tiny
shape with a made-up measurement (the GPU supplies the real one)."""
import argparse

import pytest

from bench import bench_gpu


def test_device_names_map_to_the_dry_runs_accelerators():
    assert bench_gpu.accelerator_of("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert bench_gpu.accelerator_of("NVIDIA H200") == "h200"
    assert bench_gpu.accelerator_of("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert bench_gpu.accelerator_of("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert bench_gpu.accelerator_of("NVIDIA L4") is None


@pytest.mark.slow
def test_prediction_rows_run_the_dry_run_with_our_sides_overrides():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): dry runs of the prediction rows, 22 s."""
    args = argparse.Namespace(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq=256, batch=1, steps=2, lr=3e-4,
                              compile="false", ac="none", timeout=300)
    step_s, peak = bench_gpu.predicted(args, False, "h100-sxm")
    assert 0 < step_s < 0.01 and 0 < peak < 1
    best = {"ours": (256 / (2 * step_s), float("nan"), 2 * peak)}  # measured: half the predicted speed, twice the memory
    rows = bench_gpu.prediction_rows(args, best, "h100-sxm")
    assert len(rows) == 3 and "| 0.50 |" in rows[2] and rows[2].rstrip().endswith("| 0.500 |"), rows
    assert bench_gpu.predicted(args, False, None) is None and bench_gpu.prediction_rows(args, best, None) == []


def test_one_run_compares_eager_and_compiled_at_both_lengths(monkeypatch, capsys):
    """Issue 36's GPU lines come from one bench run: ours eager and compiled against the transformers loop at --seq,
    and again at --long-seq, with the dry run's prediction rows; with --float8, ours in float8 against ours in bf16
    (issue 38). The trainers are stand-ins here (no GPU)."""
    import torch

    import training.hardware

    runs = []

    def ours(args, out, documents, compile_=None, float8="off"):
        runs.append(("ours" if float8 == "off" else f"ours-{float8}", args.seq, compile_ or args.compile))
        return (2000.0 if compile_ == "true" else 1800.0 if float8 != "off" else 1500.0), 0.3, 10.0

    def loop(args):
        runs.append(("transformers", args.seq, None))
        return 1000.0, float("nan"), 12.0

    monkeypatch.setattr(bench_gpu, "run_ours", ours)
    monkeypatch.setattr(bench_gpu, "run_transformers", loop)
    monkeypatch.setattr(bench_gpu, "torchtitan_unavailable", lambda: "not installed here")
    monkeypatch.setattr(bench_gpu, "predicted", lambda args, documents, accelerator, compile_=None, float8="off":
                        (0.001, 1.0))
    monkeypatch.setattr(training.hardware, "peak_flops", lambda device, dtype: (989e12, "test"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(bench_gpu.sys, "argv", ["bench_gpu.py", "--only", "trainers", "--rounds", "1",
                                                "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                                                "--seq", "256", "--long-seq", "512", "--float8", "tensorwise"])
    assert bench_gpu.main() == 0
    out = capsys.readouterr().out
    assert sorted(runs) == sorted([(side, seq, compiled) for seq in (256, 512) for side, compiled in
                                   (("ours", "false"), ("ours", "true"), ("transformers", None),
                                    ("ours-tensorwise", "false"))])
    assert out.count("ours-float8 / ours (train.py): tok/s 1.200") == 2
    assert out.count("ours-compiled / transformers LlamaForCausalLM: tok/s 2.000") == 2
    assert out.count("ours / transformers LlamaForCausalLM: tok/s 1.500, peak memory 0.833") == 2
    assert out.count("compile true |") == 2 and out.count("seq 512, batch 1") == 1 and "seq 512, AC none" in out
