"""The boundary of a custom autograd Function under torch.autocast.

A one-device bf16 run (issue 36, parallelisms/parallelize.py `uses_autocast`) keeps float32 weights and runs the
forward under autocast. Autocast reaches the ops inside a Function's forward but not its backward, nor ops written
with `out=`: a Function handed float32 operands would run those GEMMs in float32 (or mix dtypes). Casting the
operands once, at the boundary, runs all of the Function's GEMMs in bf16, as they ran on FSDP2's bf16 weights;
autograd records the casts, so the gradients reach the float32 weights in float32.
"""
from __future__ import annotations

import torch


def to_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The floating tensors in the autocast dtype of their device where autocast is on there; else unchanged."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    low = torch.get_autocast_dtype(device)
    return tuple(t.to(low) if t.is_floating_point() else t for t in tensors)
