"""Exact ring attention: K/V blocks travel the CP ring, partial results merge through their log-sum-exp in float32.

Forward: at step s a rank holds the K/V of rank (r - s) mod P; the transfer of the next block is posted before the
current block is computed (double buffer). Backward (custom autograd function): dQ accumulates locally; K/V travel the
ring again together with float32 dK/dV accumulators, and one last hop returns each accumulator to the rank that owns
the block. Every block backward uses the final output and log-sum-exp; nothing else is recomputed. P = 1 runs the same
code with no transfers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.attention_blocks import choose_block_kernel
from parallelisms.comm import RingLinks, wait_all
from parallelisms.ring_plan import DocumentShards, MaskedTask, block_tasks, resolve_tasks
from parallelisms.sequence_sharding import check_load_balancer, check_sequence_length, resolve_group

KV_TAG = 0


class UnsupportedAttentionError(NotImplementedError):
    """An attention call the ring cannot compute exactly (it refuses instead of computing something else)."""


@dataclass
class CommStats:
    """Counters a caller passes in; ring attention adds to them (bytes this rank sent)."""
    calls: int = 0
    kv_bytes_sent: int = 0  # forward: K/V blocks
    backward_bytes_sent: int = 0  # backward: K/V blocks and float32 dK/dV accumulators


def _pack(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)]).to(dtype or k.dtype)


def _unpack(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = k.numel()
    return buf[:n].view(k.shape), buf[n:].view(v.shape)


@dataclass(frozen=True)
class _RingSpec:
    group: dist.ProcessGroup
    is_causal: bool
    scale: float | None
    load_balancer: str
    docs: DocumentShards | None
    stats: CommStats | None

    def tasks(self, rank: int, src: int, size: int, local_len: int, dtype) -> list[MaskedTask]:
        plain = block_tasks(rank, src, size, local_len, self.load_balancer, self.is_causal)
        return resolve_tasks(plain, self.docs, rank, src, dtype)


def _block_forward(q, k_blk, v_blk, job: MaskedTask, scale):
    task = job.task
    qs = q[:, :, task.q_rows]
    ks, vs = k_blk[:, :, task.kv_rows], v_blk[:, :, task.kv_rows]
    kernel = choose_block_kernel(q, job.mask is not None)
    out, lse, aux = kernel.forward(qs, ks, vs, is_causal=job.is_causal, scale=scale, mask=job.mask)
    if job.empty_rows is not None:  # kernels give lse 0 (not -inf) for rows that see nothing
        lse = lse.masked_fill(job.empty_rows, float("-inf"))
        out = out.masked_fill(job.empty_rows[..., None], 0.0)
    return out, lse, aux


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, rows: slice) -> None:
    """Adds a block's (out, lse) into the float32 accumulators for `rows`, in place."""
    a_out, a_lse = acc_out[:, :, rows], acc_lse[:, :, rows]
    new_lse = torch.logaddexp(a_lse, lse)
    ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows nobody has seen yet stay at zero
    a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1)).addcmul_(out, torch.exp(lse - ref).unsqueeze(-1))
    a_lse.copy_(new_lse)


def _covers_all(job: MaskedTask) -> bool:
    return job.task.q_rows == slice(None) and job.task.kv_rows == slice(None)


def ring_forward(q, k, v, spec: _RingSpec):
    links = RingLinks(spec.group)
    size, rank, local_len = links.size, links.rank, q.size(2)
    acc_out = acc_lse = None
    auxes = []
    cur = _pack(k, v) if size > 1 else None
    spare = torch.empty_like(cur) if size > 1 else None
    for step in range(size):
        src = (rank - step) % size
        pending = []
        if step < size - 1:
            pending = links.exchange([cur], [spare], KV_TAG)
            if spec.stats is not None:
                spec.stats.kv_bytes_sent += cur.numel() * cur.element_size()
        k_blk, v_blk = (k, v) if step == 0 else _unpack(cur, k, v)
        for job in spec.tasks(rank, src, size, local_len, q.dtype):
            out, lse, aux = _block_forward(q, k_blk, v_blk, job, spec.scale)
            auxes.append(aux)
            if acc_out is None and _covers_all(job):
                # Copies: the kernel outputs may be cached by selective activation checkpointing, and the merge
                # updates the accumulators in place.
                acc_out, acc_lse = out.to(torch.float32, copy=True), lse.to(torch.float32, copy=True)
                continue
            if acc_out is None:
                acc_out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=torch.float32)
                acc_lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
            _merge(acc_out, acc_lse, out.float(), lse.float(), job.task.q_rows)
        wait_all(pending)
        cur, spare = spare, cur
    if acc_out is None:  # nothing visible anywhere (only possible with document masks on empty rows)
        acc_out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=torch.float32)
        acc_lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    if spec.stats is not None:
        spec.stats.calls += 1
    return acc_out.to(q.dtype), acc_lse, auxes


def _accumulate(acc: torch.Tensor | None, grad: torch.Tensor, rows: slice, like: torch.Tensor) -> torch.Tensor:
    if acc is None and rows == slice(None):
        return grad.float()
    if acc is None:
        acc = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    acc[:, :, rows] += grad
    return acc


def ring_backward(dout, q, k, v, out, lse, auxes, spec: _RingSpec):
    """At step s a rank holds K/V of rank (r - s) mod P and that block's float32 dK/dV accumulator, received from the
    rank that held it at step s - 1. Each step posts ONE group: the accumulator finished last step goes to the next
    rank while this block's arrives from the previous one, together with the K/V hop (NCCL's grouping rule,
    parallelisms/comm.py). A last hop returns every accumulator to the rank that owns its block."""
    links = RingLinks(spec.group)
    size, rank, local_len = links.size, links.rank, q.size(2)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows that saw nothing: exp(s - inf) = 0, not NaN
    dq = None
    cur = _pack(k, v) if size > 1 else None
    spare = torch.empty_like(cur) if size > 1 else None
    # (K+V,) float32 accumulators: the one this step adds into, and the one finished last step (being sent on).
    dkv = [torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device),
           torch.empty(k.numel() + v.numel(), dtype=torch.float32, device=k.device)] if size > 1 else None
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
            _count_backward(spec, buf)
        k_blk, v_blk = (k, v) if step == 0 else _unpack(cur, k, v)
        kv_grads = []
        for job in spec.tasks(rank, src, size, local_len, q.dtype):
            kernel = choose_block_kernel(q, job.mask is not None)
            rows, kv_rows = job.task.q_rows, job.task.kv_rows
            # dout, q, out (B, Hq, rows, D) and lse (B, Hq, rows) against K/V (B, Hkv, kv_rows, D) of block `src`.
            gq, gk, gv = kernel.backward(dout[:, :, rows], q[:, :, rows], k_blk[:, :, kv_rows], v_blk[:, :, kv_rows],
                                         out[:, :, rows], lse[:, :, rows], next(aux_iter), is_causal=job.is_causal,
                                         scale=spec.scale, mask=job.mask)
            dq = _accumulate(dq, gq, rows, q)
            kv_grads.append((kv_rows, gk, gv))
        if size == 1:
            dk = dv = None
            for kv_rows, gk, gv in kv_grads:
                dk, dv = _accumulate(dk, gk, kv_rows, k), _accumulate(dv, gv, kv_rows, v)
            dk = dk if dk is not None else torch.zeros_like(k, dtype=torch.float32)
            dv = dv if dv is not None else torch.zeros_like(v, dtype=torch.float32)
            break
        wait_all(pending)  # this block's accumulator has arrived, and the next K/V
        acc_k, acc_v = _unpack(dkv[step % 2], k, v)
        for kv_rows, gk, gv in kv_grads:
            acc_k[:, :, kv_rows] += gk
            acc_v[:, :, kv_rows] += gv
        del kv_grads
        cur, spare = spare, cur
    if size > 1:  # last hop: pass the finished accumulator on, receive this rank's own from the previous rank
        finished, own = dkv[(size - 1) % 2], dkv[size % 2]
        wait_all(links.exchange([finished], [own], KV_TAG))
        _count_backward(spec, finished)
        dk, dv = _unpack(own, k, v)
    if dq is None:
        dq = torch.zeros_like(q, dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _count_backward(spec: _RingSpec, buf: torch.Tensor) -> None:
    if spec.stats is not None:
        spec.stats.backward_bytes_sent += buf.numel() * buf.element_size()


class LseAttentionFunction(torch.autograd.Function):
    """Autograd for an exact CP attention given as (forward -> out, lse, auxes; backward from out and lse): the ring
    here, the all-gather in cp_allgather.py. Saves q, k, v, the output and its log-sum-exp; recomputes nothing."""

    @staticmethod
    def forward(ctx, q, k, v, spec: _RingSpec, forward_fn, backward_fn):
        out, lse, auxes = forward_fn(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.auxes, ctx.backward_fn = spec, auxes, backward_fn
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse, ctx.auxes, ctx.spec)
        return dq, dk, dv, None, None, None


def _check_inputs(q, k, v, document_ids):
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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                   scale: float | None = None, load_balancer: str = "zigzag", document_ids: torch.Tensor | None = None,
                   stats: CommStats | None = None, _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries against the whole sharded sequence.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0, sharded by `load_balancer`.
    `group`: a ProcessGroup or 1-D DeviceMesh (size 1 is valid). `document_ids` (B, S_local), sharded like the tokens:
    queries see only keys of their own document (combined with causality when `is_causal`).
    """
    pg = resolve_group(group)
    check_load_balancer(load_balancer)
    _check_inputs(q, k, v, document_ids)
    size = dist.get_world_size(pg)
    check_sequence_length(q.size(2) * size, size, load_balancer)
    docs = _documents
    if docs is None and document_ids is not None:
        docs = gather_document_shards(document_ids, pg)
    spec = _RingSpec(pg, is_causal, scale, load_balancer, docs, stats)
    return LseAttentionFunction.apply(q, k, v, spec, ring_forward, ring_backward)
