"""Zigzag vs the documents CP layout on packed rows, side by side (issue 20): balance and bytes from the plans, and
a real 4-rank gloo step timed both ways.

Counts (no processes; bench/cp_balance_counts.py says what each number is): for CP 2, 4, 8, 16 at 128K and 1M
tokens, rows packed from three length mixes (web-like lognormal(6.5, 1.0); heavy tail 256 x (1 + Pareto(1.1));
long-document mix, 95% web-like and 5% of 64K-512K tokens) and a row of one document. Per point, `--rows` rows are
drawn; the worst row's busiest/mean and ring-step efficiency are printed, and the mean over rows of the busiest
rank's CP bytes documents / zigzag. Targets: busiest/mean <= 1.05 and ring-step efficiency >= 0.9 at CP 4, 8, 16;
bytes <= 0.3 on web-like at CP 4 and 8.

Timed: the trainer (train.py under torch.distributed.run) on 4 gloo ranks, cp 4, debug model, seq 16K, pydoc
documents with document masking, once per layout (alternating order over --rounds); the summed step times after the
warm-up steps. Target: documents / zigzag <= 0.85.

    python bench/bench_cp_balance.py [--rows 4] [--seqs 131072,1048576] [--no-trainer] [--steps 6 --warmup 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.cp_balance_counts import MIXES, layout_figures, packed_row  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "debug.toml")


def count_table(seqs: list[int], cps: list[int], rows: int, seed: int) -> None:
    print(f"{'tokens':>8} {'mix':<13} {'CP':>3}  {'busiest/mean z':>14} {'d':>6}  {'step eff z':>10} {'d':>6}  "
          f"{'bytes d/z':>9}  {'pairs d/z':>9}")
    rng = np.random.default_rng(seed)
    for seq in seqs:
        for name, mix in [*MIXES.items(), ("one document", None)]:
            batch = [packed_row(mix, seq, rng)[None] for _ in range(rows if mix is not None else 1)]
            for cp in cps:
                fig = {lb: [layout_figures(ids, cp, lb) for ids in batch] for lb in ("zigzag", "documents")}
                worst = {lb: (max(f["busiest/mean"] for f in fs), min(f["ring-step eff"] for f in fs))
                         for lb, fs in fig.items()}
                byte_ratio = statistics.fmean(d["bytes"] / z["bytes"] for d, z in zip(fig["documents"], fig["zigzag"]))
                pair_ratio = sum(f["pairs"] for f in fig["documents"]) / sum(f["pairs"] for f in fig["zigzag"])
                print(f"{seq:>8} {name:<13} {cp:>3}  {worst['zigzag'][0]:>14.3f} {worst['documents'][0]:>6.3f}  "
                      f"{worst['zigzag'][1]:>10.3f} {worst['documents'][1]:>6.3f}  {byte_ratio:>9.3f}  "
                      f"{pair_ratio:>9.4f}", flush=True)


def run_trainer(balancer: str, overrides: list[str]) -> list[dict]:
    """The trainer on 4 forked-by-torchrun ranks; its metrics.jsonl records."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               os.path.join(ROOT, "train.py"), RECIPE, *overrides, "--job.dump_folder", out,
               "--parallelism.cp_load_balancer", balancer]
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("OMP_NUM_THREADS", None)  # the trainer sizes its threads itself
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def timed_steps(steps: int, warmup: int, seq_len: int, rounds: int) -> None:
    overrides = ["--training.steps", str(steps), "--training.seq_len", str(seq_len), "--training.local_batch_size",
                 "1", "--parallelism.dp_shard", "1", "--parallelism.cp", "4", "--data.document_masking", "true",
                 "--metrics.enable_tensorboard", "false"]
    times = {"zigzag": [], "documents": []}
    balance = []
    for i in range(rounds):
        for balancer in ("zigzag", "documents") if i % 2 == 0 else ("documents", "zigzag"):
            records = run_trainer(balancer, overrides)
            times[balancer].append(sum(r["step_time"] for r in records[warmup:]))
            if balancer == "documents":
                balance += [r["attention_balance"] for r in records[warmup:] if "attention_balance" in r]
    z, d = (statistics.fmean(times[b]) for b in ("zigzag", "documents"))
    print(f"\n4 gloo ranks, cp 4, debug model, seq {seq_len}, pydoc documents, document masking, {os.cpu_count()} "
          f"cores; steps {warmup + 1}-{steps} summed, {rounds} round(s)")
    print(f"zigzag {z:.2f} s, documents {d:.2f} s: documents / zigzag = {d / z:.3f}  (target <= 0.85; per round "
          f"{', '.join(f'{b / a:.3f}' for a, b in zip(times['zigzag'], times['documents']))})")
    if balance:
        print(f"attention_balance of the documents run (metrics.jsonl): mean {statistics.fmean(balance):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="rows drawn per (length, mix)")
    parser.add_argument("--seqs", default="131072,1048576")
    parser.add_argument("--cps", default="2,4,8,16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trainer", action="store_true", help="only the counts, no timed run")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    count_table([int(s) for s in args.seqs.split(",")], [int(c) for c in args.cps.split(",")], args.rows, args.seed)
    if not args.no_trainer:
        timed_steps(args.steps, args.warmup, args.seq_len, args.rounds)


if __name__ == "__main__":
    main()
