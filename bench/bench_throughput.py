"""Trainer throughput on the debug model shape (seq 512, local batch 8): 1 process vs 2 processes, in one run.

Runs the real trainer (train.py under torchrun) and reads its metrics.jsonl; the first steps (warm-up, allocator)
are dropped and the median of the rest is reported. MFU is against the GEMM peak each run measures at start-up
(same dtype, same thread split as training), i.e. against what this box can physically do.

    python bench/bench_throughput.py [--steps 12] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/bench_throughput.py` puts bench/ first on the path, not the root
    sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
from training.metrics import read_metrics  # noqa: E402


def run_trainer(nproc: int, steps: int, dtype: str, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes/debug.toml"),
               "--training.steps", str(steps), "--training.seq_len", "512", "--training.local_batch_size", "8",
               "--training.dtype", dtype, "--parallelism.dp_shard", str(nproc), "--job.dump_folder", out,
               "--metrics.enable_tensorboard", "false", *extra]
        env = child_env()
        env.pop("OMP_NUM_THREADS", None)  # the trainer splits the cores between its local ranks itself
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return read_metrics(out)


def summarize(records: list[dict], skip: int) -> dict:
    kept = records[skip:]
    return {
        "tok/s": statistics.median(r["tokens_per_sec"] for r in kept),
        "tok/s/rank": statistics.median(r["tokens_per_sec_per_rank"] for r in kept),
        "mfu": statistics.median(r["mfu"] for r in kept),
        "peak GFLOP/s/rank": kept[0]["peak_flops_per_rank"] / 1e9,
        "step s": statistics.median(r["step_time"] for r in kept),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    rows = {n: summarize(run_trainer(n, args.steps, args.dtype, []), skip=3) for n in (1, 2)}
    print(f"debug model, seq 512, local batch 8, {args.dtype}, {os.cpu_count()} cores")
    print(f"{'processes':>10} {'tok/s':>9} {'tok/s/rank':>11} {'MFU':>7} {'peak GFLOP/s/rank':>18} {'step s':>7}")
    for n, r in rows.items():
        print(f"{n:>10} {r['tok/s']:>9,.0f} {r['tok/s/rank']:>11,.0f} {100 * r['mfu']:>6.1f}% "
              f"{r['peak GFLOP/s/rank']:>18.0f} {r['step s']:>7.2f}")
    print(f"2-process / 1-process tok/s: {rows[2]['tok/s'] / rows[1]['tok/s']:.2f}")


if __name__ == "__main__":
    main()
