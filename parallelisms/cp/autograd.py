"""The autograd wrapper of every block-merging variant: forward (-> out, lse, kernel auxiliaries) and backward from
the final out and lse, given as functions (the exchanges); nothing is recomputed. A leaf of the package."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # an annotation only: the wrapper stays a leaf
    from parallelisms.cp.block_spec import BlockSpec


class LseAttentionFunction(torch.autograd.Function):
    """Autograd for an exact CP attention given as (forward -> out, lse, auxes; backward from out and lse): the ring,
    the all-gather. Saves q, k, v, the output and its log-sum-exp; recomputes nothing."""

    @staticmethod
    def forward(ctx, q, k, v, spec: BlockSpec, forward_fn, backward_fn):
        out, lse, auxes = forward_fn(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.auxes, ctx.backward_fn = spec, auxes, backward_fn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse, ctx.auxes, ctx.spec)
        return dq, dk, dv, None, None, None
