"""All-gather context parallelism (Llama 3's CP): one all-gather of K/V, then local queries against the whole sequence.

Same layouts, block plan and document masking as the ring (ring_plan.py), but the K/V of every rank arrive in one
collective instead of P-1 hops. The local (diagonal) block is computed while the gather is in flight. Blocks that
share their query rows and need no causal mask are concatenated along the keys and computed in ONE kernel call
(zigzag: at most three calls per rank whatever P is), so the kernels see long, efficient blocks. Backward gathers
K/V again (nothing P-sized is kept between forward and backward) and returns each block's dK/dV to its owner with a
reduce-scatter in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.attention_blocks import choose_block_kernel
from parallelisms.comm import all_gather_single, reduce_scatter_single
from parallelisms.ring_attention import (CommStats, LseAttentionFunction, _accumulate, _block_forward, _check_inputs,
                                         _covers_all, _merge, _pack, _RingSpec, _unpack, gather_document_shards)
from parallelisms.ring_plan import FULL, BlockTask, DocumentShards, MaskedTask
from parallelisms.sequence_sharding import check_load_balancer, check_sequence_length, resolve_group


def _length(rows: slice, local_len: int) -> int:
    return len(range(*rows.indices(local_len)))


@dataclass
class FusedJob:
    """One kernel call: the query rows of `job` against the concatenated K/V rows of every member block."""
    job: MaskedTask
    members: list[tuple[int, slice]]  # (source rank, K/V rows of its block)

    def kv(self, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        ks = [blocks[src][0][:, :, rows] for src, rows in self.members]
        vs = [blocks[src][1][:, :, rows] for src, rows in self.members]
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    def scatter_grads(self, dkv: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, k, v) -> None:
        """Adds the concatenated block's dK/dV into the float32 (P, K+V) accumulator at each member's rows."""
        offset = 0
        for src, rows in self.members:
            n = _length(rows, k.size(2))
            acc_k, acc_v = _unpack(dkv[src], k, v)
            acc_k[:, :, rows] += gk[:, :, offset:offset + n]
            acc_v[:, :, rows] += gv[:, :, offset:offset + n]
            offset += n


def _fuse(members: list[tuple[int, MaskedTask]], local_len: int, dtype) -> FusedJob:
    """Concatenates non-causal jobs with the same query rows; masks are joined (zeros where a member has none)."""
    first = members[0][1]
    if len(members) == 1:
        task = BlockTask(first.task.q_rows, FULL, first.task.is_causal)
        return FusedJob(MaskedTask(task, first.is_causal, first.mask, first.empty_rows),
                        [(members[0][0], first.task.kv_rows)])
    n_q = _length(first.task.q_rows, local_len)
    masks = [m.mask for _, m in members]
    mask = None
    if any(m is not None for m in masks):
        ref = next(m for m in masks if m is not None)
        mask = torch.cat([m if m is not None else ref.new_zeros(ref.size(0), 1, n_q, _length(j.task.kv_rows, local_len))
                          for m, (_, j) in zip(masks, members)], dim=-1)
    empty = None
    if all(m.empty_rows is not None for _, m in members):
        empty = members[0][1].empty_rows
        for _, m in members[1:]:
            empty = empty & m.empty_rows
    task = BlockTask(first.task.q_rows, FULL, False)
    return FusedJob(MaskedTask(task, False, mask, empty), [(src, m.task.kv_rows) for src, m in members])


def plan_jobs(spec: _RingSpec, rank: int, size: int, local_len: int, dtype, sources) -> list[FusedJob]:
    """Every block this rank computes against `sources`, non-causal ones fused by query rows (deterministic order)."""
    causal, by_rows = [], {}
    for src in sources:
        for job in spec.tasks(rank, src, size, local_len, dtype):
            if job.is_causal:
                causal.append(_fuse([(src, job)], local_len, dtype))
            else:
                rows = job.task.q_rows.indices(local_len)
                by_rows.setdefault(rows, []).append((src, job))
    return causal + [_fuse(members, local_len, dtype) for members in by_rows.values()]


def _start_gather(k, v, spec: _RingSpec, size: int, count_as_backward: bool):
    packed = _pack(k, v)
    if size == 1:
        return packed.view(1, -1), None
    gathered = packed.new_empty(size, packed.numel())
    work = all_gather_single(gathered.view(-1), packed, group=spec.group, async_op=True)
    if spec.stats is not None:
        sent = (size - 1) * packed.numel() * packed.element_size()
        if count_as_backward:
            spec.stats.backward_bytes_sent += sent
        else:
            spec.stats.kv_bytes_sent += sent
    return gathered, work


def _phases(rank: int, size: int):
    """The local block first (it needs nothing from the gather), then every other rank's."""
    return ((rank,), tuple(src for src in range(size) if src != rank))


def allgather_forward(q, k, v, spec: _RingSpec):
    group = spec.group
    size, rank, local_len = dist.get_world_size(group), dist.get_rank(group), q.size(2)
    gathered, work = _start_gather(k, v, spec, size, count_as_backward=False)
    blocks = {rank: (k, v)}
    acc_out = acc_lse = None
    auxes = []
    for phase, sources in enumerate(_phases(rank, size)):
        if phase == 1 and work is not None:
            work.wait()
            blocks.update({src: _unpack(gathered[src], k, v) for src in sources})
        for fused in plan_jobs(spec, rank, size, local_len, q.dtype, sources):
            k_blk, v_blk = fused.kv(blocks)
            out, lse, aux = _block_forward(q, k_blk, v_blk, fused.job, spec.scale)
            auxes.append(aux)
            if acc_out is None and _covers_all(fused.job):  # copies: the merge updates them in place
                acc_out, acc_lse = out.to(torch.float32, copy=True), lse.to(torch.float32, copy=True)
                continue
            if acc_out is None:
                acc_out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=torch.float32)
                acc_lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
            _merge(acc_out, acc_lse, out.float(), lse.float(), fused.job.task.q_rows)
    if acc_out is None:  # nothing visible anywhere (document masks on empty rows)
        acc_out = q.new_zeros(q.shape[:-1] + (v.size(-1),), dtype=torch.float32)
        acc_lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    if spec.stats is not None:
        spec.stats.calls += 1
    return acc_out.to(q.dtype), acc_lse, auxes


def allgather_backward(dout, q, k, v, out, lse, auxes, spec: _RingSpec):
    group = spec.group
    size, rank, local_len = dist.get_world_size(group), dist.get_rank(group), q.size(2)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows that saw nothing: exp(s - inf) = 0, not NaN
    gathered, work = _start_gather(k, v, spec, size, count_as_backward=True)
    blocks = {rank: (k, v)}
    dq = None
    dkv = torch.zeros(size, k.numel() + v.numel(), dtype=torch.float32, device=k.device)
    aux_iter = iter(auxes)
    for phase, sources in enumerate(_phases(rank, size)):
        if phase == 1 and work is not None:
            work.wait()
            blocks.update({src: _unpack(gathered[src], k, v) for src in sources})
        for fused in plan_jobs(spec, rank, size, local_len, q.dtype, sources):
            job, rows = fused.job, fused.job.task.q_rows
            k_blk, v_blk = fused.kv(blocks)
            kernel = choose_block_kernel(q, job.mask is not None)
            gq, gk, gv = kernel.backward(dout[:, :, rows], q[:, :, rows], k_blk, v_blk, out[:, :, rows],
                                         lse[:, :, rows], next(aux_iter), is_causal=job.is_causal,
                                         scale=spec.scale, mask=job.mask)
            dq = _accumulate(dq, gq, rows, q)
            fused.scatter_grads(dkv, gk, gv, k, v)
    if size > 1:
        mine = dkv.new_empty(dkv.size(1))
        reduce_scatter_single(mine, dkv.view(-1), group=group)
        if spec.stats is not None:
            spec.stats.backward_bytes_sent += (size - 1) * mine.numel() * mine.element_size()
    else:
        mine = dkv[0]
    dk, dv = _unpack(mine, k, v)
    if dq is None:
        dq = torch.zeros_like(q, dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                        scale: float | None = None, load_balancer: str = "zigzag",
                        document_ids: torch.Tensor | None = None, stats: CommStats | None = None,
                        _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries; same arguments, layouts and results as `ring_attention`."""
    pg = resolve_group(group)
    check_load_balancer(load_balancer)
    _check_inputs(q, k, v, document_ids)
    size = dist.get_world_size(pg)
    check_sequence_length(q.size(2) * size, size, load_balancer)
    docs = _documents
    if docs is None and document_ids is not None:
        docs = gather_document_shards(document_ids, pg)
    spec = _RingSpec(pg, is_causal, scale, load_balancer, docs, stats)
    return LseAttentionFunction.apply(q, k, v, spec, allgather_forward, allgather_backward)
