"""bench/bench_gpu.py prints the dry run's prediction beside each of our measured runs (issue 37): the accelerator a
CUDA device name maps to, the dry run run with our side's own overrides, and the rows' ratios. Run here on a tiny
shape with a made-up measurement (the GPU supplies the real one)."""
import argparse

from bench import bench_gpu


def test_device_names_map_to_the_dry_runs_accelerators():
    assert bench_gpu.accelerator_of("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert bench_gpu.accelerator_of("NVIDIA H200") == "h200"
    assert bench_gpu.accelerator_of("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert bench_gpu.accelerator_of("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert bench_gpu.accelerator_of("NVIDIA L4") is None


def test_prediction_rows_run_the_dry_run_with_our_sides_overrides():
    args = argparse.Namespace(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq=256, batch=1, steps=2, lr=3e-4,
                              compile="false", ac="none", timeout=300)
    step_s, peak = bench_gpu.predicted(args, False, "h100-sxm")
    assert 0 < step_s < 0.01 and 0 < peak < 1
    best = {"ours": (256 / (2 * step_s), float("nan"), 2 * peak)}  # measured: half the predicted speed, twice the memory
    rows = bench_gpu.prediction_rows(args, best, "h100-sxm")
    assert len(rows) == 3 and "| 0.50 |" in rows[2] and rows[2].rstrip().endswith("| 0.500 |"), rows
    assert bench_gpu.predicted(args, False, None) is None and bench_gpu.prediction_rows(args, best, None) == []
