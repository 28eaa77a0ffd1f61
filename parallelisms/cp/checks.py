"""The input checks and the group, layout and document-shard set-up every block-merging variant's entry point starts
with (ring, all-gather; Ulysses shares the input check)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallelisms.cp.counters import UnsupportedAttentionError
from parallelisms.cp.groups import resolve_group
from parallelisms.cp.layouts import DOCUMENTS, check_load_balancer, check_sequence_length
from parallelisms.cp.plan_pieces import DocumentShards


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
    if load_balancer == DOCUMENTS and (documents is None or documents.positions is None):
        raise UnsupportedAttentionError("load_balancer='documents' is planned per row from the full document ids: "
                                        "call it through context_parallel(..., load_balancer='documents', "
                                        "document_ids=...)")
    if documents is None and document_ids is not None:
        documents = gather_document_shards(document_ids, pg)
    return pg, documents
