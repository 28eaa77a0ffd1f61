"""The longest Llama 3.1 8B sequence that fits 1 and 8 H100s and H200s, by the dry run, with today's mechanisms and
with each memory cut of the frontier work added in turn, beside the published records.

    .venv/bin/python bench/bench_frontier.py [--only h100x1,h200x8] [--out FILE.json]

Every figure is the dry run's own measurement (training/planning/dry_run.py `measure_row`: the trainer's step on
fake tensors, two blocks probed and extrapolated to 32), in this process. The device peak grows linearly with the
tokens per rank at these lengths, so each rung is measured at two lengths, the largest length at the search grain
(64K tokens per GPU) under both the device and the host limit is read off the line, and that length is then
measured itself, stepping down a grain while it does not fit. Host: the training state (cpu_offload) and the
offloaded block inputs of a node, against `hardware.host_memory_gib` = 2,048 GiB. Takes ~20-30 min on 2 CPU cores.

Rungs (each keeps the ones before it; base = recipes/llama3_8b_500k_1gpu.toml's settings: state on the host, every
block checkpointed with its input offloaded, 64K-token MLP and norm tiles, the loss in 2K tiles; 8 GPUs: cp 8
zigzag ring):
  base             today's recipe settings before the frontier work
  tiles 8K         model.mlp_chunk_tokens = norm_chunk_tokens = 8192
  sublayer groups  parallelism.attention_sublayer_groups = 8
  no prefetch      activation_checkpoint.offload_prefetch = false
  keep last 2      activation_checkpoint.offload_keep_last = 2 (device for host: on 8 GPUs only, where the host
                   binds; on one GPU the host has room and two more block inputs on the device only shorten it)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from config.recipe import load_config  # noqa: E402
from training.planning.dry_run import RUNTIME_RESERVE_GIB, PlanRow, measure_row  # noqa: E402

BASE_RECIPE = os.path.join(ROOT, "recipes", "llama3_8b_500k_1gpu.toml")
HOST_GIB = 2048.0
GRAIN_PER_GPU = 65536
MACHINES = {"h100x1": ("h100-sxm", 80.0, 1), "h200x1": ("h200", 141.0, 1),
            "h100x8": ("h100-sxm", 80.0, 8), "h200x8": ("h200", 141.0, 8)}
RUNGS = [
    ("base", []),
    ("tiles 8K", ["--model.mlp_chunk_tokens", "8192", "--model.norm_chunk_tokens", "8192"]),
    ("sublayer groups", ["--parallelism.attention_sublayer_groups", "8"]),
    ("no prefetch", ["--activation_checkpoint.offload_prefetch", "false"]),
    ("keep last 2", ["--activation_checkpoint.offload_keep_last", "2"]),
]
PUBLISHED = {
    "h100x1": "ALST (ArcticTraining): 500K on one H100 (1.9 TB host)",
    "h200x1": "ArcticTraining's H200 recipe: 1.2M on one H200",
    "h100x8": "ALST: 3.7M on 8 H100; UPipe (arXiv 2602.21196): 5M on 8 H100",
    "h200x8": "none found for 8 H200",
}


def measure(machine: str, overrides: list[str], seq_len: int) -> dict:
    accelerator, device_gib, gpus = MACHINES[machine]
    args = ["--training.seq_len", str(seq_len), "--hardware.accelerator", accelerator,
            "--hardware.device_memory_gib", str(device_gib), "--hardware.host_memory_gib", str(HOST_GIB),
            "--hardware.gpus_per_node", str(gpus), "--parallelism.cp", str(gpus), "--parallelism.dp_shard", "1",
            "--parallelism.cp_load_balancer", "zigzag", "--checkpoint.enable", "false", *overrides]
    cfg = load_config(BASE_RECIPE, args)
    result = measure_row(PlanRow(str(seq_len), cfg), gpus, gpus)
    return {"seq_len": seq_len, "device_gib": result.peak_gib, "host_gib_per_node": result.host.per_node / 2**30,
            "usable_gib": device_gib - RUNTIME_RESERVE_GIB, "predicted_s": result.times["predicted_s"]}


def fits(point: dict) -> bool:
    return point["device_gib"] <= point["usable_gib"] and point["host_gib_per_node"] <= HOST_GIB


def longest(machine: str, overrides: list[str]) -> tuple[dict, int]:
    """The longest fitting length at the grain, and how many dry runs it took."""
    grain = GRAIN_PER_GPU * MACHINES[machine][2]
    low, high = measure(machine, overrides, 4 * grain), measure(machine, overrides, 8 * grain)
    runs = 2
    limit = None
    for key, cap in (("device_gib", low["usable_gib"]), ("host_gib_per_node", HOST_GIB)):
        slope = (high[key] - low[key]) / (high["seq_len"] - low["seq_len"])
        if slope > 0:
            reach = low["seq_len"] + (cap - low[key]) / slope
            limit = reach if limit is None else min(limit, reach)
    seq = max(grain, int(limit // grain) * grain) if limit is not None else 64 * grain
    point = measure(machine, overrides, seq)
    runs += 1
    while not fits(point) and seq > grain:
        seq -= grain
        point, runs = measure(machine, overrides, seq), runs + 1
    while fits(point):  # the line is a model: one grain more may still fit
        above = measure(machine, overrides, seq + grain)
        runs += 1
        if not fits(above):
            break
        seq, point = seq + grain, above
    return point, runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MACHINES), help="comma-separated machines: " + ", ".join(MACHINES))
    parser.add_argument("--out", default="", help="also write the table as JSON here")
    args = parser.parse_args()
    rows = []
    for machine in args.only.split(","):
        overrides = []
        for rung, extra in RUNGS:
            if rung == "keep last 2" and MACHINES[machine][2] == 1:
                continue
            overrides = overrides + extra
            start = time.perf_counter()
            point, runs = longest(machine, overrides)
            gpus = MACHINES[machine][2]
            row = {"machine": machine, "rung": rung, "longest_seq_len": point["seq_len"],
                   "tokens_per_gpu": point["seq_len"] // gpus, "device_gib": round(point["device_gib"], 1),
                   "usable_gib": point["usable_gib"], "host_gib_per_node": round(point["host_gib_per_node"]),
                   "predicted_step_s": round(point["predicted_s"]), "dry_runs": runs,
                   "seconds": round(time.perf_counter() - start)}
            rows.append(row)
            if args.out:  # after every row: a long bench stopped early keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"rows": rows, "published": PUBLISHED, "host_memory_gib": HOST_GIB}, f, indent=1)
            print(f"{machine:7s} {rung:16s} longest {row['longest_seq_len']:>10,} tokens "
                  f"({row['tokens_per_gpu']:>9,}/GPU)  device {row['device_gib']:6.1f} of {row['usable_gib']:g} GiB  "
                  f"host {row['host_gib_per_node']:>5,} GiB/node  {row['predicted_step_s']:>6,} s/step  "
                  f"({runs} dry runs, {row['seconds']} s)", flush=True)
        print(f"{machine:7s} published: {PUBLISHED[machine]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
