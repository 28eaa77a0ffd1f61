"""Exact ring attention: K/V blocks travel the CP ring, partial results merge through their log-sum-exp in float32.

Forward: at step s a rank holds the K/V of rank (r - s) mod P; the transfer of the next block is posted before the
current block is computed (double buffer). Backward (custom autograd function): dQ accumulates locally; K/V travel the
ring again together with float32 dK/dV accumulators, and one last hop returns each accumulator to the rank that owns
the block. Every block backward uses the final output and log-sum-exp; nothing else is recomputed. P = 1 runs the same
code with no transfers; so does `local_segment_attention` (no group at all: Ulysses after its all-to-all). With
documents every block is computed as mask-free pieces (ring_plan.py). The shared parts (block spec, accumulator,
packing, autograd) are in cp_toolkit.py. The "documents" layout runs the sparse shifts of ring_sparse.py instead.
"""
from __future__ import annotations

import torch

from parallelisms.comm import RingLinks, wait_all
from parallelisms.cp_toolkit import (BlockSpec, CommStats, LseAccumulator, LseAttentionFunction, RowBuffer,
                                     add_kv_grads, backward_pieces, block_backward, count_sent, forward_pieces,
                                     lse_for_backward, nbytes, pack_kv, prepare_call, unpack_kv)
from parallelisms.ring_plan import DocumentShards
from parallelisms.ring_sparse import sparse_backward, sparse_forward
from parallelisms.varlen_blocks import uses_varlen

KV_TAG = 0


class _NoLinks:
    """The ring of one rank without a process group (`local_segment_attention`): nothing is ever exchanged."""
    size, rank = 1, 0


def _links(spec: BlockSpec):
    return RingLinks(spec.group) if spec.group is not None else _NoLinks()


def ring_forward(q, k, v, spec: BlockSpec):
    """q (B, Hq, S_local, D) against every rank's k, v (B, Hkv, S_local, D) -> (out, float32 lse (B, Hq, S_local),
    the kernels' auxiliaries per block, in compute order)."""
    links = _links(spec)
    size, rank, local_len = links.size, links.rank, q.size(2)
    acc = LseAccumulator(q, v)
    auxes = []
    cur = pack_kv(k, v) if size > 1 else None  # (K+V,) this step's block
    spare = torch.empty_like(cur) if size > 1 else None  # (K+V,) the next step's block, in flight
    for step in range(size):
        src = (rank - step) % size
        pending = []
        if step < size - 1:
            pending = links.exchange([cur], [spare], KV_TAG)
            count_sent(spec.stats, nbytes(cur))
        k_blk, v_blk = (k, v) if step == 0 else unpack_kv(cur, k, v)
        forward_pieces(q, k_blk, v_blk, spec.pieces(rank, src, size, local_len), spec, acc, auxes)
        wait_all(pending)
        cur, spare = spare, cur
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
    for step in range(size):
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
        gq, gk, gv = block_backward(dout, q, k, v, out, lse, next(aux_iter), piece, spec.scale)
        dq.add(gq, piece.batch, piece.q_rows)
        dk.add(gk, piece.batch, piece.kv_rows)
        dv.add(gv, piece.batch, piece.kv_rows)
    return tuple(g.finish().to(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                   scale: float | None = None, load_balancer: str = "zigzag", document_ids: torch.Tensor | None = None,
                   stats: CommStats | None = None, _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries against the whole sharded sequence.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0, sharded by `load_balancer`.
    `group`: a ProcessGroup or 1-D DeviceMesh (size 1 is valid). `document_ids` (B, S_local), sharded like the tokens:
    queries see only keys of their own document (combined with causality when `is_causal`).
    """
    pg, docs = prepare_call(q, k, v, group, load_balancer, document_ids, _documents)
    spec = BlockSpec(pg, is_causal, scale, load_balancer, docs, stats)
    if load_balancer == "documents":  # only the rows each rank can see travel (ring_sparse.py)
        return LseAttentionFunction.apply(q, k, v, spec, sparse_forward, sparse_backward)
    return LseAttentionFunction.apply(q, k, v, spec, ring_forward, ring_backward)


def local_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentShards | None, *,
                            is_causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Exact attention over one whole sequence held by this rank (q (B, Hq, S, D), k/v (B, Hkv, S, D), positions in
    order), with `documents` of that sequence (one shard): the ring's pieces at P = 1 without a process group. Ulysses
    runs this after its all-to-all, so documents never need an (S, S) mask there either. `documents` with positions
(the documents layout, in any order) are cut by position segments instead."""
    layout = "documents" if documents is not None and documents.positions is not None else "contiguous"
    spec = BlockSpec(None, is_causal, scale, layout, documents, None)
    return LseAttentionFunction.apply(q, k, v, spec, ring_forward, ring_backward)
