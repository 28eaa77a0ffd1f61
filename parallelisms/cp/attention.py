"""The block-merging CP attentions' entry points: `ring_attention` (CONTRACT, re-exported by
parallelisms/context_parallel.py), `allgather_attention` and `local_segment_attention` (the ring's pieces at P = 1,
what Ulysses runs after its all-to-all). Each is one autograd call of the (forward, backward) pair that
`BLOCK_EXCHANGES` holds for its (implementation, layout kind): the dense exchanges move whole K/V blocks, the sparse
ones of the DOCUMENTS layout only the rows each rank can see.
"""
from __future__ import annotations

import torch

from parallelisms.cp.autograd import LseAttentionFunction
from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.checks import prepare_call
from parallelisms.cp.counters import CommStats
from parallelisms.cp.exchange_allgather import allgather_backward, allgather_forward
from parallelisms.cp.exchange_allgather_sparse import sparse_allgather_backward, sparse_allgather_forward
from parallelisms.cp.exchange_ring import ring_backward, ring_forward
from parallelisms.cp.exchange_ring_sparse import sparse_backward, sparse_forward
from parallelisms.cp.kernel_blocks import kernel_family
from parallelisms.cp.kernel_cudnn_thd import packed_kernel
from parallelisms.cp.layouts import (ALLGATHER, CONTIGUOUS, DENSE, DOCUMENTS, RING, ZIGZAG, layout_kind)
from parallelisms.cp.plan_pieces import DocumentShards

BLOCK_EXCHANGES = {
    (RING, DENSE): (ring_forward, ring_backward),  # K/V blocks hop around the ring (exchange_ring.py)
    (RING, DOCUMENTS): (sparse_forward, sparse_backward),  # shifts of the visible rows (exchange_ring_sparse.py)
    (ALLGATHER, DENSE): (allgather_forward, allgather_backward),  # one all-gather (exchange_allgather.py)
    (ALLGATHER, DOCUMENTS): (sparse_allgather_forward, sparse_allgather_backward),  # one all-to-all of visible rows
}


def _block_attention(impl: str, q, k, v, group, is_causal, scale, load_balancer, document_ids, stats, documents,
                     head_groups, kernel):
    pg, docs = prepare_call(q, k, v, group, load_balancer, document_ids, documents)
    spec = BlockSpec(pg, is_causal, scale, load_balancer, docs, stats, head_groups, kernel_family(kernel, q),
                     packed_kernel(kernel, q))
    return LseAttentionFunction.apply(q, k, v, spec, *BLOCK_EXCHANGES[(impl, layout_kind(load_balancer))])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                   scale: float | None = None, load_balancer: str = ZIGZAG, document_ids: torch.Tensor | None = None,
                   stats: CommStats | None = None, head_groups: int = 0, kernel: str = "auto",
                   _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries against the whole sharded sequence.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0, sharded by `load_balancer`.
    `group`: a ProcessGroup or 1-D DeviceMesh (size 1 is valid). `document_ids` (B, S_local), sharded like the tokens:
    queries see only keys of their own document (combined with causality when `is_causal`). `head_groups`: K/V head
    groups computed one after another to bound the transient memory (0 = by size, cp/autograd.py; same result).
    `kernel`: the block kernels' family, "auto" (cuDNN on CUDA SM 9.0+, flash elsewhere) | "cudnn" | "flash" |
    "fa3" | "fa4" (cp/kernel_blocks.py; FA3/FA4 once activated); the same result up to the kernels' rounding.
    """
    return _block_attention(RING, q, k, v, group, is_causal, scale, load_balancer, document_ids, stats, _documents,
                            head_groups, kernel)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                        scale: float | None = None, load_balancer: str = ZIGZAG,
                        document_ids: torch.Tensor | None = None, stats: CommStats | None = None,
                        head_groups: int = 0, kernel: str = "auto",
                        _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries; same arguments, layouts and results as `ring_attention`."""
    return _block_attention(ALLGATHER, q, k, v, group, is_causal, scale, load_balancer, document_ids, stats,
                            _documents, head_groups, kernel)


def local_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentShards | None, *,
                            is_causal: bool = True, scale: float | None = None, head_groups: int = 0,
                            kernel: str = "auto") -> torch.Tensor:
    """Exact attention over one whole sequence held by this rank (q (B, Hq, S, D), k/v (B, Hkv, S, D), positions in
    order), with `documents` of that sequence (one shard): the ring's pieces at P = 1 without a process group. Ulysses
    runs this after its all-to-all, so documents never need an (S, S) mask there either. `documents` with positions
    (the documents layout, in any order) are cut by position segments instead."""
    layout = DOCUMENTS if documents is not None and documents.positions is not None else CONTIGUOUS
    spec = BlockSpec(None, is_causal, scale, layout, documents, None, head_groups, kernel_family(kernel, q),
                     packed_kernel(kernel, q))
    return LseAttentionFunction.apply(q, k, v, spec, ring_forward, ring_backward)
