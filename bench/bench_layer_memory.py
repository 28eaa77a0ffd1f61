"""What a block's recompute + backward holds at its peak, by category, for one stage of a recipe (fake tensors).

    python bench/bench_layer_memory.py recipes/llama3_8b_1m_8gpu.toml --gpus 8 [--stage -1] [--layers 2]
        [--seq-len 4194304 --cp 8] [--set model.mlp_chunk_tokens=0 ...]

One rank of a fake process group builds the stage's model with `--layers` blocks through the real composer (FSDP2,
activation checkpointing and offload, context parallelism) and runs one micro-step under training/planning/memory_breakdown.py's
dispatch mode: the printed peak is the transient part of the step (parameters, gradients and optimizer state excluded)
and each category is what the code of that part held at that moment. Document masking is measured as its one-document
row (causal), as the dry run does.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mod_tracker import ModTracker  # noqa: E402

from config.recipe import load_config  # noqa: E402
from models.llama import Llama, recipe_model_config  # noqa: E402
from parallelisms.context_parallel import CommStats  # noqa: E402
from parallelisms.cp.layouts import DOCUMENTS, ZIGZAG  # noqa: E402
from parallelisms.parallel_dims import ParallelDims  # noqa: E402
from parallelisms.parallelize import parallelize, uses_loss_parallel  # noqa: E402
from parallelisms.stage_meshes import add_hybrid_subgroups  # noqa: E402
from training import step  # noqa: E402
from training.build import stage_ulysses_degree  # noqa: E402
from training.planning.memory_breakdown import BreakdownMode, format_breakdown  # noqa: E402
from training.planning.memory_probe import fake_batch, _forget_dtensor_caches, _sharding_propagation_in_its_own_fake_mode  # noqa: E402,E501
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
    """One micro-step of `cfg` on rank 0 of a fake group of `world`, under the breakdown mode."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        p, t = cfg.parallelism, cfg.training
        if p.cp_load_balancer == DOCUMENTS:
            p = dataclasses.replace(p, cp_load_balancer=ZIGZAG)
        dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world, where=cfg.recipe_path)
        mcfg = recipe_model_config(cfg)
        mesh = dims.build_mesh("cpu")
        add_hybrid_subgroups(mesh, stage_ulysses_degree(cfg, mcfg, mesh, "cpu"))
        with torch.device("meta"):
            model = Llama(mcfg)
        model = parallelize(model, mesh, cfg)
        setup = step.StepSetup(model, mesh, p, document_masking=False, loss_parallel=uses_loss_parallel(cfg, mesh),
                               stats=CommStats(), loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size))
        with FakeTensorMode(allow_non_fake_inputs=True), _sharding_propagation_in_its_own_fake_mode():
            model.to_empty(device="cpu")
            batch = fake_batch(cfg)
            modules = ModTracker()
            with modules, BreakdownMode(modules) as mode:
                step.micro_step(setup, batch, t.global_batch_rows(dims.dp) * t.seq_len)
        return mode
    finally:
        dist.destroy_process_group()
        _forget_dtensor_caches()


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
