"""Ulysses context parallelism (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head shards.

Each rank starts with all heads of its S/P tokens and, after one all-to-all of Q, K and V together, holds H/P heads of
the whole sequence in global order; plain SDPA runs on them and a second all-to-all brings the output back. Its
bytes per rank do not shrink with P (ring's K/V do), and its degree is capped by the heads, but the attention itself
is one full-length kernel call with no log-sum-exp merges. With documents the attention after the all-to-all is the
ring's at P = 1 (`local_segment_attention`): mask-free pieces per document, never an (S, S) mask. On the
"documents" layout the gathered sequence stays in rank order (`concatenated_order_plan`) and the pieces follow each
token's position (`concatenated_documents`), so the layout is undone by the output's all-to-all back.

GQA: K/V heads are split too. When the degree does not divide the K/V heads, each K/V head is replicated just enough
(to lcm(kv_heads, P) heads) that every rank gets whole groups; its gradients fold back through autograd. The query
heads must be a multiple of that count.

The exchange itself (`ExchangePlan`, the all-to-alls, `replicate_kv`) is in exchange_alltoall.py; it is also the inner
step of hybrid CP (exchange_hybrid.py), where the target order is a ring rank's layout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.checks import check_attention_inputs
from parallelisms.cp.counters import CommStats, UnsupportedAttentionError
from parallelisms.cp.exchange_alltoall import (ExchangePlan, document_segments, exchange_heads_to_seq,
                                               exchange_seq_to_heads, global_order_plan, replicate_kv)
from parallelisms.cp.groups import resolve_group
from parallelisms.cp.kernel_blocks import kernel_family, sdpa_backends
from parallelisms.cp.layouts import DOCUMENTS, ZIGZAG, check_load_balancer, check_sequence_length
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.plan_sharding import unshard_sequence


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                      scale: float | None = None, load_balancer: str = ZIGZAG,
                      document_ids: torch.Tensor | None = None, stats: CommStats | None = None,
                      head_groups: int = 0, kernel: str = "auto", _plan: ExchangePlan | None = None,
                      _documents: DocumentShards | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries (same inputs and layouts as `ring_attention`).

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D), sharded by `load_balancer`. Hq must split over the group
    (see `kv_replication`). `document_ids` (B, S_local), sharded like the tokens, keeps attention inside documents.
    `_plan` / `_documents` let `context_parallel` build the exchange plan and `document_segments` once for all
    layers.
    """
    pg = resolve_group(group)
    check_load_balancer(load_balancer)
    if load_balancer == DOCUMENTS and (_plan is None or _documents is None):
        raise UnsupportedAttentionError("ulysses_attention on the documents layout needs its plan and documents: call "
                                        "it through context_parallel(..., load_balancer='documents', cp_impl='ulysses')")
    size = dist.get_world_size(pg)
    seq_len = q.size(2) * size
    check_sequence_length(seq_len, size, load_balancer)
    check_attention_inputs(q, k, v, document_ids)
    plan = _plan or global_order_plan(pg, seq_len, load_balancer)
    docs = _documents
    if docs is None and document_ids is not None:
        docs = document_segments(unshard_sequence(document_ids, 1, pg, load_balancer))
    k, v = replicate_kv(k, v, q.size(1), size)
    qh, kh, vh = exchange_seq_to_heads(plan, q, k, v, stats=stats)
    if docs is not None:
        out = local_segment_attention(qh, kh, vh, docs, is_causal=is_causal, scale=scale, head_groups=head_groups,
                                      kernel=kernel)
    else:  # one whole-sequence call: torch's SDPA, its backends ordered by the kernel family
        with sdpa_kernel(sdpa_backends(kernel_family(kernel, qh)), set_priority=True):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale,
                                                 enable_gqa=kh.size(1) != qh.size(1))
    if stats is not None:
        stats.calls += 1
    return exchange_heads_to_seq(plan, out, stats=stats)[0]
