"""The kernel calls of one (rank, source) block: its pieces computed by the block kernels (kernel_blocks.py), or on
CUDA flash by at most two varlen calls (kernel_varlen.py), merged into the caller's accumulators (accumulators.py).
No kernel ever gets a mask, so CUDA flash serves document-masked runs too. `DocumentBlockForward` /
`DocumentBlockBackward` are the one compute step of both sparse exchanges (ring and all-gather) of the documents
layout."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallelisms.cp.kernel_blocks import CudaFlashBlock, choose_block_kernel
from parallelisms.cp.kernel_varlen import add_call_grads, backward_calls, forward_calls, plan_calls
from parallelisms.cp.plan_piece import Piece
from parallelisms.cp.rows import block_view

if TYPE_CHECKING:  # annotations only: this floor imports no accumulator or spec
    from parallelisms.cp.accumulators import LseAccumulator, RowBuffer
    from parallelisms.cp.block_spec import BlockSpec


def uses_varlen(q: torch.Tensor, pieces: list[Piece]) -> bool:
    """CUDA flash (fp16/bf16, head dim it serves) and a block cut into single-row pieces (documents). Whatever the
    kernel family, documents take the flash ops' varlen calls (FA2, or FA3/FA4 when activated): cuDNN's varlen
    backward is broken in torch 2.11 (kernel_blocks.py)."""
    if not pieces or q.device.type != "cuda":
        return False
    if not isinstance(choose_block_kernel(q, needs_mask=False), CudaFlashBlock):
        return False
    return all(p.batch.stop is not None and p.batch.stop - p.batch.start == 1 for p in pieces)


def rows_of(x: torch.Tensor, batch: slice, rows: slice) -> torch.Tensor:
    """The (batch rows, all heads, sequence rows) view of a (B, H, L, ...) tensor."""
    return x[batch, :, rows]


def block_forward(q, k_blk, v_blk, piece: Piece, scale, kernel: str = "flash"):
    """(out, lse, kernel auxiliaries) of `piece`'s query rows against its K/V rows (no mask: pieces are full
    rectangles or causal squares), on the block kernel of the run's kernel family `kernel` (kernel_blocks.py)."""
    qs = rows_of(q, piece.batch, piece.q_rows)
    ks, vs = rows_of(k_blk, piece.batch, piece.kv_rows), rows_of(v_blk, piece.batch, piece.kv_rows)
    block = choose_block_kernel(q, needs_mask=False, kernel=kernel)
    return block.forward(qs, ks, vs, is_causal=piece.is_causal, scale=scale, mask=None)


def block_backward(dout, q, k_blk, v_blk, out, lse, aux, piece: Piece, scale, kernel: str = "flash"):
    """(dQ, dK, dV) of one piece against the FINAL out and lse (as `lse_for_backward` prepared it)."""
    b, rows, kv_rows = piece.batch, piece.q_rows, piece.kv_rows
    block = choose_block_kernel(q, needs_mask=False, kernel=kernel)
    return block.backward(rows_of(dout, b, rows), rows_of(q, b, rows), rows_of(k_blk, b, kv_rows),
                           rows_of(v_blk, b, kv_rows), rows_of(out, b, rows), lse[b, :, rows], aux,
                           is_causal=piece.is_causal, scale=scale, mask=None)


def varlen_calls(spec: BlockSpec, pieces: list[Piece], device: torch.device):
    """The varlen calls of one block's pieces: moved with the batch's plan when the data workers made one, else
    planned here once per batch (cached with the document shards)."""
    def build():
        planned = spec.docs.planned_varlen_calls(pieces, device)
        return planned if planned is not None else plan_calls(pieces, device)

    return spec.docs.cached(("varlen", id(pieces), str(device)), build)


def forward_pieces(q, k_blk, v_blk, pieces: list[Piece], spec: BlockSpec, acc: LseAccumulator,
                   auxes: list) -> None:
    """One (rank, source) block merged into `acc`: on CUDA flash at most two varlen calls (kernel_varlen.py),
    otherwise one kernel call per piece. Kernel auxiliaries are appended to `auxes` in call order."""
    if uses_varlen(q, pieces):
        forward_calls(q, k_blk, v_blk, varlen_calls(spec, pieces, q.device), spec.scale, acc, auxes, spec.packed)
        return
    for piece in pieces:
        out, lse, aux = block_forward(q, k_blk, v_blk, piece, spec.scale, spec.kernel)
        auxes.append(aux)
        acc.merge(out, lse, piece)


def backward_pieces(dout, q, k_blk, v_blk, out, lse, aux_iter, pieces: list[Piece], spec: BlockSpec,
                    dq: RowBuffer) -> list:
    """The gradients of one block (as `forward_pieces` computed it): dQ added into `dq`; the dK/dV are returned
    for `add_kv_grads` (the ring adds them once the block's accumulator has arrived)."""
    if uses_varlen(q, pieces):
        return backward_calls(dout, q, k_blk, v_blk, out, lse, aux_iter, varlen_calls(spec, pieces, q.device),
                              spec.scale, dq, spec.packed)
    kv_grads = []
    for piece in pieces:
        gq, gk, gv = block_backward(dout, q, k_blk, v_blk, out, lse, next(aux_iter), piece, spec.scale, spec.kernel)
        dq.add(gq, piece.batch, piece.q_rows)
        kv_grads.append((piece, gk, gv))
    return kv_grads


def add_kv_grads(kv_grads: list, dk_blk: torch.Tensor, dv_blk: torch.Tensor) -> None:
    """Adds `backward_pieces`' dK/dV into float32 (B, Hkv, L, D) tensors (a piece's rows, or a varlen call's)."""
    for where, gk, gv in kv_grads:
        if isinstance(where, Piece):
            dk_blk[where.batch, :, where.kv_rows] += gk
            dv_blk[where.batch, :, where.kv_rows] += gv
        else:
            add_call_grads(where, gk, gv, dk_blk, dv_blk)


class DocumentBlockForward:
    """This rank's queries against one source's K/V block of the documents layout, merged into `acc`: the forward
    compute step of the sparse ring and the sparse all-gather."""

    def __init__(self, spec: BlockSpec, rank: int, q: torch.Tensor, acc: LseAccumulator):
        self.spec, self.rank, self.q, self.acc = spec, rank, q, acc
        self.auxes: list = []

    def __call__(self, src: int, k_blk: torch.Tensor, v_blk: torch.Tensor) -> None:
        pieces = self.spec.docs.layout_pieces(self.rank, src, self.spec.is_causal)
        forward_pieces(self.q, k_blk, v_blk, pieces, self.spec, self.acc, self.auxes)

    def finish(self):
        """(out, lse, kernel auxiliaries), what LseAttentionFunction saves."""
        return (*self.acc.finish(), self.auxes)


class DocumentBlockBackward:
    """The backward of `DocumentBlockForward`, block by block in the same order: dQ into `dq`, dK/dV added into the
    source's float32 (B * L, Hkv * D) row accumulators."""

    def __init__(self, spec: BlockSpec, rank: int, dout, q, out, lse, auxes: list, dq: RowBuffer):
        self.spec, self.rank, self.dq = spec, rank, dq
        self.dout, self.q, self.out, self.lse = dout, q, out, lse
        self.aux_iter = iter(auxes)

    def __call__(self, src: int, k_blk, v_blk, dk_flat: torch.Tensor, dv_flat: torch.Tensor) -> None:
        pieces = self.spec.docs.layout_pieces(self.rank, src, self.spec.is_causal)
        kv_grads = backward_pieces(self.dout, self.q, k_blk, v_blk, self.out, self.lse, self.aux_iter, pieces,
                                   self.spec, self.dq)
        add_kv_grads(kv_grads, block_view(dk_flat, k_blk), block_view(dv_flat, v_blk))
