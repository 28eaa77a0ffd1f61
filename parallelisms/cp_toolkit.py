"""The parts every exact context-parallel attention shares (ring, all-gather, Ulysses, hybrid import them from here).

- `CommStats` and `UnsupportedAttentionError`: the counters a caller passes in, and the refusal of a call no variant
  can compute exactly.
- `check_attention_inputs` / `prepare_call`: the input checks and the group, layout and document-shard set-up every
  variant's entry point starts with.
- `BlockSpec`: what one CP attention call fixes (group, causality, scale, layout, documents); its `pieces` are the
  mask-free kernel calls a rank makes against one source rank's K/V (ring_plan.py: blocks cut by documents).
- `block_forward` and `LseAccumulator` (init / merge / finish): pieces computed by the attention kernels and merged
  through their log-sum-exp in float32 at their (batch rows, query rows). `accumulate_grad` does the same for the
  backward's dQ / dK / dV. No kernel ever gets a mask, so CUDA flash serves document-masked runs too.
- `pack_kv` / `unpack_kv`: K and V in one flat buffer, so one transfer carries both.
- `LseAttentionFunction`: autograd for a variant given as forward (-> out, lse, kernel auxiliaries) and backward
  from the final out and lse; nothing is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.attention_blocks import choose_block_kernel
from parallelisms.ring_plan import FULL, DocumentShards, Piece, block_tasks, plain_pieces
from parallelisms.sequence_sharding import check_load_balancer, check_sequence_length, resolve_group


class UnsupportedAttentionError(NotImplementedError):
    """An attention call the CP variants cannot compute exactly (they refuse instead of computing something else)."""


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


def covers_all_rows(piece: Piece) -> bool:
    return piece.batch == FULL and piece.q_rows == FULL and piece.kv_rows == FULL


class LseAccumulator:
    """The float32 output and log-sum-exp of this rank's queries, merged piece by piece.

    A piece whose (batch, query) rows no earlier piece wrote is copied in instead of merged: with documents most
    pieces are the first (often the only) visitor of their rows, and the merge's exp/logaddexp passes are then
    wasted. Which rows were written is kept on the host (no device sync)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        self.q, self.v_dim = q, v.size(-1)
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.written = torch.zeros(q.size(0), q.size(2), dtype=torch.bool, device="cpu")  # host (B, L_local)

    def _zeros(self) -> None:
        q = self.q
        self.out = q.new_zeros(q.shape[:-1] + (self.v_dim,), dtype=torch.float32)
        self.lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)

    def _first_visit(self, piece: Piece) -> bool:
        rows = self.written[piece.batch, piece.q_rows]
        first = not bool(rows.any())
        rows.fill_(True)
        return first

    def merge(self, out: torch.Tensor, lse: torch.Tensor, piece: Piece) -> None:
        """Adds a piece's (out, lse) into the accumulators at the piece's batch and query rows, in place."""
        first = self._first_visit(piece)
        if self.out is None and covers_all_rows(piece):
            # Copies: the kernel outputs may be cached by selective activation checkpointing, and later merges
            # update the accumulators in place.
            self.out, self.lse = out.to(torch.float32, copy=True), lse.to(torch.float32, copy=True)
            return
        if self.out is None:
            self._zeros()
        a_out, a_lse = rows_of(self.out, piece.batch, piece.q_rows), self.lse[piece.batch, :, piece.q_rows]
        if first:
            a_out.copy_(out)
            a_lse.copy_(lse)
            return
        lse = lse.float()
        new_lse = torch.logaddexp(a_lse, lse)
        ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows nobody has seen yet stay at zero
        a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1)).addcmul_(out.float(), torch.exp(lse - ref).unsqueeze(-1))
        a_lse.copy_(new_lse)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output in the query dtype, float32 lse); rows no piece reached keep 0 and -inf (with documents, rows
        that see nothing in any block)."""
        if self.out is None:
            self._zeros()
        return self.out.to(self.q.dtype), self.lse


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows that saw nothing get lse +inf, so the kernels' exp(score - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def accumulate_grad(acc: torch.Tensor | None, grad: torch.Tensor, batch: slice, rows: slice,
                    like: torch.Tensor) -> torch.Tensor:
    """Adds `grad` (for `batch` x `rows` of `like`) into a float32 accumulator shaped like `like`, created on first
    use."""
    if acc is None and batch == FULL and rows == FULL:
        return grad.float()
    if acc is None:
        acc = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    acc[batch, :, rows] += grad
    return acc


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
