"""The composer: turns a full Llama into this rank's parallel piece, in the order the recipe reads.

TP (+SP, loss parallel) -> CP (attention becomes ring; applied per batch by `context_parallel`) -> activation
checkpointing -> torch.compile per attention / feed-forward submodule -> FSDP2 over (dp_shard x cp), replicated over
dp_replicate.
"""
from __future__ import annotations

import torch

from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.data_parallel import apply_fsdp
from parallelisms.parallel_dims import TrainingMesh
from training.config import Config


def uses_fsdp(cfg: Config, mesh: TrainingMesh) -> bool:
    """FSDP whenever gradients cross ranks, and on one rank for bf16 (its mixed precision keeps fp32 master weights)."""
    return mesh.dims.fsdp_enabled or cfg.training.dtype != "float32"


def apply_compile(model: torch.nn.Module) -> None:
    """Compiles attention and feed-forward separately (a whole block after TP+SP fails in backward, FACTS.md)."""
    for block in model.layers.values():
        block.attention = torch.compile(block.attention)
        block.feed_forward = torch.compile(block.feed_forward)


def parallelize(model: torch.nn.Module, mesh: TrainingMesh, cfg: Config) -> torch.nn.Module:
    par = cfg.parallelism
    apply_activation_checkpointing(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.every)
    if cfg.training.compile:
        apply_compile(model)
    if uses_fsdp(cfg, mesh):
        reshard = {"always": True, "never": False, "default": par.pp == 1}[par.fsdp_reshard_after_forward]
        apply_fsdp(model, mesh.fsdp_mesh(), getattr(torch, cfg.training.dtype), reshard)
    return model
