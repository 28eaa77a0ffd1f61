"""FSDP2 over the flattened (dp_shard, cp) mesh, replicated over dp_replicate (HSDP) — applied last by the composer.

Loss normalisation: the trainer divides each rank's summed token loss by the GLOBAL token count, so gradients must be
summed over ranks, not averaged: divide factor 1 with sum-only reductions (plain SUM, which gloo supports too;
a divide factor alone makes FSDP use PREMUL_SUM, which gloo lacks).

CPU offload (`training.cpu_offload`): FSDP2's CPUOffloadPolicy keeps every parameter shard, its gradient and so the
optimizer state in host memory; each block's shards are copied to the device for its all-gather and its reduced
gradients copied back. The host memory is pinned only on CUDA: pinning needs an accelerator (on a CPU-only torch
`pin_memory()` fails), and on a CPU run the host is the device, so nothing moves.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's policy for a run on `device_type`: host-resident shards (pinned on CUDA) or none."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()


def apply_fsdp(model: torch.nn.Module, mesh, param_dtype: torch.dtype, reshard_after_forward: bool,
               offload: OffloadPolicy | None = None) -> None:
    """Shards every transformer block, then the root (embeddings, final norm and output as one group)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = offload or OffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                reshard_after_forward=reshard_after_forward)
    for module in [model, *blocks]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
