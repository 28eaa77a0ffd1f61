"""What a GPU would see of one layer's CP attention: its kernel calls, aten ops, host syncs and transient memory,
counted on fake CUDA tensors (FakeTensorMode makes `cuda` tensors on a CPU-only build; shapes, strides and the CUDA
kernels' meta functions run, no storage is allocated).

One rank of a fake process group of the CP degree (training/planning/fake/world.py) runs the variant's own forward
and backward functions (the sparse ring on the documents layout, or Ulysses' attention after its all-to-all) on its
real plan, made from real document ids, under the dispatch counter (training/planning/fake/counter.py): attention
kernel calls and aten ops of one layer's forward + backward on the busiest rank, and its host syncs (the plan is
cached per batch: once per micro-step, not once per layer). The layer's transient peak (inputs excluded) is read with
torch's MemTracker (its whole-rank peak only: eval_memory.PeakMemTracker), for the current path (GQA unexpanded) and
for the earlier one (K/V expanded). The row's documents are the caller's (training/planning/cuda_path_table.py);
`web_like_row` is the benches' and tests' stated mix.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from parallelisms.cp.autograd import grouped_backward, grouped_forward
from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.exchange_ring import ring_backward, ring_forward
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.exchange_ring_sparse import sparse_backward, sparse_forward
from parallelisms.cp.layouts import DOCUMENTS
from training.planning.eval_memory import PeakMemTracker, tracked_bytes
from models.tile_loops import SampledTiles
from training.planning.fake.counter import DispatchCounter
from training.planning.fake.world import fake_process_group

aten = torch.ops.aten


def web_like_row(seq_len: int, seed: int = 0) -> np.ndarray:
    """(S,) document ids of one row packed from the web-like mix (the last document cut at the row's end)."""
    rng = np.random.default_rng(seed)
    return packed_row(lambda: np.ceil(rng.lognormal(6.5, 1.0, 256)).astype(int).tolist(), seq_len)


def packed_row(draw, seq_len: int) -> np.ndarray:
    """(S,) ids of documents whose lengths `draw()` returns, 256 at a time, packed into one row (the last one cut
    at the row's end)."""
    lengths = []
    while sum(lengths) < seq_len:
        lengths += draw()
    lengths = np.maximum(np.array(lengths), 1)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), seq_len) + 1]
    lengths[-1] -= lengths.sum() - seq_len
    return np.repeat(np.arange(lengths.size), lengths)


def planned_calls(docs: DocumentShards, rank: int, cp: int) -> int:
    """Attention kernel calls of one layer (forward + backward) of `rank` on CUDA flash, from the plan alone."""
    return sum(2 * len({p.is_causal for p in docs.layout_pieces(rank, src, True)}) for src in range(cp))


@dataclass
class LayerCounts:
    attention_kernel_calls_per_layer: int
    aten_ops_per_layer: int
    host_syncs_per_micro_step: int
    transient_peak_bytes: float
    rank: int
    pieces: int
    """The mask-free pieces of the rank's layer (what the per-piece path would call, forward and again backward)."""
    calls_by_kernel: dict | None = None
    """The attention calls by kernel (flash, cudnn, efficient, cpu_flash)."""


def _qkv(batch, length, heads, kv_heads, head_dim, dtype, device="cuda"):
    """Fake q, k, v as the model hands them over: (B, L, H, D) projections seen as (B, H, L, D)."""
    make = lambda h: torch.empty(batch, length, h, head_dim, dtype=dtype, device=device).transpose(1, 2)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


class ExpandGqa(TorchDispatchMode):
    """The earlier CUDA path's GQA handling, replayed for the memory comparison: K/V expanded to the query heads
    before every flash call (forward and backward, as `repeat_interleave` did) and dK/dV folded back."""

    FORWARD = {aten._scaled_dot_product_flash_attention.default, aten._flash_attention_forward.default}
    BACKWARD = {aten._scaled_dot_product_flash_attention_backward.default: 1,
                aten._flash_attention_backward.default: 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FORWARD or func in self.BACKWARD:
            at = 0 if func in self.FORWARD else 1  # query's position
            q, k, v = args[at:at + 3]
            head_dim = 1 if q.dim() == 4 else -2  # (B, H, L, D) or packed (total, H, D)
            groups = q.size(head_dim) // k.size(head_dim)
            if groups > 1:
                expanded = [x.repeat_interleave(groups, dim=head_dim) for x in (k, v)]
                result = func(*args[:at + 1], *expanded, *args[at + 3:], **kwargs)
                if func in self.BACKWARD:
                    dq, dk, dv = result
                    fold = (lambda g: g.unflatten(head_dim, (k.size(head_dim), groups)).sum(  # noqa: E731
                        dim=head_dim + 1 if head_dim > 0 else head_dim))
                    return dq, fold(dk), fold(dv)
                return result
        return func(*args, **kwargs)


class FlashWorkspace(TorchDispatchMode):
    """The CUDA flash backward's own scratch, which its meta function does not allocate, allocated around each call
    so the memory tracker sees it (sizes as flash-attention 2's mha_bwd / mha_varlen_bwd allocate them, vendored in
    torch): a float32 dQ accumulator of (total_q + 128 x sequences, Hq, D rounded up to 32) rows, float32 softmax_d
    of (Hq, total_q + 128 x sequences), and with GQA dK/dV expanded to the query heads before the kernel sums them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._flash_attention_backward.default:
            q, k = args[1], args[2]  # packed (total, H, D)
            seqs, total_q, total_k = args[6].numel() - 1, q.size(0), k.size(0)
            heads, kv_heads, head_dim = q.size(1), k.size(1), q.size(2)
        elif func is aten._scaled_dot_product_flash_attention_backward.default:
            q, k = args[1], args[2]  # (B, H, L, D)
            seqs, total_q, total_k = q.size(0), q.size(0) * q.size(2), k.size(0) * k.size(2)
            heads, kv_heads, head_dim = q.size(1), k.size(1), q.size(3)
        else:
            return func(*args, **kwargs)
        rows = total_q + 128 * seqs
        scratch = [torch.empty(rows, heads, -(-head_dim // 32) * 32, dtype=torch.float32, device=q.device),
                   torch.empty(heads, rows, dtype=torch.float32, device=q.device)]
        if kv_heads != heads:
            scratch += [torch.empty(total_k, heads, head_dim, dtype=k.dtype, device=k.device) for _ in range(2)]
        result = func(*args, **kwargs)
        del scratch
        return result


def run_layer(fwd, bwd, q, k, v, spec):
    """One layer's attention forward and backward, in the head groups the training step runs (cp/autograd.py)."""
    out, lse, auxes = grouped_forward(fwd, q, k, v, spec)
    grads = grouped_backward(bwd, torch.empty_like(out), q, k, v, out, lse, auxes, spec)
    del out, lse, auxes
    return grads


def measure_layer(docs: DocumentShards, rank: int, impl: str, shape: tuple, dtype=torch.bfloat16,
                  expand_gqa: bool = False, memory: bool = False, counter: DispatchCounter | None = None,
                  head_groups: int = 0, kernel: str = "flash", packed: str = "flash") -> LayerCounts:
    """One layer's attention (forward + backward) of `rank` on fake CUDA tensors. `shape` = (batch, local length,
    query heads, K/V heads, head dim) as this rank's attention sees them (Ulysses: the whole sequence, heads / P).
    `kernel`: the kernel family the stage runs (cp/kernel_blocks.py, "auto" resolved); `packed`: the packed calls'
    kernel (cp/kernel_cudnn_thd.PACKED_KERNELS)."""
    cp, ring = len(docs.per_rank), impl == "ring"
    pieces = sum(len(docs.layout_pieces(rank, src, True)) for src in range(cp))
    # Ulysses / hybrid on documents: the ring's code at P = 1 over the gathered sequence
    counts = layer_counts(shape, dtype, "cuda", max(cp, 1) if ring else 1, rank if ring else 0,
                          lambda group: BlockSpec(group if ring else None, True, None, DOCUMENTS, docs, None,
                                                  head_groups, kernel, packed),
                          (sparse_forward, sparse_backward) if ring else (ring_forward, ring_backward),
                          memory, expand_gqa, counter)
    counts.rank, counts.pieces = rank, pieces
    return counts


def layer_counts(shape: tuple, dtype, device: str, group_size: int, rank: int, spec_for, passes: tuple,
                 memory: bool = True, expand_gqa: bool = False, counter: DispatchCounter | None = None) -> LayerCounts:
    """One layer's attention (`passes` = its forward and backward functions, on the BlockSpec `spec_for(group)`)
    on fake `device` tensors of `shape`, as `rank` of a fake process group of `group_size`: counted, and with
    `memory` its transient peak (inputs excluded) under the modelled flash scratch."""
    batch, length, heads, kv_heads, head_dim = shape
    with fake_process_group(group_size, rank) as group, FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _qkv(batch, length, heads, kv_heads, head_dim, dtype, device)
        spec = spec_for(group)
        tracker = PeakMemTracker() if memory else contextlib.nullcontext()
        counter = counter or DispatchCounter()
        # the modelled scratch sits below the counter: allocated and tracked, not counted as ops
        # head groups in three (models/tile_loops.py), entered before the counter, which weights what it counts
        with tracker, (FlashWorkspace() if memory else contextlib.nullcontext()), SampledTiles(), counter, \
                (ExpandGqa() if expand_gqa else contextlib.nullcontext()):
            run_layer(*passes, q, k, v, spec)
        peak = tracked_bytes(tracker.get_tracker_snapshot("peak"))["Total"] if memory else 0.0
    return LayerCounts(counter.attention, counter.ops, counter.syncs, peak, rank, 0, dict(counter.by_kernel))


def ring_counts(ids: np.ndarray, cp: int, shape: tuple, **kwargs) -> LayerCounts:
    """The sparse ring on the documents layout of one row: the rank with the most planned calls, measured."""
    docs = DocumentShards.from_layout(torch.from_numpy(ids)[None], DocumentLayout.plan(torch.from_numpy(ids)[None],
                                                                                        cp))
    busiest = max(range(cp), key=lambda r: planned_calls(docs, r, cp))
    return measure_layer(docs, busiest, "ring", shape, **kwargs)


def ulysses_counts(ids: np.ndarray, cp: int, shape: tuple, **kwargs) -> LayerCounts:
    """Ulysses on the documents layout: the attention every rank runs after the all-to-all (heads / P, all tokens;
    the same plan on every rank)."""
    row = torch.from_numpy(ids)[None]
    docs = concatenated_documents(DocumentShards.from_layout(row, DocumentLayout.plan(row, cp)))
    return measure_layer(docs, 0, "ulysses", shape, **kwargs)
