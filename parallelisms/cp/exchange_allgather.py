"""All-gather context parallelism (Llama 3's CP): one all-gather of K/V, then local queries against the whole sequence.

Same layouts, block plan and document pieces as the ring (plan_pieces.py), but the K/V of every rank arrive in one
collective instead of P-1 hops. The local (diagonal) block is computed while the gather is in flight. Pieces that
share their batch and query rows and are full rectangles are concatenated along the keys and computed in ONE kernel
call (zigzag without documents: at most three calls per rank whatever P is), so the kernels see long blocks.
Backward gathers K/V again (nothing P-sized is kept between forward and backward) and returns each block's dK/dV to
its owner with a reduce-scatter in float32. The DOCUMENTS layout runs exchange_allgather_sparse.py instead (only the
visible rows move, by an all-to-all with variable splits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallelisms.comm import all_gather_single, reduce_scatter_single
from parallelisms.cp.accumulators import LseAccumulator, RowBuffer, lse_for_backward
from parallelisms.cp.counters import count_sent, nbytes
from parallelisms.cp.kernel_calls import block_backward, block_forward
from parallelisms.cp.plan_piece import FULL, Piece
from parallelisms.cp.rows import pack_kv, unpack_kv

if TYPE_CHECKING:
    from parallelisms.cp.block_spec import BlockSpec


def _length(rows: slice, local_len: int) -> int:
    return len(range(*rows.indices(local_len)))


@dataclass
class FusedBlock:
    """One kernel call: `piece`'s batch and query rows against the concatenated K/V rows of every member piece."""
    piece: Piece  # batch, query rows and causality of the call (kv_rows unused: the members say where keys come from)
    members: list[tuple[int, slice]]  # (source rank, K/V rows of its piece)

    def kv(self, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.piece.batch
        ks = [blocks[src][0][b, :, rows] for src, rows in self.members]
        vs = [blocks[src][1][b, :, rows] for src, rows in self.members]
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def scatter_grads(self, dkv: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, k, v) -> None:
        """Adds the concatenated block's dK/dV into the float32 (P, K+V) accumulator at each member's rows."""
        offset, b = 0, self.piece.batch
        for src, rows in self.members:
            n = _length(rows, k.size(2))
            acc_k, acc_v = unpack_kv(dkv[src], k, v)
            acc_k[b, :, rows] += gk[:, :, offset:offset + n]
            acc_v[b, :, rows] += gv[:, :, offset:offset + n]
            offset += n


def _fuse(members: list[tuple[int, Piece]]) -> FusedBlock:
    """One kernel call for pieces with the same batch and query rows. Only full rectangles are fused: their key sets
    are disjoint (pieces never overlap) and each is fully visible, so the concatenation needs no mask."""
    first = members[0][1]
    piece = Piece(first.batch, first.q_rows, FULL, first.is_causal)
    return FusedBlock(piece, [(src, p.kv_rows) for src, p in members])


def plan_blocks(spec: BlockSpec, rank: int, size: int, local_len: int, sources) -> list[FusedBlock]:
    """Every piece this rank computes against `sources`, full rectangles fused by batch and query rows (deterministic
    order; zigzag without documents: at most three calls per rank)."""
    causal, by_rows = [], {}
    for src in sources:
        for piece in spec.pieces(rank, src, size, local_len):
            if piece.is_causal:
                causal.append(_fuse([(src, piece)]))
            else:
                key = (piece.batch.indices(1 << 62), piece.q_rows.indices(local_len))
                by_rows.setdefault(key, []).append((src, piece))
    return causal + [_fuse(members) for members in by_rows.values()]


def _start_gather(k, v, spec: BlockSpec, size: int, count_as_backward: bool):
    """Posts the all-gather of every rank's packed K/V: ((P, K+V) buffer, its work handle or None at P = 1)."""
    packed = pack_kv(k, v)
    if size == 1:
        return packed.view(1, -1), None
    gathered = packed.new_empty(size, packed.numel())
    work = all_gather_single(gathered.view(-1), packed, group=spec.group, async_op=True)
    count_sent(spec.stats, (size - 1) * nbytes(packed), backward=count_as_backward)
    return gathered, work


def _phases(rank: int, size: int):
    """The local block first (it needs nothing from the gather), then every other rank's."""
    return ((rank,), tuple(src for src in range(size) if src != rank))


def allgather_forward(q, k, v, spec: BlockSpec):
    group = spec.group
    size, rank, local_len = dist.get_world_size(group), dist.get_rank(group), q.size(2)
    gathered, work = _start_gather(k, v, spec, size, count_as_backward=False)
    blocks = {rank: (k, v)}
    acc = LseAccumulator(q, v)
    auxes = []
    for phase, sources in enumerate(_phases(rank, size)):
        if phase == 1 and work is not None:
            work.wait()
            blocks.update({src: unpack_kv(gathered[src], k, v) for src in sources})
        for fused in plan_blocks(spec, rank, size, local_len, sources):
            k_blk, v_blk = fused.kv(blocks)  # already cut to the piece's batch and key rows
            piece = Piece(FULL, fused.piece.q_rows, FULL, fused.piece.is_causal)
            out, lse, aux = block_forward(q[fused.piece.batch], k_blk, v_blk, piece, spec.scale, spec.kernel)
            auxes.append(aux)
            acc.merge(out, lse, fused.piece)
    if spec.stats is not None:
        spec.stats.calls += 1
    return (*acc.finish(), auxes)


def allgather_backward(dout, q, k, v, out, lse, auxes, spec: BlockSpec):
    group = spec.group
    size, rank, local_len = dist.get_world_size(group), dist.get_rank(group), q.size(2)
    lse = lse_for_backward(lse)
    gathered, work = _start_gather(k, v, spec, size, count_as_backward=True)
    blocks = {rank: (k, v)}
    dq = RowBuffer(q, q.shape, 0.0)  # float32
    dkv = torch.zeros(size, k.numel() + v.numel(), dtype=torch.float32, device=k.device)
    aux_iter = iter(auxes)
    for phase, sources in enumerate(_phases(rank, size)):
        if phase == 1 and work is not None:
            work.wait()
            blocks.update({src: unpack_kv(gathered[src], k, v) for src in sources})
        for fused in plan_blocks(spec, rank, size, local_len, sources):
            b = fused.piece.batch
            k_blk, v_blk = fused.kv(blocks)
            piece = Piece(FULL, fused.piece.q_rows, FULL, fused.piece.is_causal)
            gq, gk, gv = block_backward(dout[b], q[b], k_blk, v_blk, out[b], lse[b], next(aux_iter), piece,
                                        spec.scale, spec.kernel)
            dq.add(gq, b, fused.piece.q_rows)
            fused.scatter_grads(dkv, gk, gv, k, v)
    if size > 1:
        mine = dkv.new_empty(dkv.size(1))
        reduce_scatter_single(mine, dkv.view(-1), group=group)
        count_sent(spec.stats, (size - 1) * nbytes(mine), backward=True)
    else:
        mine = dkv[0]
    dk, dv = unpack_kv(mine, k, v)
    return dq.finish().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
