"""Hybrid context parallelism (USP): Ulysses inside groups of `ulysses_degree` consecutive CP ranks, ring across them.

A CP group of P = U x R ranks is seen as R ring ranks of U Ulysses ranks each (consecutive ranks share a node, so
the all-to-all stays on the fast in-node links and only K/V cross nodes). No new layout is needed: with zigzag over
P, the U consecutive ranks rho*U .. rho*U+U-1 hold exactly the chunks that zigzag over R gives ring rank rho (their
head chunks form its head, their tail chunks its tail); the same holds for contiguous. So the buffers are sharded as
for every other variant, the all-to-all places the group's tokens in ring rank rho's local order, and the ring runs
unchanged over R ranks with U-times fewer heads. Striped does not decompose this way and is refused. The
"documents" layout needs no decomposition: the all-to-all keeps the group's tokens in member order and the sparse
ring (exchange_ring_sparse.py) runs over the R ring ranks on their ids and positions (`documents_ring_shards`).

The sub-groups are made at setup, by every world rank, with the run's mesh (parallelisms/stage_meshes.py) and passed
in (`_groups`): on NCCL with a bound device, creating a group splits the world communicator, which every world rank
must join, so a group made inside a step can hang (a pipeline stage blocked in a receive never joins). Called
without them (tests, scripts whose CP group is the whole world), `hybrid_groups` makes them once per process, every
rank creating every subgroup in the same order.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parallelisms.cp.attention import ring_attention
from parallelisms.cp.counters import CommStats, UnsupportedAttentionError
from parallelisms.cp.exchange_alltoall import ExchangePlan, exchange_heads_to_seq, exchange_seq_to_heads, replicate_kv
from parallelisms.cp.groups import resolve_group
from parallelisms.cp.layouts import DOCUMENTS, STRIPED, ZIGZAG, check_load_balancer, check_sequence_length
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.plan_sharding import local_positions, unshard_sequence

# Communicators derived from a CP group, per Ulysses degree: created once per process (creation is a rendezvous).
_SUBGROUP_CACHE: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


def check_hybrid(cp_size: int, ulysses_degree: int, load_balancer: str) -> None:
    if ulysses_degree < 1 or cp_size % ulysses_degree:
        divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
        raise UnsupportedAttentionError(f"hybrid CP: ulysses_degree {ulysses_degree} must divide the CP degree "
                                        f"{cp_size}; use one of {divisors}")
    if load_balancer == STRIPED and 1 < ulysses_degree < cp_size:
        raise UnsupportedAttentionError("hybrid CP with the striped layout does not split into Ulysses x ring "
                                        "groups; use parallelism.cp_load_balancer = \"zigzag\" (or contiguous)")


def hybrid_groups(group: dist.ProcessGroup, ulysses_degree: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's Ulysses group of U consecutive CP ranks, its ring group of the R ranks with the same offset), for
    a CP group that is the whole world; the trainer's come from its mesh instead (stage_meshes.hybrid_subgroups)."""
    per_degree = _SUBGROUP_CACHE.setdefault(group, {})
    if ulysses_degree not in per_degree:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != dist.get_world_size():
            raise RuntimeError(f"hybrid CP over {size} of {dist.get_world_size()} ranks: its subgroups must be made "
                               "at setup by every rank (parallelisms/stage_meshes.add_hybrid_subgroups) and passed in")
        members = [dist.get_global_rank(group, i) for i in range(size)]
        ring_index, offset = divmod(rank, ulysses_degree)
        # every rank creates every subgroup, in the same order (a world-wide split on NCCL with a bound device)
        ulysses = [dist.new_group(members[i:i + ulysses_degree]) for i in range(0, size, ulysses_degree)]
        rings = [dist.new_group(members[o::ulysses_degree]) for o in range(ulysses_degree)]
        per_degree[ulysses_degree] = (ulysses[ring_index], rings[offset])
    return per_degree[ulysses_degree]


def hybrid_plan(ulysses_group: dist.ProcessGroup, seq_len: int, cp_rank: int, cp_size: int, ulysses_degree: int,
                load_balancer: str) -> ExchangePlan:
    """The Ulysses exchange that lays the group's tokens out as ring rank rho's local sequence."""
    ring_rank = cp_rank // ulysses_degree
    with unset_fake_temporarily():  # host integers, so real tensors even inside the dry run's fake mode
        members = [local_positions(seq_len, ring_rank * ulysses_degree + u, cp_size, load_balancer)
                   for u in range(ulysses_degree)]
        target = local_positions(seq_len, ring_rank, cp_size // ulysses_degree, load_balancer)
        return ExchangePlan.build(ulysses_group, members, target)


def ring_documents(full_ids: torch.Tensor, cp_size: int, ulysses_degree: int, load_balancer: str) -> DocumentShards:
    """Document ids of every ring rank in its local order (what the inner ring cuts its pieces from)."""
    return DocumentShards.from_full(full_ids, cp_size // ulysses_degree, load_balancer)


def documents_ring_shards(documents: DocumentShards, ulysses_degree: int) -> DocumentShards:
    """On the documents layout, ring rank rho attends over its U members' tokens concatenated in member order
    (exchange_alltoall.concatenated_order_plan): their ids and positions, the sparse ring's plan over the R ring
    ranks."""
    size = len(documents.per_rank)
    ids = [torch.cat(documents.per_rank[rho:rho + ulysses_degree], dim=1) for rho in range(0, size, ulysses_degree)]
    positions = torch.stack([torch.cat(list(documents.positions[rho:rho + ulysses_degree]), dim=1)
                             for rho in range(0, size, ulysses_degree)])
    return DocumentShards(ids, positions)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, ulysses_degree: int,
                     is_causal: bool = True, scale: float | None = None, load_balancer: str = ZIGZAG,
                     document_ids: torch.Tensor | None = None, stats: CommStats | None = None,
                     head_groups: int = 0, kernel: str = "auto", _plan: ExchangePlan | None = None,
                     _documents: DocumentShards | None = None,
                     _groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries (same inputs and layouts as `ring_attention`), Ulysses over
    `ulysses_degree` consecutive CP ranks and the ring over the rest. Hq must split over `ulysses_degree`.
    `_groups`: the (Ulysses, ring) groups made at setup; None: `hybrid_groups` (a CP group that is the world)."""
    pg = resolve_group(group)
    check_load_balancer(load_balancer)
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    seq_len = q.size(2) * size
    check_sequence_length(seq_len, size, load_balancer)
    check_hybrid(size, ulysses_degree, load_balancer)
    if load_balancer == DOCUMENTS and (_plan is None or _documents is None):
        raise UnsupportedAttentionError("hybrid_attention on the documents layout needs its plan and documents: call "
                                        "it through context_parallel(..., load_balancer='documents', cp_impl='hybrid')")
    ulysses_pg, ring_pg = _groups or hybrid_groups(pg, ulysses_degree)
    plan = _plan or hybrid_plan(ulysses_pg, seq_len, rank, size, ulysses_degree, load_balancer)
    docs = _documents
    if docs is None and document_ids is not None:
        docs = ring_documents(unshard_sequence(document_ids, 1, pg, load_balancer), size, ulysses_degree,
                              load_balancer)
    k, v = replicate_kv(k, v, q.size(1), ulysses_degree)
    qh, kh, vh = exchange_seq_to_heads(plan, q, k, v, stats=stats)
    out = ring_attention(qh, kh, vh, ring_pg, is_causal=is_causal, scale=scale, load_balancer=load_balancer,
                         stats=stats, head_groups=head_groups, kernel=kernel, _documents=docs)
    return exchange_heads_to_seq(plan, out, stats=stats)[0]
