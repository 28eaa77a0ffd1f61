"""What a block's recompute + backward holds at its peak, by category, for one stage of a recipe (fake tensors).

    python bench/bench_layer_memory.py recipes/llama3_8b_1m_8gpu.toml --gpus 8 [--stage -1] [--layers 2]
        [--seq-len 4194304 --cp 8] [--set model.mlp_chunk_tokens=0 ...]

One rank of the planning probes' fake world (training/planning/fake/world.py) builds the stage's model with
`--layers` blocks through the real composer (FSDP2, activation checkpointing and offload, context parallelism) and
runs one micro-step under harness/memory_breakdown.py's dispatch mode: the printed peak is the transient
part of the step (parameters, gradients and optimizer state excluded) and each category is what the code of that part
held at that moment. Document masking is measured as its one-document row (causal), as the dry run does.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed._tools.mod_tracker import ModTracker  # noqa: E402

from config.recipe import load_config  # noqa: E402
from training import step  # noqa: E402
from training.planning.fake.world import fake_batch, fake_world  # noqa: E402
from harness.memory_breakdown import BreakdownMode, format_breakdown  # noqa: E402
from training.ramp import resolve_stages  # noqa: E402


def stage_config(recipe: str, overrides: list[str], gpus: int, stage: int, layers: int, seq_len: int, cp: int):
    cfg = resolve_stages(load_config(recipe, overrides), gpus)[stage].cfg
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers))
    if seq_len:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_len=seq_len))
    if cp:
        p = cfg.parallelism
        cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(p, cp=cp, dp_shard=gpus // (cp * p.tp * p.pp)))
    return cfg


def breakdown(cfg, world: int) -> BreakdownMode:
    """One micro-step of `cfg` on rank 0 of a fake world of `world` (training/planning/fake/world.py), under the
    breakdown mode."""
    with fake_world(cfg, world) as fake:
        batch, modules = fake_batch(cfg), ModTracker()
        with modules, BreakdownMode(modules) as mode:
            step.micro_step(fake.setup, batch, fake.global_tokens)
    return mode


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--stage", type=int, default=-1, help="ramp stage index (default: the last)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=0, help="override the stage's seq_len")
    ap.add_argument("--cp", type=int, default=0, help="override the stage's cp (dp_shard follows)")
    ap.add_argument("--top", type=int, default=12, help="how many raw labels to list")
    ap.add_argument("--set", action="append", default=[], help="section.key=value, as run_train.sh's --section.key")
    args = ap.parse_args(argv)
    overrides = [part for item in args.set for part in (f"--{item.split('=', 1)[0]}", item.split("=", 1)[1])]
    cfg = stage_config(args.recipe, overrides, args.gpus, args.stage, args.layers, args.seq_len, args.cp)
    p, t = cfg.parallelism, cfg.training
    tokens = t.local_batch_size * t.seq_len // p.cp
    print(f"{cfg.recipe_path} seq_len {t.seq_len:,} cp {p.cp} tp {p.tp} dp_shard {p.dp_shard}, {args.layers} blocks, "
          f"mlp_chunk_tokens {cfg.model.mlp_chunk_tokens}, offload {cfg.activation_checkpoint.offload}")
    print(format_breakdown(breakdown(cfg, args.gpus), tokens, args.top))


if __name__ == "__main__":
    main()
