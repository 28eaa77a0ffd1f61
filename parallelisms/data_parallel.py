"""FSDP2 over the flattened (dp_shard, cp) mesh, replicated over dp_replicate (HSDP) — applied last by the composer.

Loss normalisation: the trainer divides each rank's summed token loss by the GLOBAL token count, so gradients must be
summed over ranks, not averaged: divide factor 1 with sum-only reductions (plain SUM, which gloo supports too;
a divide factor alone makes FSDP use PREMUL_SUM, which gloo lacks).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: torch.nn.Module, mesh, param_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """Shards every transformer block, then the root (embeddings, final norm and output as one group)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for module in [model, *blocks]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
