"""Ring attention over the "documents" layout: each step carries only the K/V rows its receiver can see.

Topology: shifts instead of a relay ring. At step s (1 <= s < P) rank r sends to rank r + s the rows of its own K/V
that r + s can see, and receives from r - s the rows of r - s that it can see. A relay ring would have to forward
the union of what every later rank needs; with shifts each row goes once, straight to the rank that reads it. Every
size comes from the plan (DocumentShards.visible_rows), identical on every rank, so nothing is negotiated: a pair
with no rows posts nothing, and a step in which no pair has rows is skipped, exchange and compute. Each step is ONE
batch_isend_irecv group, posted in the same order everywhere (NCCL's rules, comm.py).

Forward: the next active step's group is posted before the current step is computed. Received rows are copied into
a block at their own rows, so the document pieces (plan_pieces.segment_pieces) read them as in the dense ring.
Backward: K/V rows travel again; the float32 dK/dV of the rows received at one step go straight back to their owner
in the next step's group, and one last group returns the final step's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallelisms.comm import ShiftLinks, wait_all
from parallelisms.cp.accumulators import LseAccumulator, RowBuffer, lse_for_backward
from parallelisms.cp.counters import count_sent, nbytes
from parallelisms.cp.kernel_calls import DocumentBlockBackward, DocumentBlockForward
from parallelisms.cp.rows import block_view, flat_rows, grad_rows_buffers, pack_rows, received_block, unpack_rows

if TYPE_CHECKING:
    from parallelisms.cp.block_spec import BlockSpec

KV_TAG, GRAD_TAG = 0, 1


class ShiftPlan:
    """Which rows each shift moves, for this rank, read from the documents plan (built once per batch: every layer's
    forward and backward reuse it through DocumentShards.cached)."""

    def __init__(self, spec: BlockSpec, links: ShiftLinks, device: torch.device):
        size, rank, causal = links.size, links.rank, spec.is_causal
        docs = spec.docs
        self.rank, self.size = rank, size
        pair_rows = docs.pair_rows(causal)  # (P, P) host integers: no per-layer P^2 look-ups
        # shifts in which some rank sees some row of the rank s before it
        self.shifts = [s for s in range(1, size)
                       if any(pair_rows[(r + s) % size, r] for r in range(size))]
        self.send_rows = {s: docs.visible_rows_on(device, (rank + s) % size, rank, causal) for s in self.shifts}
        self.recv_rows = {s: docs.visible_rows_on(device, rank, (rank - s) % size, causal) for s in self.shifts}

    @classmethod
    def of(cls, spec: BlockSpec, links: ShiftLinks, device: torch.device) -> "ShiftPlan":
        return spec.docs.cached(("shift plan", links.rank, links.size, spec.is_causal, str(device)),
                                lambda: cls(spec, links, device))

    def source(self, shift: int) -> int:
        return (self.rank - shift) % self.size


def _post_kv(links: ShiftLinks, plan: ShiftPlan, shift: int, k, v, spec: BlockSpec, backward: bool,
             grads: tuple[int, torch.Tensor] | None = None, grad_rows: torch.Tensor | None = None):
    """One group: this shift's K/V rows (out to rank + shift, in from rank - shift) and, in the backward, the
    previous shift's dK/dV (`grads` = (shift, packed float32 buffer) back to its owner, and the buffer this rank's
    own rows' dK/dV arrive in). Returns (works, K/V receive buffer or None, dK/dV receive buffer or None)."""
    sends, receives, kv_in, grad_in = [], [], None, None
    if shift is not None:
        out_rows, in_rows = plan.send_rows[shift], plan.recv_rows[shift]
        if out_rows.numel():
            sends.append((shift, pack_rows(k, v, out_rows), KV_TAG))
        if in_rows.numel():
            kv_in = k.new_empty(2 * in_rows.numel() * k.size(1) * k.size(3))
            receives.append((-shift, kv_in, KV_TAG))
    if grads is not None:
        back_shift, buf = grads
        if buf is not None:
            sends.append((-back_shift, buf, GRAD_TAG))
        if grad_rows.numel():
            grad_in = torch.empty(2 * grad_rows.numel() * k.size(1) * k.size(3), dtype=torch.float32,
                                  device=k.device)
            receives.append((back_shift, grad_in, GRAD_TAG))
    for _, buf, _ in sends:
        count_sent(spec.stats, nbytes(buf), backward=backward)
    return links.exchange(sends, receives), kv_in, grad_in


def sparse_forward(q, k, v, spec: BlockSpec):
    links = ShiftLinks(spec.group)
    plan = ShiftPlan.of(spec, links, k.device)
    compute = DocumentBlockForward(spec, plan.rank, q, LseAccumulator(q, v))

    shifts = plan.shifts
    pending = _post_kv(links, plan, shifts[0], k, v, spec, False) if shifts else None
    compute(plan.rank, k, v)
    for j, shift in enumerate(shifts):
        works, kv_in, _ = pending
        wait_all(works)
        pending = _post_kv(links, plan, shifts[j + 1], k, v, spec, False) if j + 1 < len(shifts) else None
        if kv_in is not None:
            compute(plan.source(shift), *received_block(kv_in, plan.recv_rows[shift], k, v))
    if spec.stats is not None:
        spec.stats.calls += 1
    return compute.finish()


def sparse_backward(dout, q, k, v, out, lse, auxes, spec: BlockSpec):
    links = ShiftLinks(spec.group)
    plan = ShiftPlan.of(spec, links, k.device)
    dq = RowBuffer(q, q.shape, 0.0)  # (B, Hq, L, D) float32
    compute = DocumentBlockBackward(spec, plan.rank, dout, q, out, lse_for_backward(lse), auxes, dq)
    own_dk, own_dv = grad_rows_buffers(k, v)

    def take_grads(shift, grad_in):
        """Adds the dK/dV of this rank's rows that rank + shift computed into its own accumulators."""
        if grad_in is not None:
            rows = plan.send_rows[shift]
            gk, gv = unpack_rows(grad_in, k, v, rows.numel())
            own_dk.index_add_(0, rows, gk)
            own_dv.index_add_(0, rows, gv)

    shifts = plan.shifts
    pending = _post_kv(links, plan, shifts[0], k, v, spec, True) if shifts else None
    compute(plan.rank, k, v, own_dk, own_dv)
    finished = None  # (shift, packed float32 dK/dV of the rows received at that shift, or None)
    for j, shift in enumerate(shifts + [None] if shifts else []):  # the last round only waits
        works, kv_in, grad_in = pending
        wait_all(works)
        if j >= 2:
            take_grads(shifts[j - 2], grad_in)  # the group just finished carried the dK/dV of shift j - 2
        if shift is None:
            break
        nxt = shifts[j + 1] if j + 1 < len(shifts) else None
        pending = _post_kv(links, plan, nxt, k, v, spec, True, grads=finished,
                           grad_rows=plan.send_rows[finished[0]] if finished else None)
        finished = (shift, None)
        if kv_in is not None:
            rows = plan.recv_rows[shift]
            dk_flat, dv_flat = (torch.zeros(flat_rows(x).shape, dtype=torch.float32, device=x.device) for x in (k, v))
            compute(plan.source(shift), *received_block(kv_in, rows, k, v), dk_flat, dv_flat)
            finished = (shift, torch.cat([dk_flat.index_select(0, rows).reshape(-1),
                                          dv_flat.index_select(0, rows).reshape(-1)]))
    if finished is not None:
        works, _, grad_in = _post_kv(links, plan, None, k, v, spec, True, grads=finished,
                                     grad_rows=plan.send_rows[finished[0]])
        wait_all(works)
        take_grads(finished[0], grad_in)
    return (dq.finish().to(q.dtype), block_view(own_dk, k).to(k.dtype), block_view(own_dv, v).to(v.dtype))
