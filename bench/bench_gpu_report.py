"""The GPU report's bench step (`./run_tests.sh --gpu --report`, harness/gpu_report.py): bench/bench_gpu.py's trainer
comparison on the bench shape at 8K and 64K tokens -- our trainer eager, compiled and with documents beside the
transformers loop, and TorchTitan where a release bench_gpu drives imports -- one run each, under a time budget.

    python bench/bench_gpu_report.py [--budget-s 78] [--dim 2048] [--n-layers 8] [--n-heads 16] [--n-kv-heads 8]

Why not bench_gpu.py itself: it prints its table when every run of a length has ended, so a step cut at its limit
left nothing on the page (the first H200's `--short` was cut after its first run, bench/measurements/
h200_gpu_report_2026-12-04). Here each run prints its row the moment it ends (ROW, one JSON line that
harness/report_summary.py turns into the table), runs go in the order of what they settle (the 8K comparison with
transformers first, the 64K runs last), and a run starts only while its estimate (RUN_ESTIMATES_S) fits what is left
of --budget-s; a run that does not fit prints a NOT_RUN line with its estimate and the time left, so the page says
what was left out. --budget-s 0: no budget, every run (about 5 minutes with TorchTitan).

Each run is one of bench_gpu.py's (`run_ours`, `run_transformers`, `run_torchtitan`): the same overrides, the same
peers, the same MFU bases (causal attention as half of full, and in full); fewer steps (STEPS), one round.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.report_summary import BENCH_NOT_RUN as NOT_RUN, BENCH_ROW as ROW  # noqa: E402
SEQS = (8192, 65536)
STEPS = {8192: (6, 2), 65536: (4, 2)}
"""(steps, warm-up steps left out of the median) per length: 8K as bench_gpu --short; at 64K a step of the bench shape
takes 0.5-1.3 s on an H200 (docs/gpu_step.md), so two measured steps after two of warm-up."""
RUN_ESTIMATES_S = {(8192, "ours"): 20, (8192, "transformers"): 15, (8192, "ours-documents"): 20,
                   (8192, "torchtitan"): 60, (8192, "ours-compiled"): 30, (65536, "ours-documents"): 25,
                   (65536, "ours"): 30, (65536, "transformers"): 30, (65536, "ours-compiled"): 40}
"""Seconds per run, start to end, in the order they run: estimates until a GPU has run this script. From the first
H200 (bench/measurements/h200_gpu_report_2026-12-04): a one-rank train.py launch of two 8K steps took ~25-33 s with
four test lanes sharing the node (compile 6.9-8.6 s of it), so ~20 s alone; the transformers loop starts no torchrun;
TorchTitan about a minute per run (bench_gpu.py); at 64K the steps add 2-6 s (0.57 s documents, 1.30 s plain eager,
1.24 s compiled per step there) and the allocator's first 50 GiB."""


def plan_runs(torchtitan: bool) -> list[tuple[int, str]]:
    """(seq, side) in the order they run: at 8K ours against transformers first (the comparison every image can
    make), then documents (TorchTitan's counterpart) and TorchTitan, then compiled; at 64K documents first (the
    length's fastest of ours), then eager against transformers, then compiled."""
    return [key for key in RUN_ESTIMATES_S if torchtitan or key[1] != "torchtitan"]


def run_plan(runs: list[tuple[int, str]], budget_s: float, measure: Callable[[int, str, float], dict],
             clock: Callable[[], float] = time.monotonic) -> None:
    """Runs each (seq, side) whose estimate fits what is left of `budget_s` (0: all), printing its row, a failed
    run's one line, or a NOT_RUN line. `measure(seq, side, timeout_s)` returns the row's figures."""
    deadline = clock() + budget_s if budget_s else None
    for seq, side in runs:
        need = RUN_ESTIMATES_S[(seq, side)]
        left = deadline - clock() if deadline is not None else None
        if left is not None and need > left:
            print(NOT_RUN + json.dumps({"seq": seq, "side": side, "estimate_s": need, "left_s": round(max(left, 0))}),
                  flush=True)
            continue
        start = clock()
        try:
            figures = measure(seq, side, left if left is not None else 600)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            line = (str(err).splitlines() or [type(err).__name__])[0]
            print(ROW + json.dumps({"seq": seq, "side": side, "error": line[-200:]}), flush=True)
            continue
        print(ROW + json.dumps({"seq": seq, "side": side, **figures, "seconds": round(clock() - start, 1)}),
              flush=True)


def measure_with(args, folder: str, assets) -> Callable[[int, str, float], dict]:
    """The real runs (bench_gpu.py's), with their MFU on both bases against this GPU's peak."""
    import torch

    from bench.bench_gpu import SIDES, _model_config, run_ours, run_torchtitan, run_transformers
    from models.llama import flops_per_token
    from training.hardware import Device, peak_flops

    cfg = _model_config(args)
    peak, _ = peak_flops(Device("cuda", "nccl", torch.device("cuda")), torch.bfloat16)

    def measure(seq: int, side: str, timeout_s: float) -> dict:
        steps, warmup = STEPS[seq]
        run = argparse.Namespace(**{**vars(args), "seq": seq, "steps": steps, "warmup": warmup, "timeout": timeout_s})
        out = os.path.join(folder, f"{side}-{seq}")
        if side.startswith("ours"):
            tps, logged, peak_gib = run_ours(run, out, documents=side == "ours-documents",
                                             compile_="true" if side == "ours-compiled" else None)
        elif side == "transformers":
            tps, logged, peak_gib = run_transformers(run)
        else:
            (tps, logged), peak_gib = run_torchtitan(run, assets, out), float("nan")
        known = [x if x == x else None for x in (logged, peak_gib)]  # NaN: the side does not report it
        return {"system": SIDES[side], "tok_s": tps, "peak_gib": known[1], "mfu_logged": known[0],
                "mfu_causal": flops_per_token(cfg, seq, causal=True) * tps / peak,
                "mfu_full": flops_per_token(cfg, seq, causal=False) * tps / peak}

    return measure


def main() -> int:
    from bench.transformers_peer import add_shape_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(parser)
    parser.add_argument("--budget-s", type=float, default=0, help="seconds for all runs (0: no budget, every run)")
    args = parser.parse_args()
    args.batch, args.lr, args.compile, args.ac, args.torchtitan_attention = 1, 3e-4, "false", "none", "flex"
    import torch

    if not torch.cuda.is_available():
        print(f"bench_gpu_report: no CUDA device visible to torch {torch.__version__}; nothing measured")
        return 0
    from bench.bench_gpu import _model_config, torchtitan_unavailable, write_torchtitan_assets

    start = time.monotonic()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; command: "
          f"{' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}", flush=True)
    missing = torchtitan_unavailable()
    if missing:
        print(f"TorchTitan: {missing}; comparing with transformers only", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        assets = None if missing else write_torchtitan_assets(os.path.join(tmp, "assets"),
                                                              _model_config(args).vocab_size)
        budget = max(args.budget_s - (time.monotonic() - start), 1) if args.budget_s else 0
        run_plan(plan_runs(torchtitan=not missing), budget, measure_with(args, tmp, assets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
