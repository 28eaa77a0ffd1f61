"""Zigzag vs the documents CP layout on packed rows, side by side (issue 20): balance and bytes from the plans, and
a real 4-rank gloo step timed both ways.

Counts (no processes; harness/cp_balance_counts.py says what each number is): for CP 2, 4, 8, 16 at 128K and 1M
tokens, rows packed from three length mixes (web-like lognormal(6.5, 1.0); heavy tail 256 x (1 + Pareto(1.1));
long-document mix, 95% web-like and 5% of 64K-512K tokens) and a row of one document. Per point, `--rows` rows are
drawn; the worst row's busiest/mean and ring-step efficiency are printed, and the mean over rows of the busiest
rank's CP bytes documents / zigzag. Targets: busiest/mean <= 1.05 and ring-step efficiency >= 0.9 at CP 4, 8, 16;
bytes <= 0.3 on web-like at CP 4 and 8.

Attention alone: 4 gloo ranks x 1 thread, fwd+bwd of the ring on one web-like row at seq 16K, zigzag vs documents,
interleaved: the busiest rank's CPU time (what a step takes when every rank has its own core) and the wall time.

Timed: the trainer (train.py under torch.distributed.run) on 4 gloo ranks, cp 4, debug model, seq 16K, pydoc
documents with document masking, once per layout (alternating order over --rounds); the summed step times after the
warm-up steps. Target: documents / zigzag <= 0.85.

    python bench/bench_cp_balance.py [--rows 4] [--seqs 131072,1048576] [--attention-reps 3] [--no-trainer]
                                     [--steps 6 --warmup 2 --rounds 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
from harness.cp_balance_counts import MIXES, layout_figures, packed_row  # noqa: E402
from parallelisms.cp.plan_layout import DocumentLayout  # noqa: E402
from parallelisms.cp.layouts import DOCUMENTS  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

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
        env = child_env()
        env.pop("OMP_NUM_THREADS", None)  # the trainer sizes its threads itself
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return read_metrics(out)


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
            if balancer == DOCUMENTS:
                balance += [r["attention_balance"] for r in records[warmup:] if "attention_balance" in r]
    z, d = (statistics.fmean(times[b]) for b in ("zigzag", "documents"))
    print(f"\n4 gloo ranks, cp 4, debug model, seq {seq_len}, pydoc documents, document masking, {os.cpu_count()} "
          f"cores; steps {warmup + 1}-{steps} summed, {rounds} round(s)")
    print(f"zigzag {z:.2f} s, documents {d:.2f} s: documents / zigzag = {d / z:.3f}  (target <= 0.85; per round "
          f"{', '.join(f'{b / a:.3f}' for a, b in zip(times['zigzag'], times['documents']))})")
    if balance:
        print(f"attention_balance of the documents run (metrics.jsonl): mean {statistics.fmean(balance):.3f}")


def _attention_rank(rank, size, ids, shape, reps):
    """(wall of the slowest rank, CPU seconds of the busiest rank) per layout: the fastest of `reps` interleaved
    attention fwd+bwd calls on this rank's shard (the CPU time is what a rank with its own core would take)."""
    import time

    import torch
    import torch.distributed as dist

    from parallelisms.comm import Collectives
    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.plan_pieces import DocumentShards

    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(rank)
    local = ids.size(1) // size
    q, grad = (torch.randn(1, heads, local, head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, local, head_dim, generator=gen) for _ in range(2))
    shards = {lb: DocumentShards.from_layout(ids, DocumentLayout.plan(ids, size)) if lb == DOCUMENTS
              else DocumentShards.from_full(ids, size, lb) for lb in ("zigzag", "documents")}

    def step(lb):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ring_attention(*leaves, dist.group.WORLD, is_causal=True, load_balancer=lb,
                       _documents=shards[lb]).backward(grad)

    def worst(value):
        return Collectives(torch.device("cpu")).reduce_values([value], op="max")[0]

    best = {}
    for i in range(reps + 1):
        for lb in ("zigzag", "documents"):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            step(lb)
            measured = (worst(time.perf_counter() - wall), worst(time.process_time() - cpu))
            if i:  # the first round warms up
                best[lb] = tuple(min(a, b) for a, b in zip(best.get(lb, measured), measured))
    return best


def attention_steps(seq_len: int, reps: int, seed: int) -> None:
    """The attention alone, 4 gloo ranks x 1 thread, on one web-like row (pydoc's documents are ~1.5K tokens)."""
    from harness.cp_balance_counts import web_like
    from tests.distributed import run_ranks

    ids = packed_row(web_like, seq_len, np.random.default_rng(seed))[None]
    shape = (16, 4, 16)  # the debug model's attention: 16 query heads, 4 K/V heads, head dim 16
    best = run_ranks(_attention_rank, 4, args=(ids, shape, reps), threads=1, timeout=1800)[0]
    (zw, zc), (dw, dc) = best["zigzag"], best["documents"]
    print(f"\nattention fwd+bwd alone, 4 gloo ranks x 1 thread, seq {seq_len}, one web-like row, heads 16/4, dim 16, "
          f"fastest of {reps}:")
    print(f"busiest-rank CPU time: zigzag {zc:.3f} s, documents {dc:.3f} s: documents / zigzag = {dc / zc:.3f}")
    print(f"wall time of the slowest rank: zigzag {zw:.3f} s, documents {dw:.3f} s: {dw / zw:.3f} "
          f"({os.cpu_count()} cores shared by 4 ranks: wall time measures the total CPU work, not the balance)")


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
    parser.add_argument("--attention-reps", type=int, default=3, help="0: skip the attention-alone timing")
    args = parser.parse_args()
    count_table([int(s) for s in args.seqs.split(",")], [int(c) for c in args.cps.split(",")], args.rows, args.seed)
    if args.attention_reps:
        attention_steps(args.seq_len, args.attention_reps, args.seed)
    if not args.no_trainer:
        timed_steps(args.steps, args.warmup, args.seq_len, args.rounds)


if __name__ == "__main__":
    main()
