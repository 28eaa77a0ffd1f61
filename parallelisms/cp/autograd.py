"""The autograd wrapper of every block-merging variant: forward (-> out, lse, kernel auxiliaries) and backward from
the final out and lse, given as functions (the exchanges); nothing is recomputed. A leaf of the package.

Attention is independent per head, so a call may run its K/V heads in groups, one after another (with the query
heads that read them, GQA's h // (Hq / Hkv)): every float32 accumulator, every K/V block in flight and every kernel
temporary of the exchanges then spans one group, not the whole shard. Each group runs the same arithmetic for its
heads as the whole call (a kernel may split its work over threads differently by head count: fp32 results agree to
~1e-7); what grows is the number of kernel calls and transfers, each smaller. At 512K tokens per rank (Llama 3.1 8B,
32 query heads) the float32 dQ accumulator alone is 8 GiB: 8 groups take the ring's 60 KiB per token out of the
step's peak (docs/frontier.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models.tile_loops import tile_starts

if TYPE_CHECKING:  # an annotation only: the wrapper stays a leaf
    from parallelisms.cp.block_spec import BlockSpec

HEAD_GROUP_BYTES = 1 << 30
"""Automatic head groups: as few as keep one group's float32 dQ accumulator (B x Hq x S_local x D x 4 bytes) within
this; within it (every test shape, up to 64K tokens per rank of an 8B model) a call is one group."""


def head_group_count(q: torch.Tensor, k: torch.Tensor, asked: int) -> int:
    """The K/V head groups of one call: `asked` > 0 caps them (the largest divisor of Hkv not above it: Ulysses and
    TP divide the heads at run time); 0 picks the fewest that keep a group's float32 dQ within HEAD_GROUP_BYTES."""
    n_kv = k.size(1)
    divisors = [g for g in range(1, n_kv + 1) if n_kv % g == 0]
    if asked > 0:
        return max(g for g in divisors if g <= asked)
    dq_bytes = q.numel() * 4
    return next((g for g in divisors if dq_bytes <= HEAD_GROUP_BYTES * g), n_kv)


def _head_slices(q: torch.Tensor, k: torch.Tensor, groups: int) -> list[tuple[slice, slice]]:
    """(query heads, K/V heads) of each group."""
    kv_per, q_per = k.size(1) // groups, q.size(1) // groups
    return [(slice(g * q_per, (g + 1) * q_per), slice(g * kv_per, (g + 1) * kv_per)) for g in range(groups)]


def grouped_forward(forward_fn, q, k, v, spec: BlockSpec):
    """`forward_fn` over the call's head groups -> (out, float32 lse, the kernels' auxiliaries per group; None for a
    group a dry run did not run)."""
    groups = head_group_count(q, k, spec.head_groups)
    if groups == 1:
        out, lse, auxes = forward_fn(q, k, v, spec)
        return out, lse, [auxes]
    out = torch.empty_like(q)  # q's memory layout: the model's transpose back stays a view
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    group_auxes: list = [None] * groups
    slices = _head_slices(q, k, groups)
    for g in tile_starts(groups, 1, q):  # every group; a dry run's fake tensors: three (models/tile_loops.py)
        qh, kh = slices[g]
        g_out, g_lse, group_auxes[g] = forward_fn(q[:, qh], k[:, kh], v[:, kh], spec)
        out[:, qh], lse[:, qh] = g_out, g_lse
        del g_out, g_lse
    return out, lse, group_auxes


def grouped_backward(backward_fn, dout, q, k, v, out, lse, group_auxes: list, spec: BlockSpec):
    """`backward_fn` over the groups `grouped_forward` ran -> (dq, dk, dv) in the inputs' dtypes."""
    if len(group_auxes) == 1:
        return backward_fn(dout, q, k, v, out, lse, group_auxes[0], spec)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    slices = _head_slices(q, k, len(group_auxes))
    for g in tile_starts(len(group_auxes), 1, q):  # the groups grouped_forward ran, in its order
        (qh, kh), auxes = slices[g], group_auxes[g]
        g_dq, g_dk, g_dv = backward_fn(dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh], lse[:, qh], auxes,
                                       spec)
        dq[:, qh], dk[:, kh], dv[:, kh] = g_dq, g_dk, g_dv
        del g_dq, g_dk, g_dv
    return dq, dk, dv


class LseAttentionFunction(torch.autograd.Function):
    """Autograd for an exact CP attention given as (forward -> out, lse, auxes; backward from out and lse): the ring,
    the all-gather, in head groups. Saves q, k, v, the output and its log-sum-exp; recomputes nothing."""

    @staticmethod
    def forward(ctx, q, k, v, spec: BlockSpec, forward_fn, backward_fn):
        out, lse, group_auxes = grouped_forward(forward_fn, q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.group_auxes, ctx.backward_fn = spec, group_auxes, backward_fn
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = grouped_backward(ctx.backward_fn, dout, *ctx.saved_tensors, ctx.group_auxes, ctx.spec)
        return dq, dk, dv, None, None, None
