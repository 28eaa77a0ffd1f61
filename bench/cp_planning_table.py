"""Planning table: the smallest context-parallel degree at which each sequence length fits an 80 GiB GPU.

Every cell is a dry-run measurement (training/dry_run.py: real model and composer on fake tensors, one optimizer step
under torch's FSDPMemTracker, on a fake process group of the cluster's size), not a formula. CP trades against
dp_shard on a fixed number of GPUs, so FSDP always shards over all of them.

    .venv/bin/python bench/cp_planning_table.py [RECIPE] [--gpus 64] [--seq 131072,1048576]

For each length the search starts where a rank would hold 64K tokens and doubles CP until the peak fits; the
table shows the peaks measured on the way (a larger CP only lowers them).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config.recipe import load_config  # noqa: E402
from training.dry_run import RUNTIME_RESERVE_GIB, PlanRow, measure_row  # noqa: E402

SEQ_LENS = (8192, 32768, 65536, 131072, 262144, 524288, 1048576)


def row_for(cfg, seq_len: int, cp: int, gpus: int):
    par = dataclasses.replace(cfg.parallelism, cp=cp, dp_shard=gpus // cp, dp_replicate=1, tp=1, pp=1)
    training = dataclasses.replace(cfg.training, seq_len=seq_len, local_batch_size=1, global_batch_size=-1)
    return PlanRow(f"{seq_len}", dataclasses.replace(cfg, parallelism=par, training=training))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/llama3_8b_1m.toml")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--seq", default=",".join(map(str, SEQ_LENS)))
    args = parser.parse_args()
    cfg = load_config(args.recipe)
    usable = cfg.hardware.device_memory_gib - RUNTIME_RESERVE_GIB
    start = time.perf_counter()
    rows = []
    for seq_len in (int(s) for s in args.seq.split(",")):
        cp, peaks, fit = max(1, seq_len // 65536), {}, None
        while cp <= args.gpus and fit is None:
            result = measure_row(row_for(cfg, seq_len, cp, args.gpus), args.gpus, cfg.hardware.gpus_per_node)
            peaks[cp] = result.peak_gib
            print(f"  seq {seq_len:>9,}  cp {cp:>3}  peak {result.peak_gib:6.1f} GiB  "
                  f"step {result.times['overlap_s']:.2f}s  mfu {100 * result.times['mfu_overlap']:.0f}%", flush=True)
            if result.peak_gib <= usable:
                fit = (cp, result)
            cp *= 2
        rows.append((seq_len, peaks, fit))
    cps = sorted({cp for _, peaks, _ in rows for cp in peaks})
    print(f"\n{cfg.model.name}, {args.gpus} GPUs x {cfg.hardware.device_memory_gib:g} GiB "
          f"({usable:g} GiB for tensors), "
          f"{cfg.training.dtype}, activation checkpointing {cfg.activation_checkpoint.mode}, one sequence per "
          f"data-parallel rank; peak GiB per rank measured by the dry run ({time.perf_counter() - start:.0f}s)\n")
    print("| seq len | " + " | ".join(f"CP {cp}" for cp in cps) + " | smallest CP that fits | step s (roofline) |")
    print("|---" * (len(cps) + 3) + "|")
    for seq_len, peaks, fit in rows:
        cells = [(f"**{peaks[cp]:.1f}**" if fit and cp == fit[0] else f"{peaks[cp]:.1f}") if cp in peaks else ""
                 for cp in cps]
        best = f"{fit[0]} (dp_shard {args.gpus // fit[0]})" if fit else f"none up to {args.gpus}"
        step = f"{fit[1].times['overlap_s']:.2f}" if fit else ""
        print(f"| {seq_len:,} | " + " | ".join(cells) + f" | {best} | {step} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
