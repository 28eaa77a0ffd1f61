"""Activation checkpointing of transformer blocks: none, full, every k-th block, or op-selective.

Op-selective keeps the outputs of every matmul and of the attention kernels (CPU and CUDA SDPA ops) and recomputes
only the cheap element-wise work (norms, activations, RoPE), so no attention call is ever run twice.
"""
from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


def _save_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int = 1) -> None:
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "selective" and int(name) % every != 0:
            continue
        if mode == "op":
            context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention)
            wrapped = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped
