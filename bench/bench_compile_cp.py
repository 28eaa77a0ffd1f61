"""Compiled against eager trainer throughput under context parallelism, side by side in one run (issue 47).

The debug recipe at CP 2 (2 gloo ranks, zigzag ring), seq 4096, fp32, once with `training.compile = false` and once
with `true` (each whole block one graph, the CP attention the registered op parallelisms/cp/op.py; inductor's C++
backend on CPU). The first steps (compile, warm-up) are dropped and the median of the rest is reported, with the
graphs dynamo built and the graph breaks it saw. A measurement on a shared 2-core box, not a test.

    python bench/bench_compile_cp.py [--steps 8] [--seq 4096] [--cp-impl ring]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/bench_compile_cp.py` puts bench/ first on the path, not the root
    sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402


def run_trainer(compiled: bool, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes/debug.toml"),
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", "1", "--training.dtype", "float32",
               "--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--parallelism.cp_impl", args.cp_impl,
               "--training.compile", "true" if compiled else "false", "--job.dump_folder", out,
               "--metrics.enable_tensorboard", "false"]
        env = child_env()
        env.pop("OMP_NUM_THREADS", None)  # the trainer splits the cores between its local ranks itself
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def summarize(records: list[dict], skip: int) -> dict:
    kept = records[skip:]
    compile_ = records[-1].get("compile", {})
    return {"tok/s": statistics.median(r["tokens_per_sec"] for r in kept),
            "step s": statistics.median(r["step_time"] for r in kept),
            "graphs": compile_.get("unique_graphs", "-"), "breaks": sum(compile_.get("graph_breaks", {}).values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp-impl", default="ring")
    args = parser.parse_args()
    rows = {name: summarize(run_trainer(name == "compiled", args), skip=3) for name in ("eager", "compiled")}
    print(f"debug recipe, CP 2 ({args.cp_impl}), seq {args.seq}, local batch 1, fp32, {os.cpu_count()} cores, "
          f"median of steps 4-{args.steps}")
    print(f"{'run':>9} {'tok/s':>9} {'step s':>8} {'graphs':>7} {'breaks':>7}")
    for name, r in rows.items():
        print(f"{name:>9} {r['tok/s']:>9,.0f} {r['step s']:>8.3f} {r['graphs']:>7} {r['breaks']:>7}")
    print(f"compiled / eager tokens per second: {rows['compiled']['tok/s'] / rows['eager']['tok/s']:.3f}")


if __name__ == "__main__":
    main()
