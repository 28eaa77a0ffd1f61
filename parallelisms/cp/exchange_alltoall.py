"""The all-to-all exchange of Ulysses and hybrid CP: `ExchangePlan` says where each group member's tokens go, and
`exchange_seq_to_heads` / `exchange_heads_to_seq` turn sequence shards into head shards and back in one all-to-all
(differentiable: each one's backward is the other). GQA: when the degree does not divide the K/V heads, each K/V
head is replicated just enough (to lcm(kv_heads, P) heads) that every rank gets whole groups (`replicate_kv`). The
plans: `global_order_plan` (Ulysses: global order), `concatenated_order_plan` (the DOCUMENTS layout: member order),
hybrid's ring-rank order (exchange_hybrid.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parallelisms.cp.counters import CommStats, UnsupportedAttentionError, count_sent, nbytes
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.plan_sharding import local_positions

MAX_SLICE_RUNS = 64  # beyond this many runs a member's placement is an index tensor instead of slices


@dataclass(frozen=True)
class ExchangePlan:
    """Where each group member's local tokens go in the gathered sequence (`target_len` tokens, target order).

    placements[j]: (local index, target index) pairs for member j, each a slice or an index tensor.
    """
    group: dist.ProcessGroup
    size: int
    local_len: int
    target_len: int
    placements: tuple

    @classmethod
    def build(cls, group: dist.ProcessGroup, member_positions: list[torch.Tensor],
              target_positions: torch.Tensor) -> "ExchangePlan":
        # A CPU index plan, built once per sequence length and reused by every layer.
        inverse = torch.full((int(target_positions.max()) + 1,), -1, dtype=torch.long, device="cpu")
        inverse[target_positions.cpu()] = torch.arange(target_positions.numel(), device="cpu")
        placements = []
        for positions in member_positions:
            positions = positions.cpu()
            if int(positions.max()) >= inverse.numel() or bool((inverse[positions] < 0).any()):
                raise UnsupportedAttentionError("sequence layout: a member's tokens are not part of the target "
                                                "sequence (hybrid CP needs the zigzag or contiguous layout)")
            placements.append(_as_runs(inverse[positions]))
        return cls(group, len(member_positions), member_positions[0].numel(), target_positions.numel(),
                   tuple(placements))


def _as_runs(target_index: torch.Tensor) -> tuple:
    """Compresses a local -> target index map into slices (one strided slice, or runs of step 1)."""
    n = target_index.numel()
    if n == 1:
        start = int(target_index[0])
        return ((slice(0, 1), slice(start, start + 1)),)
    steps = target_index.diff()
    step = int(steps[0])
    if step > 0 and bool((steps == step).all()):
        start = int(target_index[0])
        return ((slice(0, n), slice(start, start + step * (n - 1) + 1, step)),)
    breaks = (steps != 1).nonzero().flatten().add(1).tolist()
    if len(breaks) >= MAX_SLICE_RUNS:
        return ((torch.arange(n, device=target_index.device), target_index),)
    bounds = [0, *breaks, n]
    return tuple((slice(a, b), slice(int(target_index[a]), int(target_index[a]) + b - a))
                 for a, b in zip(bounds[:-1], bounds[1:]))


def _all_to_all(plan: ExchangePlan, send: torch.Tensor, stats, backward: bool) -> torch.Tensor:
    if plan.size == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
    count_sent(stats, nbytes(send) * (plan.size - 1) // plan.size, backward)
    return recv


def _packed_layout(shapes, n: int) -> tuple[list[int], int]:
    sizes = [math.prod(shape) // n for shape in shapes]
    return sizes, sum(sizes)


def seq_to_heads(plan: ExchangePlan, tensors, stats=None, backward=False) -> list[torch.Tensor]:
    """(B, H, local, D) sequence shards -> (B, H / size, target_len, D) head shards in target order, one all-to-all."""
    n = plan.size
    sizes, total = _packed_layout([x.shape for x in tensors], n)
    send = tensors[0].new_empty(n, total)
    offset = 0
    for x, size in zip(tensors, sizes):
        b, h, s, d = x.shape
        send[:, offset:offset + size].view(n, b, h // n, s, d).copy_(x.unflatten(1, (n, h // n)).transpose(0, 1))
        offset += size
    recv = _all_to_all(plan, send, stats, backward)
    outs, offset = [], 0
    for x, size in zip(tensors, sizes):
        b, h, s, d = x.shape
        piece = recv[:, offset:offset + size].view(n, b, h // n, s, d)
        offset += size
        out = x.new_empty(b, h // n, plan.target_len, d)
        for member, runs in enumerate(plan.placements):
            for local, target in runs:
                out[:, :, target] = piece[member][:, :, local]
        outs.append(out)
    return outs


def heads_to_seq(plan: ExchangePlan, tensors, stats=None, backward=False) -> list[torch.Tensor]:
    """The inverse of `seq_to_heads`: (B, h, target_len, D) -> (B, h * size, local, D)."""
    n = plan.size
    shapes = [(n, x.size(0), x.size(1), plan.local_len, x.size(3)) for x in tensors]
    sizes, total = _packed_layout(shapes, n)
    send = tensors[0].new_empty(n, total)
    offset = 0
    for x, size, shape in zip(tensors, sizes, shapes):
        dest = send[:, offset:offset + size].view(shape)
        offset += size
        for member, runs in enumerate(plan.placements):
            for local, target in runs:
                dest[member][:, :, local] = x[:, :, target]
    recv = _all_to_all(plan, send, stats, backward)
    outs, offset = [], 0
    for size, shape in zip(sizes, shapes):
        piece = recv[:, offset:offset + size].view(shape)
        offset += size
        _, b, h, s, d = shape
        outs.append(piece.transpose(0, 1).reshape(b, n * h, s, d))
    return outs


class _Exchange(torch.autograd.Function):
    """One all-to-all exchange whose backward is the opposite exchange of the gradients: `seq_to_heads` when
    `to_heads`, else `heads_to_seq`."""

    @staticmethod
    def forward(ctx, plan, stats, to_heads: bool, *tensors):
        ctx.plan, ctx.stats, ctx.to_heads = plan, stats, to_heads
        return tuple((seq_to_heads if to_heads else heads_to_seq)(plan, tensors, stats))

    @staticmethod
    def backward(ctx, *grads):
        back = heads_to_seq if ctx.to_heads else seq_to_heads
        return (None, None, None, *back(ctx.plan, [g.contiguous() for g in grads], ctx.stats, backward=True))


def exchange_seq_to_heads(plan: ExchangePlan, *tensors, stats: CommStats | None = None):
    """Differentiable `seq_to_heads` (its backward is `heads_to_seq` of the gradients)."""
    return _Exchange.apply(plan, stats, True, *tensors)


def exchange_heads_to_seq(plan: ExchangePlan, *tensors, stats: CommStats | None = None):
    return _Exchange.apply(plan, stats, False, *tensors)


def kv_replication(q_heads: int, kv_heads: int, degree: int) -> int:
    """How many times each K/V head is repeated so `degree` ranks each get whole query groups: lcm(kv_heads, degree)
    heads split evenly, and since kv_heads and degree both divide q_heads, so does their lcm. Raises if the query heads
    do not split over the degree."""
    if q_heads % degree or q_heads % kv_heads:
        raise UnsupportedAttentionError(
            f"Ulysses CP over {degree} ranks needs the query heads per rank ({q_heads}) to be a multiple of "
            f"{degree} (and of the {kv_heads} key/value heads); lower the Ulysses degree (cp, or tp to keep more "
            "heads per rank) or use cp_impl = \"ring\" or \"allgather\"")
    return math.lcm(kv_heads, degree) // kv_heads


def ulysses_feasible(q_heads: int, kv_heads: int, degree: int) -> bool:
    try:
        kv_replication(q_heads, kv_heads, degree)
    except UnsupportedAttentionError:
        return False
    return True


def replicate_kv(k: torch.Tensor, v: torch.Tensor, q_heads: int, degree: int):
    repeats = kv_replication(q_heads, k.size(1), degree)
    if repeats == 1:
        return k, v
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def document_segments(full_ids: torch.Tensor) -> DocumentShards:
    """The documents of the whole sequence in global order (what each rank attends over after the all-to-all), as
    one shard: its pieces are cut once and reused by every layer."""
    return DocumentShards([full_ids])


def global_order_plan(group: dist.ProcessGroup, seq_len: int, load_balancer: str) -> ExchangePlan:
    """Ulysses' plan: every rank's tokens placed at their global positions."""
    size = dist.get_world_size(group)
    with unset_fake_temporarily():  # host integers, so real tensors even inside the dry run's fake mode
        members = [local_positions(seq_len, r, size, load_balancer) for r in range(size)]
        return ExchangePlan.build(group, members, torch.arange(seq_len, device="cpu"))


def concatenated_order_plan(group: dist.ProcessGroup, seq_len: int) -> ExchangePlan:
    """The documents layout's plan: member j's tokens at [j * L, (j + 1) * L) of the gathered sequence, in local
    order. That layout is per row, so no one order serves every row; none is needed either: the pieces of
    `concatenated_documents` follow each token's true position wherever it sits."""
    size = dist.get_world_size(group)
    local = seq_len // size
    with unset_fake_temporarily():
        members = [torch.arange(j * local, (j + 1) * local, device="cpu") for j in range(size)]  # host integers
        return ExchangePlan.build(group, members, torch.arange(seq_len, device="cpu"))


def concatenated_documents(documents: DocumentShards) -> DocumentShards:
    """Every rank's ids and positions of the documents layout, concatenated in rank order as one shard (what each
    rank attends over after `concatenated_order_plan`'s all-to-all)."""
    positions = torch.cat(list(documents.positions), dim=1)  # (B, S)
    return DocumentShards([torch.cat(documents.per_rank, dim=1)], positions[None], documents.concatenated_plan)
