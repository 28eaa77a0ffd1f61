"""The parts every exact context-parallel attention shares (ring, all-gather, Ulysses, hybrid import them from here).

- `CommStats` and `UnsupportedAttentionError`: the counters a caller passes in, and the refusal of a call no variant
  can compute exactly.
- `check_attention_inputs` / `prepare_call`: the input checks and the group, layout and document-shard set-up every
  variant's entry point starts with.
- `BlockSpec`: what one CP attention call fixes (group, causality, scale, layout, documents); its `pieces` are the
  mask-free kernel calls a rank makes against one source rank's K/V (ring_plan.py: blocks cut by documents).
- `block_forward` and `LseAccumulator` (init / merge / finish): pieces computed by the attention kernels and merged
  through their log-sum-exp in float32 at their (batch rows, query rows). `RowBuffer` accumulates the backward's
  dQ / dK / dV the same way. No kernel ever gets a mask, so CUDA flash serves document-masked runs too.
- `pack_kv` / `unpack_kv`: K and V in one flat buffer, so one transfer carries both.
- `LseAttentionFunction`: autograd for a variant given as forward (-> out, lse, kernel auxiliaries) and backward
  from the final out and lse; nothing is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from config.errors import Refusal
from parallelisms.attention_blocks import choose_block_kernel
from parallelisms.ring_plan import FULL, DocumentShards, Piece, block_tasks, plain_pieces
from parallelisms.sequence_sharding import check_load_balancer, check_sequence_length, resolve_group
from parallelisms.varlen_blocks import add_call_grads, backward_calls, forward_calls, plan_calls, uses_varlen


UnsupportedAttentionError = Refusal  # the CP variants' name for the one runtime refusal (config/errors.py)


@dataclass
class CommStats:
    """Counters a caller passes in; the CP attention variants add the bytes this rank sent to them."""
    calls: int = 0
    forward_bytes_sent: int = 0  # forward: K/V blocks (ring, all-gather); Q, K, V and the output (Ulysses)
    backward_bytes_sent: int = 0  # backward: K/V blocks and float32 dK/dV accumulators, or the gradients' all-to-alls

    def count_sent(self, nbytes: int, backward: bool) -> None:
        if backward:
            self.backward_bytes_sent += nbytes
        else:
            self.forward_bytes_sent += nbytes

    @property
    def bytes_sent(self) -> int:
        return self.forward_bytes_sent + self.backward_bytes_sent


def count_sent(stats: CommStats | None, nbytes: int, backward: bool = False) -> None:
    """Adds `nbytes` to `stats` when the caller passed counters."""
    if stats is not None:
        stats.count_sent(nbytes, backward)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_attention_inputs(q, k, v, document_ids) -> None:
    """Self-attention over one sharded sequence: 4-D q/k/v of one batch and length, whole K/V head groups."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise UnsupportedAttentionError(f"ring attention needs 4-D (batch, heads, seq, head_dim) q/k/v, got "
                                        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.size(0) != k.size(0) or q.size(2) != k.size(2):
        raise UnsupportedAttentionError(f"ring attention is self-attention over one sharded sequence: q {tuple(q.shape)}"
                                        f" and k/v {tuple(k.shape)}/{tuple(v.shape)} must share batch and length")
    if q.size(1) % k.size(1) != 0:
        raise UnsupportedAttentionError(f"query heads ({q.size(1)}) must be a multiple of key/value heads ({k.size(1)})")
    if document_ids is not None and tuple(document_ids.shape) != (q.size(0), q.size(2)):
        raise UnsupportedAttentionError(f"document_ids must be (batch, local seq) = {(q.size(0), q.size(2))}, "
                                        f"got {tuple(document_ids.shape)}")


def gather_document_shards(document_ids: torch.Tensor, group: dist.ProcessGroup) -> DocumentShards:
    """Every rank's local document ids, by one all-gather (ids are small next to K/V)."""
    size = dist.get_world_size(group)
    if size == 1:
        return DocumentShards([document_ids])
    local = document_ids.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return DocumentShards(parts)


def prepare_call(q, k, v, group, load_balancer: str, document_ids, documents: DocumentShards | None):
    """The checks and set-up a block-merging variant (ring, all-gather) starts with: (process group, every rank's
    document shards or None)."""
    pg = resolve_group(group)
    check_load_balancer(load_balancer)
    check_attention_inputs(q, k, v, document_ids)
    size = dist.get_world_size(pg)
    check_sequence_length(q.size(2) * size, size, load_balancer)
    if load_balancer == "documents" and (documents is None or documents.positions is None):
        raise UnsupportedAttentionError("load_balancer='documents' is planned per row from the full document ids: "
                                        "call it through context_parallel(..., load_balancer='documents', "
                                        "document_ids=...)")
    if documents is None and document_ids is not None:
        documents = gather_document_shards(document_ids, pg)
    return pg, documents


def pack_kv(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)]).to(dtype or k.dtype)


def unpack_kv(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a `pack_kv` buffer in the shapes of `k` and `v`."""
    n = k.numel()
    return buf[:n].view(k.shape), buf[n:].view(v.shape)


@dataclass(frozen=True)
class BlockSpec:
    """What one CP attention call fixes for every block it computes."""
    group: dist.ProcessGroup
    is_causal: bool
    scale: float | None
    load_balancer: str
    docs: DocumentShards | None
    stats: CommStats | None

    def pieces(self, rank: int, src: int, size: int, local_len: int) -> list[Piece]:
        """The mask-free kernel calls `rank` makes against the K/V of rank `src` (cached per batch with documents)."""
        if self.load_balancer == "documents":
            return self.docs.layout_pieces(rank, src, self.is_causal)
        tasks = block_tasks(rank, src, size, local_len, self.load_balancer, self.is_causal)
        if self.docs is None:
            return plain_pieces(tasks)
        return self.docs.pieces(rank, src, tasks, local_len)


def rows_of(x: torch.Tensor, batch: slice, rows: slice) -> torch.Tensor:
    """The (batch rows, all heads, sequence rows) view of a (B, H, L, ...) tensor."""
    return x[batch, :, rows]


def block_forward(q, k_blk, v_blk, piece: Piece, scale):
    """(out, lse, kernel auxiliaries) of `piece`'s query rows against its K/V rows (no mask: pieces are full
    rectangles or causal squares)."""
    qs = rows_of(q, piece.batch, piece.q_rows)
    ks, vs = rows_of(k_blk, piece.batch, piece.kv_rows), rows_of(v_blk, piece.batch, piece.kv_rows)
    kernel = choose_block_kernel(q, needs_mask=False)
    return kernel.forward(qs, ks, vs, is_causal=piece.is_causal, scale=scale, mask=None)


def block_backward(dout, q, k_blk, v_blk, out, lse, aux, piece: Piece, scale):
    """(dQ, dK, dV) of one piece against the FINAL out and lse (as `lse_for_backward` prepared it)."""
    b, rows, kv_rows = piece.batch, piece.q_rows, piece.kv_rows
    kernel = choose_block_kernel(q, needs_mask=False)
    return kernel.backward(rows_of(dout, b, rows), rows_of(q, b, rows), rows_of(k_blk, b, kv_rows),
                           rows_of(v_blk, b, kv_rows), rows_of(out, b, rows), lse[b, :, rows], aux,
                           is_causal=piece.is_causal, scale=scale, mask=None)


def varlen_calls(spec: BlockSpec, pieces: list[Piece], device: torch.device):
    """The varlen calls of one block's pieces, planned once per batch (cached with the document shards)."""
    return spec.docs.cached(("varlen", id(pieces), str(device)), lambda: plan_calls(pieces, device))


def forward_pieces(q, k_blk, v_blk, pieces: list[Piece], spec: BlockSpec, acc: "LseAccumulator",
                   auxes: list) -> None:
    """One (rank, source) block merged into `acc`: on CUDA flash at most two varlen calls (varlen_blocks.py),
    otherwise one kernel call per piece. Kernel auxiliaries are appended to `auxes` in call order."""
    if uses_varlen(q, pieces):
        forward_calls(q, k_blk, v_blk, varlen_calls(spec, pieces, q.device), spec.scale, acc, auxes)
        return
    for piece in pieces:
        out, lse, aux = block_forward(q, k_blk, v_blk, piece, spec.scale)
        auxes.append(aux)
        acc.merge(out, lse, piece)


def backward_pieces(dout, q, k_blk, v_blk, out, lse, aux_iter, pieces: list[Piece], spec: BlockSpec,
                    dq: "RowBuffer") -> list:
    """The gradients of one block (as `forward_pieces` computed it): dQ added into `dq`; the dK/dV are returned
    for `add_kv_grads` (the ring adds them once the block's accumulator has arrived)."""
    if uses_varlen(q, pieces):
        return backward_calls(dout, q, k_blk, v_blk, out, lse, aux_iter, varlen_calls(spec, pieces, q.device),
                              spec.scale, dq)
    kv_grads = []
    for piece in pieces:
        gq, gk, gv = block_backward(dout, q, k_blk, v_blk, out, lse, next(aux_iter), piece, spec.scale)
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


def covers_all_rows(piece: Piece) -> bool:
    return piece.batch == FULL and piece.q_rows == FULL and piece.kv_rows == FULL


def _unwritten_runs(written: np.ndarray) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of the runs of False in a host (B, L) bool array."""
    runs = []
    for b, row in enumerate(written):
        edges = np.flatnonzero(np.diff(row.astype(np.int8), prepend=1, append=1)).tolist()
        runs += [(b, edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
    return runs


def _float32_rows(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An uninitialised float32 (B, H, L, ...) tensor laid out in memory like `like`: (B, L, H, ...) when `like` is
    the model's (B, L, H, D) projection seen as (B, H, L, D), as the attention kernels lay out their outputs and
    gradients. The model's transpose back to (B, L, H * D) is then a view, not a copy (nor a second saved tensor)."""
    if like.dim() == 4 and len(shape) >= 3 and like.stride(1) < like.stride(2):
        order = (shape[0], shape[2], shape[1], *shape[3:])
        return torch.empty(order, dtype=torch.float32, device=like.device).transpose(1, 2)
    return torch.empty(shape, dtype=torch.float32, device=like.device)


class RowBuffer:
    """A float32 (B, H, L, ...) buffer written piece by piece at (batch rows, sequence rows) and left uninitialised
    until then: a row's first piece is copied in, later ones add to it, rows no piece wrote get `fill` at the end.
    With documents nearly every row has exactly one piece, so one copy replaces a fill pass plus an add pass. Which
    rows were written is kept on the host in numpy (no device sync, and nothing the dry run's fake tensors would
    turn into shapes without values). Laid out in memory like `like` (`_float32_rows`)."""

    def __init__(self, like: torch.Tensor, shape, fill: float):
        self.like, self.shape, self.fill = like, tuple(shape), fill
        self.data: torch.Tensor | None = None
        self.written = np.zeros((self.shape[0], self.shape[2]), dtype=bool)
        self.filled = False  # every row not written holds `fill` (writers by row index need that)

    def view(self, batch: slice, rows: slice) -> torch.Tensor:
        return self.data[batch, :, rows]

    def claim(self, batch: slice, rows: slice) -> bool:
        """Marks the rows written; True when none was before (the caller copies), else the caller accumulates (rows
        of the region not written before are set to `fill` first)."""
        if self.data is None:
            self.data = _float32_rows(self.like, self.shape)
        region = self.written[batch, rows]
        new = not bool(region.any())
        if not new and not self.filled and not bool(region.all()):
            b0, r0 = batch.indices(self.shape[0])[0], rows.indices(self.shape[2])[0]
            for b, a, e in _unwritten_runs(region):
                self.data[b0 + b, :, r0 + a:r0 + e].fill_(self.fill)
        region[...] = True
        return new

    def ensure_filled(self) -> None:
        """Rows not written yet hold `fill` from now on (one kernel when the buffer is new): the varlen blocks
        (varlen_blocks.py) merge by row index, so they cannot fill the rows a piece touches first."""
        if self.filled:
            return
        if self.data is None:
            self.data = _float32_rows(self.like, self.shape).fill_(self.fill)
        else:
            for b, a, e in _unwritten_runs(self.written):
                self.data[b, :, a:e].fill_(self.fill)
        self.filled = True

    def adopt(self, value: torch.Tensor) -> None:
        """The whole buffer at once (a piece over every row, written first)."""
        self.data = value
        self.written[...] = True

    def add(self, grad: torch.Tensor, batch: slice, rows: slice) -> None:
        if self.data is None and batch == FULL and rows == FULL:
            self.adopt(grad.float())
        elif self.claim(batch, rows):
            self.view(batch, rows).copy_(grad)
        else:
            self.view(batch, rows).add_(grad)

    def finish(self) -> torch.Tensor:
        if self.data is None:
            return _float32_rows(self.like, self.shape).fill_(self.fill)
        if self.filled:
            return self.data
        for b, a, e in _unwritten_runs(self.written):
            self.data[b, :, a:e].fill_(self.fill)
        return self.data


class LseAccumulator:
    """The float32 output and log-sum-exp of this rank's queries, merged piece by piece (a row's first piece is
    copied in: see RowBuffer)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        self.q = q
        self.out = RowBuffer(q, q.shape[:-1] + (v.size(-1),), 0.0)
        self.lse = RowBuffer(q, q.shape[:-1], float("-inf"))

    def merge(self, out: torch.Tensor, lse: torch.Tensor, piece: Piece) -> None:
        """Adds a piece's (out, lse) into the accumulators at the piece's batch and query rows, in place."""
        if self.out.data is None and covers_all_rows(piece):
            # Copies: the kernel outputs may be cached by selective activation checkpointing, and later merges
            # update the accumulators in place.
            self.out.adopt(out.to(torch.float32, copy=True))
            self.lse.adopt(lse.to(torch.float32, copy=True))
            return
        b, rows = piece.batch, piece.q_rows
        new = self.out.claim(b, rows)
        self.lse.claim(b, rows)
        a_out, a_lse = self.out.view(b, rows), self.lse.view(b, rows)
        if new:
            a_out.copy_(out)
            a_lse.copy_(lse)
            return
        lse = lse.float()
        new_lse = torch.logaddexp(a_lse, lse)
        ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows nobody has seen yet stay at zero
        a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1)).addcmul_(out.float(), torch.exp(lse - ref).unsqueeze(-1))
        a_lse.copy_(new_lse)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output in the query dtype, float32 lse); rows no piece reached get 0 and -inf (with documents, rows
        that see nothing in any block)."""
        return self.out.finish().to(self.q.dtype), self.lse.finish()


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows that saw nothing get lse +inf, so the kernels' exp(score - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


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
