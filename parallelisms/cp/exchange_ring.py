"""Exact ring attention: K/V blocks travel the CP ring, partial results merge through their log-sum-exp in float32.

Forward: at step s a rank holds the K/V of rank (r - s) mod P; the transfer of the next block is posted before the
current block is computed (double buffer). Backward (custom autograd function): dQ accumulates locally; K/V travel the
ring again together with float32 dK/dV accumulators, and one last hop returns each accumulator to the rank that owns
the block. Every block backward uses the final output and log-sum-exp; nothing else is recomputed. P = 1 runs the same
code with no transfers; so does `local_segment_attention` (no group at all: Ulysses after its all-to-all). With
documents every block is computed as mask-free pieces (plan_pieces.py). The DOCUMENTS layout runs the sparse shifts
of exchange_ring_sparse.py instead; `attention.ring_attention` picks the pair from the dispatch table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only

from models.tile_loops import active_sampler, tile_starts, uncounted_ballast
from parallelisms.comm import RingLinks, wait_all
from parallelisms.cp.accumulators import LseAccumulator, RowBuffer, lse_for_backward
from parallelisms.cp.counters import count_sent, nbytes
from parallelisms.cp.kernel_calls import add_kv_grads, backward_pieces, block_backward, forward_pieces, uses_varlen
from parallelisms.cp.rows import pack_kv, unpack_kv

if TYPE_CHECKING:
    from parallelisms.cp.block_spec import BlockSpec

KV_TAG = 0


class _NoLinks:
    """The ring of one rank without a process group (`local_segment_attention`): nothing is ever exchanged."""
    size, rank = 1, 0


def _links(spec: BlockSpec):
    return RingLinks(spec.group) if spec.group is not None else _NoLinks()


def _ring_steps(q, spec: BlockSpec, rank: int, size: int, local_len: int):
    """The ring's steps: all of them, or in a dry run on fake tensors (models/tile_loops.py) three when every step
    after the first computes the same pieces (zigzag and contiguous on the rank the dry run measures, rank 0, whose
    sources all come after it): the first (its own block), the second, standing for the P - 2 steps up to the last,
    and the last (the one that posts no next block). Those are the whole ring's allocation sequence, and the counters
    weight the second's ops and bytes by P - 2, as for tiles and head groups; the kernels' auxiliaries (saved for the
    backward, on CUDA) of the P - 3 steps not run are held as copies of the second's. At CP 8 on an 8B model's 1M tokens the
    ring's steps were about half of the dry run's time. Forward and backward decide alike, so the backward walks the
    blocks the forward ran."""
    if size <= 3 or not isinstance(q, FakeTensor) or active_sampler() is None:
        return range(size)
    middle = [spec.pieces(rank, (rank - step) % size, size, local_len) for step in range(1, size)]
    return tile_starts(size, 1, q) if all(p == middle[0] for p in middle[1:]) else range(size)


def ring_forward(q, k, v, spec: BlockSpec):
    """q (B, Hq, S_local, D) against every rank's k, v (B, Hkv, S_local, D) -> (out, float32 lse (B, Hq, S_local),
    the kernels' auxiliaries per block, in compute order)."""
    links = _links(spec)
    size, rank, local_len = links.size, links.rank, q.size(2)
    acc = LseAccumulator(q, v)
    auxes = []
    cur = pack_kv(k, v) if size > 1 else None  # (K+V,) this step's block
    spare = torch.empty_like(cur) if size > 1 else None  # (K+V,) the next step's block, in flight
    steps = _ring_steps(q, spec, rank, size, local_len)
    for step in steps:
        src = (rank - step) % size
        pending = []
        if step < size - 1:
            pending = links.exchange([cur], [spare], KV_TAG)
            count_sent(spec.stats, nbytes(cur))
        k_blk, v_blk = (k, v) if step == 0 else unpack_kv(cur, k, v)
        held = len(auxes)
        forward_pieces(q, k_blk, v_blk, spec.pieces(rank, src, size, local_len), spec, acc, auxes)
        if step == 1 and not isinstance(steps, range):  # sampled: what the steps not run would hold until backward
            with uncounted_ballast(active_sampler()):
                ballast = [tree_map_only(torch.Tensor, torch.clone, auxes[held:]) for _ in range(size - 3)]
        wait_all(pending)
        cur, spare = spare, cur
    if not isinstance(steps, range):
        auxes.extend(ballast)  # after every block's own: the backward never reads them
    if spec.stats is not None:
        spec.stats.calls += 1
    return (*acc.finish(), auxes)


def ring_backward(dout, q, k, v, out, lse, auxes, spec: BlockSpec):
    """At step s a rank holds K/V of rank (r - s) mod P and that block's float32 dK/dV accumulator, received from the
    rank that held it at step s - 1. Each step posts ONE group: the accumulator finished last step goes to the next
    rank while this block's arrives from the previous one, together with the K/V hop (NCCL's grouping rule,
    parallelisms/comm.py). A last hop returns every accumulator to the rank that owns its block."""
    links = _links(spec)
    size, rank, local_len = links.size, links.rank, q.size(2)
    lse = lse_for_backward(lse)  # (B, Hq, S_local) float32
    if size == 1:
        return _local_backward(dout, q, k, v, out, lse, iter(auxes), spec)
    dq = RowBuffer(q, q.shape, 0.0)  # (B, Hq, S_local, D) float32
    cur = pack_kv(k, v)  # (K+V,) this step's block
    spare = torch.empty_like(cur)  # (K+V,) the next step's block, in flight
    # (K+V,) float32 accumulators: the one this step adds into, and the one finished last step (being sent on).
    dkv = [torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device),
           torch.empty(k.numel() + v.numel(), dtype=torch.float32, device=k.device)]
    aux_iter = iter(auxes)
    for step in _ring_steps(q, spec, rank, size, local_len):
        src = (rank - step) % size
        sends, receives = [], []
        if step > 0:
            sends.append(dkv[(step - 1) % 2])
            receives.append(dkv[step % 2])
        if step < size - 1:
            sends.append(cur)
            receives.append(spare)
        pending = links.exchange(sends, receives, KV_TAG)
        for buf in sends:
            count_sent(spec.stats, nbytes(buf), backward=True)
        k_blk, v_blk = (k, v) if step == 0 else unpack_kv(cur, k, v)  # (B, Hkv, S_local, D) each, of rank `src`
        # dout, q, out (B, Hq, L, D) and lse (B, Hq, L) against K/V (B, Hkv, L, D) of block `src`: dQ now, the
        # dK/dV (per piece or per varlen call) once the block's accumulator has arrived.
        kv_grads = backward_pieces(dout, q, k_blk, v_blk, out, lse, aux_iter, spec.pieces(rank, src, size, local_len),
                                   spec, dq)
        wait_all(pending)  # this block's accumulator has arrived, and the next K/V
        acc_k, acc_v = unpack_kv(dkv[step % 2], k, v)  # (B, Hkv, S_local, D) float32 views
        add_kv_grads(kv_grads, acc_k, acc_v)
        del kv_grads
        cur, spare = spare, cur
    # last hop: pass the finished accumulator on, receive this rank's own from the previous rank
    finished, own = dkv[(size - 1) % 2], dkv[size % 2]
    wait_all(links.exchange([finished], [own], KV_TAG))
    count_sent(spec.stats, nbytes(finished), backward=True)
    dk, dv = unpack_kv(own, k, v)
    return dq.finish().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _local_backward(dout, q, k, v, out, lse, aux_iter, spec: BlockSpec):
    """One rank, no transfers: every piece's gradients go straight into float32 dQ/dK/dV accumulators."""
    dq, dk, dv = (RowBuffer(x, x.shape, 0.0) for x in (q, k, v))  # float32
    pieces = spec.pieces(0, 0, 1, q.size(2))
    if uses_varlen(q, pieces):  # CUDA flash: at most two calls, gradients scattered by row index
        dk.ensure_filled()
        dv.ensure_filled()
        add_kv_grads(backward_pieces(dout, q, k, v, out, lse, aux_iter, pieces, spec, dq), dk.data, dv.data)
        return tuple(g.finish().to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
    for piece in pieces:
        gq, gk, gv = block_backward(dout, q, k, v, out, lse, next(aux_iter), piece, spec.scale, spec.kernel)
        dq.add(gq, piece.batch, piece.q_rows)
        dk.add(gk, piece.batch, piece.kv_rows)
        dv.add(gv, piece.batch, piece.kv_rows)
    return tuple(g.finish().to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
