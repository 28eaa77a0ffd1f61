"""All pieces of one (rank, source) block in at most two CUDA flash varlen calls, forward and backward.

A block cut by documents is a list of mask-free pieces (plan_pieces.py): causal squares (a segment against itself) and
full rectangles. Calling a kernel per piece costs a launch plus ~7 merge kernels each, and most pieces are far
smaller than one 128 x 128 flash tile. Here every piece becomes one sequence of a varlen call
(`aten._flash_attention_forward` with `cum_seq_q` / `cum_seq_k`, backward `aten._flash_attention_backward`):
- the causal squares go in one call with is_causal = True (each is its own sequence, Lq == Lk, so flash's
  bottom-right alignment is the top-left one);
- the full rectangles sharing (batch row, query rows) are fused into one sequence whose keys are the concatenation of
  their key rows (pieces are disjoint and each fully visible, so no mask is needed), and all of them go in one call
  with is_causal = False. Query rows are therefore unique within a call, so its output scatters without collisions.
A query row can appear in both calls; the two results merge through their log-sum-exp like any two pieces.

Layouts (verified against torch 2.13's schema and meta functions, docs/gpu_step.md): packed q (total_q, Hq, D),
k/v (total_k, Hkv, D) with Hkv dividing Hq (GQA unexpanded: flash reads each K/V head for its query-head group),
cum_seq int32 (n + 1,), output (total_q, Hq, D), log-sum-exp float32 (Hq, total_q) packed (not padded per sequence),
and the backward wants that same (Hq, total_q) log-sum-exp and returns dK/dV in K/V's (total_k, Hkv, D).

Rows are addressed by (batch row, sequence row) index pairs on the device: one gather (`x.transpose(1, 2)[b, l]`) and
one scatter (`index_put_`) per tensor, whatever the memory layout of the (B, H, L, D) tensor. The plan of a block
(indices, offsets, longest sequences) is built once per batch on the host: in the data workers with the batch's plan
(plan_host.RankPlan, moved with the batch in one non_blocking copy), else at the first layer; either way it is cached
with the document shards.
CPU has no varlen kernel: it keeps the per-piece calls (kernel_calls.block_forward / block_backward); kernel_calls.uses_varlen
chooses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from parallelisms.cp import kernel_cudnn_thd as thd

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the kernels stay a leaf of the package
    from parallelisms.cp.plan_piece import Piece

aten = torch.ops.aten


@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call: which (batch, row) pairs are its packed queries and keys, and the sequence offsets."""
    is_causal: bool
    q_batch: torch.Tensor  # (total_q,) int64, device
    q_rows: torch.Tensor  # (total_q,) int64, device
    k_batch: torch.Tensor  # (total_k,) int64, device
    k_rows: torch.Tensor  # (total_k,) int64, device
    cum_q: torch.Tensor  # (n + 1,) int32, device
    cum_k: torch.Tensor  # (n + 1,) int32, device
    max_q: int
    max_k: int
    host_q: tuple[np.ndarray, np.ndarray]  # (batch, row) of the queries on the host: which accumulator rows it writes
    thd: dict = field(default_factory=dict, compare=False, repr=False)  # its cuDNN THD call, made at first use


def _ranges(starts: list[int], ends: list[int]) -> np.ndarray:
    """The concatenation of arange(s, e) for every (s, e), vectorized."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    lengths = ends - starts
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(lengths.sum(), dtype=np.int64) + offsets


def _sequences(rows: list[tuple], causal: bool) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
    """(batch row, q start, q end, key row ranges) per sequence from piece rows (batch, q_start, q_end, kv_start,
    kv_end, causal): causal squares one each, full rectangles fused by (batch row, query rows)."""
    fused: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for b, qa, qb, ka, kb, is_causal in rows:
        if bool(is_causal) != causal:
            continue
        key = (b, qa, qb)
        if causal:
            fused[key] = [(ka, kb)]
        else:
            fused.setdefault(key, []).append((ka, kb))
    return [(b, qa, qb, keys) for (b, qa, qb), keys in fused.items()]


@dataclass(frozen=True)
class HostCall:
    """One varlen call's indices on the host: made per batch where the plan is made (the data workers, with
    plan_host.RankPlan, which moves them with the batch), or at the first layer without a plan."""
    is_causal: bool
    q_batch: np.ndarray  # (total_q,) int64, as the other three index arrays
    q_rows: np.ndarray
    k_batch: np.ndarray
    k_rows: np.ndarray
    cum_q: np.ndarray  # (n + 1,) int32
    cum_k: np.ndarray
    max_q: int
    max_k: int

    @property
    def index_parts(self) -> tuple[np.ndarray, ...]:
        """The four int64 index arrays, in VarlenCall's order."""
        return self.q_batch, self.q_rows, self.k_batch, self.k_rows

    def on_device(self, index_views, cum_views) -> "VarlenCall":
        """The call over device tensors holding `index_parts` and (cum_q, cum_k), already moved."""
        qb, qr, kb, kr = index_views
        return VarlenCall(self.is_causal, qb, qr, kb, kr, *cum_views, self.max_q, self.max_k,
                          (self.q_batch, self.q_rows))


def _host_call(seqs, causal: bool) -> HostCall:
    q_len = [qb - qa for _, qa, qb, _ in seqs]
    k_len = [sum(e - s for s, e in keys) for *_, keys in seqs]
    q_rows = _ranges([qa for _, qa, _, _ in seqs], [qb for _, _, qb, _ in seqs])
    k_ranges = [(s, e) for *_, keys in seqs for s, e in keys]
    k_rows = _ranges([s for s, _ in k_ranges], [e for _, e in k_ranges])
    q_batch = np.repeat(np.asarray([b for b, *_ in seqs], dtype=np.int64), q_len)
    k_batch = np.repeat(np.asarray([b for b, *_ in seqs], dtype=np.int64), k_len)
    cum_q, cum_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_len, k_len))
    return HostCall(causal, q_batch, q_rows, k_batch, k_rows, cum_q, cum_k,
                    max(q_len), max(k_len))


def host_calls(rows: list[tuple]) -> list[HostCall]:
    """At most two calls (causal squares, then fused full rectangles) of one block's single-row pieces, given as
    rows (batch, q_start, q_end, kv_start, kv_end, causal)."""
    calls = []
    for causal in (True, False):
        seqs = _sequences(rows, causal)
        if seqs:
            calls.append(_host_call(seqs, causal))
    return calls


def piece_rows(pieces: list[Piece]) -> list[tuple]:
    return [(p.batch.start, p.q_rows.start, p.q_rows.stop, p.kv_rows.start, p.kv_rows.stop, p.is_causal)
            for p in pieces]


def plan_calls(pieces: list[Piece], device) -> list[VarlenCall]:
    """The calls of one block's pieces planned here, at the first layer (no batch plan): their indices copied to
    `device` now, one copy for the four index arrays and one per offset array."""
    calls = []
    for host in host_calls(piece_rows(pieces)):
        index = torch.from_numpy(np.stack(host.index_parts)).to(device) if host.q_batch.size == host.k_batch.size \
            else [torch.from_numpy(a).to(device) for a in host.index_parts]
        calls.append(host.on_device(tuple(index), tuple(torch.from_numpy(c).to(device)
                                                         for c in (host.cum_q, host.cum_k))))
    return calls


def gather_tokens(x: torch.Tensor, batch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(total, H, ...) rows of a (B, H, L, ...) tensor, contiguous: one index kernel. The aten op itself, not
    Python indexing (whose CUDA device guard a fake CUDA tensor on a CPU build cannot take)."""
    return aten.index.Tensor(x.transpose(1, 2), [batch, rows])


def put_tokens(x: torch.Tensor, batch: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
               accumulate: bool) -> None:
    """Writes (or adds, duplicates allowed) (total, H, ...) values at rows of a (B, H, L, ...) tensor in place."""
    aten.index_put_.default(x.transpose(1, 2), [batch, rows], values.to(x.dtype), accumulate)


def varlen_forward(q, k_blk, v_blk, call: VarlenCall, scale, packed: str = "flash"):
    """(out (total_q, Hq, D), lse (Hq, total_q) float32, aux) of one call; K/V heads as they are (GQA native).
    `packed` "cudnn_thd": cuDNN's THD graph (kernel_cudnn_thd.py), its token-major stats seen as (Hq, total_q)."""
    qs = gather_tokens(q, call.q_batch, call.q_rows)
    ks, vs = (gather_tokens(x, call.k_batch, call.k_rows) for x in (k_blk, v_blk))
    if packed == "cudnn_thd":
        out, stats = thd.graphs_for(q.device).forward(qs, ks, vs, _thd_call(call),
                                                      thd.default_scale(scale, q.size(-1)),
                                                      torch.are_deterministic_algorithms_enabled())
        return out, stats.squeeze(-1).transpose(0, 1), None
    out, lse, rng_state, unused, _ = aten._flash_attention_forward.default(
        qs, ks, vs, call.cum_q, call.cum_k, call.max_q, call.max_k, 0.0, call.is_causal, False, scale=scale)
    return out, lse, (rng_state, unused)


def _thd_call(call: VarlenCall) -> thd.ThdCall:
    """The call as cuDNN THD takes it, made once per batch (the call is cached with the batch's documents), so its
    bindings are shared by every layer and both directions."""
    if "call" not in call.thd:
        call.thd["call"] = thd.ThdCall(call.cum_q, call.cum_k, call.max_q, call.max_k, call.is_causal)
    return call.thd["call"]


def merge_into(acc, out: torch.Tensor, lse: torch.Tensor, call: VarlenCall) -> None:
    """Merges a call's packed (out, lse) into an LseAccumulator at its query rows (unique within a call)."""
    out_buf, lse_buf = acc.out, acc.lse
    b, r = call.host_q
    fresh = not out_buf.written[b, r].any()
    out_buf.ensure_filled()
    lse_buf.ensure_filled()
    out_buf.written[b, r] = True
    lse_buf.written[b, r] = True
    lse_t = lse.transpose(0, 1)  # (total_q, Hq)
    if fresh:
        put_tokens(out_buf.data, call.q_batch, call.q_rows, out, accumulate=False)
        put_tokens(lse_buf.data, call.q_batch, call.q_rows, lse_t, accumulate=False)
        return
    a_out = gather_tokens(out_buf.data, call.q_batch, call.q_rows)
    a_lse = gather_tokens(lse_buf.data, call.q_batch, call.q_rows)
    new_lse = torch.logaddexp(a_lse, lse_t)
    ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    merged = a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1)).addcmul_(out.float(),
                                                                       torch.exp(lse_t - ref).unsqueeze(-1))
    put_tokens(out_buf.data, call.q_batch, call.q_rows, merged, accumulate=False)
    put_tokens(lse_buf.data, call.q_batch, call.q_rows, new_lse, accumulate=False)


def forward_calls(q, k_blk, v_blk, calls: list[VarlenCall], scale, acc, auxes: list, packed: str = "flash") -> None:
    """Every call of one block, merged into `acc`; their auxiliaries appended to `auxes` in order."""
    for call in calls:
        out, lse, aux = varlen_forward(q, k_blk, v_blk, call, scale, packed)
        auxes.append(aux)
        merge_into(acc, out, lse, call)


def varlen_backward(dout, q, k_blk, v_blk, out, lse, aux, call: VarlenCall, scale, packed: str = "flash"):
    """(dQ (total_q, Hq, D), dK, dV (total_k, Hkv, D)) of one call against the FINAL out and lse (B, Hq, L)."""
    qs, dos, os_ = (gather_tokens(x, call.q_batch, call.q_rows) for x in (q, dout, out))
    ks, vs = (gather_tokens(x, call.k_batch, call.k_rows) for x in (k_blk, v_blk))
    if packed == "cudnn_thd":
        stats = gather_tokens(lse, call.q_batch, call.q_rows).unsqueeze(-1)  # token-major (total_q, Hq, 1)
        return thd.graphs_for(q.device).backward(dos, qs, ks, vs, os_, stats, _thd_call(call),
                                                 thd.default_scale(scale, q.size(-1)),
                                                 torch.are_deterministic_algorithms_enabled())
    if aux is None:  # the registered CP op's backward keeps none: dropout-free, placeholders as
        # kernel_blocks.philox_placeholders makes them (not imported: this file stays a floor below it); torch 2.11's
        # mha_varlen_bwd reads the seed only when dropout_p > 0 (that docstring cites the lines)
        aux = (torch.zeros(2, dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64, device=q.device))
    rng_state, unused = aux
    lses = gather_tokens(lse, call.q_batch, call.q_rows).transpose(0, 1).contiguous()  # (Hq, total_q)
    return aten._flash_attention_backward.default(
        dos, qs, ks, vs, os_, lses, call.cum_q, call.cum_k, call.max_q, call.max_k, 0.0, call.is_causal,
        rng_state, unused, scale=scale)


def backward_calls(dout, q, k_blk, v_blk, out, lse, aux_iter, calls: list[VarlenCall], scale, dq,
                   packed: str = "flash") -> list:
    """Every call of one block: dQ added into the RowBuffer `dq`; returns [(call, dK, dV)] for `add_call_grads`."""
    kv_grads = []
    for call in calls:
        gq, gk, gv = varlen_backward(dout, q, k_blk, v_blk, out, lse, next(aux_iter), call, scale, packed)
        dq.ensure_filled()
        dq.written[call.host_q] = True
        put_tokens(dq.data, call.q_batch, call.q_rows, gq, accumulate=True)
        kv_grads.append((call, gk, gv))
    return kv_grads


def add_call_grads(call: VarlenCall, gk, gv, dk_blk: torch.Tensor, dv_blk: torch.Tensor) -> None:
    """Adds a call's packed dK/dV into float32 (B, Hkv, L, D) tensors (key rows may repeat: index_put_ adds)."""
    put_tokens(dk_blk, call.k_batch, call.k_rows, gk, accumulate=True)
    put_tokens(dv_blk, call.k_batch, call.k_rows, gv, accumulate=True)
