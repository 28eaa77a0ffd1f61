"""Packed documents at CP 1: one packed-sequence attention call per layer, forward and backward.

Why. With one CP rank there is nothing to exchange: a batch of packed documents is a list of independent sequences,
which is exactly what a packed-sequence ("varlen", THD) kernel takes. Going through the documents layout instead cost
a host plan, index gathers and scatters, float32 accumulators and log-sum-exp merges per layer (32 device kernels
per layer against 14 for plain causal attention, measured on fake CUDA), more than masking saves at 8K tokens. Here
the batch's document boundaries become `cu_seqlens` over its B x S tokens, made by the data workers with the batch
(training/batch_plans.py), pinned and moved with it, and the model's q/k/v go to the kernel as the (B x S, H, D)
views they already are (the model's projections are (B, S, H, D) memory): no gather, no scatter, no merge.

- CUDA, half precision, head dim the flash ops serve: ONE `aten._flash_attention_forward` (FlashAttention-2, or
  FA3/FA4 once activated) with cum_seq_q = cum_seq_k = cu_seqlens, and ONE `_flash_attention_backward`; or, with
  `attention_kernel = "cudnn"` and the frontend installed, ONE cuDNN THD graph each way (kernel_cudnn_thd.py).
  Every sequence is a square (Lq == Lk), so bottom-right and top-left causal alignment agree. GQA native.
- Elsewhere (CPU; fp32 on CUDA): the same documents, one block-kernel call per document (the flash-CPU op on CPU,
  exact), written into the output at their rows; documents are disjoint, so nothing merges.

A row whose document ids are not runs (one id in two separate runs of a row: the same document, by the CP
contract) has no packed form: `PackedDocuments.from_ids` returns None and the caller keeps the documents layout.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from config.errors import Refusal
from parallelisms.cp import kernel_cudnn_thd as thd
from parallelisms.cp.kernel_blocks import CudaFlashBlock, choose_block_kernel, philox_placeholders
from parallelisms.cp.kernel_calls import block_backward, block_forward
from parallelisms.cp.plan_piece import Piece

aten = torch.ops.aten


@dataclass(frozen=True)
class PackedDocuments:
    """The documents of a (B, S) batch as sequences of its B x S tokens, row-major: sequence i is tokens
    cu_seqlens[i]..cu_seqlens[i + 1] of the flattened batch (a document never crosses a row)."""
    cu_seqlens: torch.Tensor
    """(n + 1,) int32: on the host (pinned by the loader) until `to` moves it with the batch."""
    max_seqlen: int
    """The longest document (host integer: the kernel's grid size, so no device read)."""
    host_cu: np.ndarray
    """cu_seqlens on the host: the per-document calls' rows."""
    batch: int
    seq_len: int
    thd_calls: dict = field(default_factory=dict, compare=False, repr=False)
    """The batch's cuDNN THD calls, made at the first layer (`thd_call`)."""

    @classmethod
    def from_ids(cls, document_ids) -> "PackedDocuments | None":
        """From (B, S) document ids (numpy or a host tensor); None when some row holds one id in two separate runs."""
        ids = np.asarray(document_ids)
        if ids.ndim != 2 or ids.size == 0:
            raise Refusal(f"document ids must be (batch, seq) and not empty, got shape {ids.shape}")
        batch, seq_len = ids.shape
        starts = np.ones(ids.shape, dtype=bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        ordered = np.sort(ids, axis=1)
        distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(axis=1)
        if not np.array_equal(starts.sum(axis=1), distinct):
            return None
        cu = np.append(np.flatnonzero(starts.reshape(-1)), ids.size).astype(np.int32)
        return cls(torch.from_numpy(cu), int(np.diff(cu).max()), cu, batch, seq_len)

    @property
    def documents(self) -> int:
        return self.host_cu.size - 1

    def pin_memory(self) -> "PackedDocuments":
        """Called by the DataLoader's pin-memory thread: page-locks cu_seqlens for a non_blocking copy."""
        return PackedDocuments(self.cu_seqlens.pin_memory(), self.max_seqlen, self.host_cu, self.batch, self.seq_len)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedDocuments":
        """cu_seqlens on the run's device: the batch's one host-to-device copy of it, no sync."""
        return PackedDocuments(self.cu_seqlens.to(device, non_blocking=non_blocking), self.max_seqlen, self.host_cu,
                               self.batch, self.seq_len)

    def thd_call(self, is_causal: bool) -> thd.ThdCall:
        """The batch's cuDNN THD call, one per causality for all layers (its bindings are made once)."""
        if is_causal not in self.thd_calls:
            self.thd_calls[is_causal] = thd.ThdCall(self.cu_seqlens, self.cu_seqlens, self.max_seqlen,
                                                    self.max_seqlen, is_causal)
        return self.thd_calls[is_causal]

    def pieces(self, is_causal: bool) -> list[Piece]:
        """One piece per document (the per-document path): (batch row, its rows) of each, causal or full."""
        return self._pieces if is_causal else [Piece(p.batch, p.q_rows, p.kv_rows, False) for p in self._pieces]

    @functools.cached_property
    def _pieces(self) -> list[Piece]:
        """The causal pieces, made once per batch (every layer, forward and backward, reads them)."""
        starts, ends = self.host_cu[:-1], self.host_cu[1:]
        rows = starts // self.seq_len
        return [Piece(slice(int(b), int(b) + 1), slice(int(s - b * self.seq_len), int(e - b * self.seq_len)),
                      slice(int(s - b * self.seq_len), int(e - b * self.seq_len)), True)
                for b, s, e in zip(rows, starts, ends)]


def one_packed_call(q: torch.Tensor, kernel: str) -> bool:
    """Whether this call runs as one packed flash call: CUDA, and the flash ops serve its dtype and head dim."""
    return q.device.type == "cuda" and isinstance(choose_block_kernel(q, needs_mask=False), CudaFlashBlock)


def _packed(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B x S, H, D): a view over the model's (B, S, H, D) projections (a copy otherwise)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _unpacked(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(B x S, H, D) -> (B, H, S, D), a view."""
    total, h, d = x.shape
    return x.view(batch, total // batch, h, d).transpose(1, 2)


def packed_forward(q, k, v, docs: PackedDocuments, is_causal: bool, scale, kernel: str, packed: str = "flash"):
    """(out (B, H, S, D), saved state for `packed_backward`). `packed`: the packed-sequence kernel
    (kernel_cudnn_thd.PACKED_KERNELS) where one call serves the layer."""
    if one_packed_call(q, kernel):
        qp, kp, vp = _packed(q), _packed(k), _packed(v)
        if packed == "cudnn_thd":
            call = docs.thd_call(is_causal)
            out, stats = thd.graphs_for(q.device).forward(qp, kp, vp, call, thd.default_scale(scale, q.size(-1)),
                                                          torch.are_deterministic_algorithms_enabled())
            return _unpacked(out, q.size(0)), (out, stats, call)
        out, lse, rng_state, unused, _ = aten._flash_attention_forward.default(
            qp, kp, vp, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen, 0.0, is_causal, False,
            scale=scale)
        return _unpacked(out, q.size(0)), (out, lse, rng_state, unused)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    auxes = []
    for piece in docs.pieces(is_causal):
        o, l, aux = block_forward(q, k, v, piece, scale, kernel)
        out[piece.batch, :, piece.q_rows], lse[piece.batch, :, piece.q_rows] = o, l
        auxes.append(aux)
    return out, (out, lse, auxes)


def packed_backward(dout, q, k, v, saved, docs: PackedDocuments, is_causal: bool, scale, kernel: str,
                    packed: str = "flash"):
    """(dq, dk, dv) in the inputs' shapes, from the forward's own output and log-sum-exp."""
    if one_packed_call(q, kernel):
        batch, qp, kp, vp = q.size(0), _packed(q), _packed(k), _packed(v)
        if packed == "cudnn_thd":
            out, stats, call = saved
            grads = thd.graphs_for(q.device).backward(_packed(dout), qp, kp, vp, out, stats, call,
                                                      thd.default_scale(scale, q.size(-1)),
                                                      torch.are_deterministic_algorithms_enabled())
            return tuple(_unpacked(g, batch) for g in grads)
        out, lse, rng_state, unused = saved
        dq, dk, dv = aten._flash_attention_backward.default(
            _packed(dout).contiguous(), qp, kp, vp, out, lse, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen,
            docs.max_seqlen, 0.0, is_causal, rng_state, unused, scale=scale)
        return _unpacked(dq, batch), _unpacked(dk, batch), _unpacked(dv, batch)
    out, lse, auxes = saved
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for piece, aux in zip(docs.pieces(is_causal), auxes):
        gq, gk, gv = block_backward(dout, q, k, v, out, lse, aux, piece, scale, kernel)
        dq[piece.batch, :, piece.q_rows] = gq
        dk[piece.batch, :, piece.kv_rows], dv[piece.batch, :, piece.kv_rows] = gk, gv
    return dq, dk, dv


def packed_lse(saved, q: torch.Tensor) -> torch.Tensor:
    """The forward's log-sum-exp as (B, Hq, S) float32 (a view), whatever layout its kernel wrote: what the
    registered CP op returns (cp/op.py). `packed_saved` turns it back."""
    b, h, s, _ = q.shape
    if len(saved) == 4:  # one flash varlen call: (H, B x S)
        return saved[1].view(h, b, s).permute(1, 0, 2)
    if isinstance(saved[2], thd.ThdCall):  # token-major (B x S, H, 1) stats
        return saved[1].view(b, s, h).permute(0, 2, 1)
    return saved[1]  # per document: (B, H, S) already


def packed_saved(out, lse, docs: PackedDocuments, is_causal: bool, q, kernel: str, packed: str):
    """What `packed_backward` takes, from the op's (B, H, S, D) output and (B, Hq, S) log-sum-exp; the flash
    kernels' philox state is a placeholder (dropout-free)."""
    if not one_packed_call(q, kernel):
        return out, lse, itertools.repeat(None)
    if packed == "cudnn_thd":
        return _packed(out), lse.permute(0, 2, 1).reshape(-1, q.size(1), 1), docs.thd_call(is_causal)
    return (_packed(out), lse.permute(1, 0, 2).reshape(q.size(1), -1).contiguous(), *philox_placeholders(q))


class PackedDocumentAttention(torch.autograd.Function):
    """Autograd for `packed_attention`: saves q, k, v and the kernel's own output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, docs: PackedDocuments, is_causal: bool, scale, kernel: str, packed: str):
        out, saved = packed_forward(q, k, v, docs, is_causal, scale, kernel, packed)
        tensors = [t for t in saved if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(q, k, v, *tensors)
        ctx.extra = [t for t in saved if not isinstance(t, torch.Tensor)]
        ctx.args = (docs, is_causal, scale, kernel, packed)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *tensors = ctx.saved_tensors
        dq, dk, dv = packed_backward(dout, q, k, v, (*tensors, *ctx.extra), *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments, *,
                     is_causal: bool = True, scale: float | None = None, kernel: str = "flash",
                     packed: str = "flash") -> torch.Tensor:
    """Attention of a (B, H, S, D) batch inside each of its packed documents (q (B, Hq, S, D), k/v (B, Hkv, S, D),
    GQA allowed), causal within each document when `is_causal`. `kernel`: the run's concrete kernel family;
    `packed`: the packed-sequence kernel (kernel_cudnn_thd.packed_kernel)."""
    if (docs.batch, docs.seq_len) != (q.size(0), q.size(2)):
        raise Refusal(f"packed documents of a ({docs.batch}, {docs.seq_len}) batch given q of shape "
                         f"{tuple(q.shape)}")
    return PackedDocumentAttention.apply(q, k, v, docs, is_causal, scale, kernel, packed)
