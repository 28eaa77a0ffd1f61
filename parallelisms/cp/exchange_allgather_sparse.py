"""The all-gather variant on the "documents" layout: one all-to-all with variable splits carries to each rank only
the K/V rows it can see (DocumentShards.visible_rows, known to every rank from the plan, so the splits need no
negotiation); a batch in which no rank sees another's rows posts no collective at all.

Forward: the local pieces are computed while the all-to-all is in flight, then each source's pieces against its
rows, written at their own rows of a block (rows.py), by the compute step the sparse ring runs too
(kernel_calls.DocumentBlockForward / DocumentBlockBackward). Backward: the same all-to-all of K/V rows,
then one all-to-all back (splits swapped) of the float32 dK/dV of exactly the rows received, added into each
owner's own accumulators.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallelisms.comm import all_to_all_rows
from parallelisms.cp.accumulators import LseAccumulator, RowBuffer, lse_for_backward
from parallelisms.cp.counters import count_sent, nbytes
from parallelisms.cp.kernel_calls import DocumentBlockBackward, DocumentBlockForward
from parallelisms.cp.rows import block_view, grad_rows_buffers, pack_rows, received_block, unpack_rows

if TYPE_CHECKING:
    from parallelisms.cp.block_spec import BlockSpec


class RowsPlan:
    """The rows this rank sends to and receives from every rank (its own entry empty), and the element splits."""

    def __init__(self, spec: BlockSpec, device: torch.device, width: int):
        group, docs, causal = spec.group, spec.docs, spec.is_causal
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.send = [docs.visible_rows_on(device, dst, self.rank, causal) if dst != self.rank else empty
                     for dst in range(self.size)]
        self.recv = [docs.visible_rows_on(device, self.rank, src, causal) if src != self.rank else empty
                     for src in range(self.size)]
        self.send_splits = [2 * rows.numel() * width for rows in self.send]  # K and V of each row
        self.recv_splits = [2 * rows.numel() * width for rows in self.recv]
        self.anyone_sends = bool(docs.pair_rows(causal).any())  # host integers, no per-layer P^2 look-ups

    @classmethod
    def of(cls, spec: BlockSpec, device: torch.device, width: int) -> "RowsPlan":
        """Built once per batch (DocumentShards.cached) and reused by every layer's forward and backward."""
        return spec.docs.cached(("rows plan", spec.is_causal, str(device), width), lambda: cls(spec, device, width))


def _exchange_kv(k, v, plan: RowsPlan, spec: BlockSpec, backward: bool):
    """Posts the all-to-all of visible K/V rows: (receive buffer, work) or (None, None) when nobody sends."""
    if not plan.anyone_sends:
        return None, None
    send = torch.cat([pack_rows(k, v, rows) for rows in plan.send])
    recv = k.new_empty(sum(plan.recv_splits))
    work = all_to_all_rows(recv, send, plan.recv_splits, plan.send_splits, spec.group, async_op=True)
    count_sent(spec.stats, nbytes(send), backward=backward)
    return recv, work


def _sources(recv: torch.Tensor, plan: RowsPlan, k, v):
    """(source rank, K block, V block) of every rank whose rows arrived."""
    at = 0
    for src, (rows, n) in enumerate(zip(plan.recv, plan.recv_splits)):
        if n:
            yield src, *received_block(recv[at:at + n], rows, k, v)
        at += n


def sparse_allgather_forward(q, k, v, spec: BlockSpec):
    plan = RowsPlan.of(spec, k.device, k.size(1) * k.size(3))
    recv, work = _exchange_kv(k, v, plan, spec, backward=False)
    compute = DocumentBlockForward(spec, plan.rank, q, LseAccumulator(q, v))

    compute(plan.rank, k, v)
    if work is not None:
        work.wait()
        for src, k_blk, v_blk in _sources(recv, plan, k, v):
            compute(src, k_blk, v_blk)
    if spec.stats is not None:
        spec.stats.calls += 1
    return compute.finish()


def sparse_allgather_backward(dout, q, k, v, out, lse, auxes, spec: BlockSpec):
    plan = RowsPlan.of(spec, k.device, k.size(1) * k.size(3))
    recv, work = _exchange_kv(k, v, plan, spec, backward=True)
    dq = RowBuffer(q, q.shape, 0.0)
    compute = DocumentBlockBackward(spec, plan.rank, dout, q, out, lse_for_backward(lse), auxes, dq)
    own_dk, own_dv = grad_rows_buffers(k, v)

    compute(plan.rank, k, v, own_dk, own_dv)
    if work is not None:
        work.wait()
        grads = []  # per source, in rank order: float32 dK/dV of the rows received from it
        received = {src: (k_blk, v_blk) for src, k_blk, v_blk in _sources(recv, plan, k, v)}
        for src in range(plan.size):
            if src not in received:
                grads.append(torch.zeros(0, dtype=torch.float32, device=k.device))
                continue
            dk_flat, dv_flat = grad_rows_buffers(k, v)
            compute(src, *received[src], dk_flat, dv_flat)
            rows = plan.recv[src]
            grads.append(torch.cat([dk_flat.index_select(0, rows).reshape(-1),
                                    dv_flat.index_select(0, rows).reshape(-1)]))
        send = torch.cat(grads)
        back = torch.empty(sum(plan.send_splits), dtype=torch.float32, device=k.device)
        all_to_all_rows(back, send, plan.send_splits, plan.recv_splits, spec.group)
        count_sent(spec.stats, nbytes(send), backward=True)
        at = 0
        for rows, n in zip(plan.send, plan.send_splits):
            if n:
                gk, gv = unpack_rows(back[at:at + n], k, v, rows.numel())
                own_dk.index_add_(0, rows, gk)
                own_dv.index_add_(0, rows, gv)
            at += n
    return (dq.finish().to(q.dtype), block_view(own_dk, k).to(k.dtype), block_view(own_dv, v).to(v.dtype))
