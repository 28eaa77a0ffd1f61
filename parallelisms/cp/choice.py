"""Which context-parallel attention to run (`parallelism.cp_impl`), and the router `context_parallel` sends SDPA to.

Variants (all exact, same layouts and results; see each module):
- ring       exchange_ring.py       K/V hop around the ring, overlapped with compute; P-1 latency-bound steps.
- allgather  exchange_allgather.py  one all-gather of K/V, fused block kernels, dK/dV reduce-scattered (Llama 3).
- ulysses    exchange_ulysses.py    all-to-all sequence <-> heads, one full-length kernel; degree capped by the heads.
- hybrid     exchange_hybrid.py     Ulysses inside a node, ring across nodes (USP).
(the DOCUMENTS layout: exchange_ring_sparse.py, exchange_allgather_sparse.py; `ROUTES` below is the one table.)
- auto       `choose_cp_impl` below, resolved at the first attention call (when the heads are known) and
             printed once by global rank 0.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config import RecipeError, Refusal, choices
from config.schema import CpImpl
from parallelisms.cp.attention import allgather_attention, ring_attention
from parallelisms.cp.counters import CommStats
from parallelisms.cp.exchange_alltoall import (concatenated_documents, concatenated_order_plan, document_segments,
                                               global_order_plan, kv_replication, ulysses_feasible)
from parallelisms.cp.exchange_hybrid import (check_hybrid, documents_ring_shards, hybrid_attention, hybrid_groups,
                                             hybrid_plan, ring_documents)
from parallelisms.cp.exchange_ulysses import ulysses_attention
from parallelisms.cp.layouts import (ALLGATHER, AUTO, CONTIGUOUS, DENSE, DOCUMENTS, HYBRID, RING, STRIPED, ULYSSES,
                                     layout_kind)
from parallelisms.cp.plan_pieces import DocumentShards

CP_IMPLS = choices(CpImpl)
# Ulysses must send less than this fraction of the ring's bytes to win: it also copies Q, K, V, O and their gradients
# in and out of its all-to-all buffers, which the ring never does. Fitted on this box (docs/cp_variants.md): at 0.5
# the two tie, at 0.3 Ulysses is 9-20% faster, at 0.9 it is level or slower.
ULYSSES_MAX_BYTE_RATIO = 0.5


def check_cp_impl(cp_impl: str) -> None:
    if cp_impl not in CP_IMPLS:
        raise RecipeError(f"parallelism.cp_impl: unknown context-parallel implementation {cp_impl!r}; "
                          f"use one of {', '.join(CP_IMPLS)}")


@dataclass(frozen=True)
class Topology:
    """Where the CP ranks live: how many nodes the group spans and how many of its ranks share each node."""
    cp_size: int
    nodes: int
    ranks_per_node: int
    device_type: str

    @classmethod
    def of(cls, group: dist.ProcessGroup, device_type: str) -> "Topology":
        """Node of a rank = global rank // LOCAL_WORLD_SIZE (torchrun numbers ranks node by node)."""
        size = dist.get_world_size(group)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        nodes = {dist.get_global_rank(group, i) // max(per_node, 1) for i in range(size)}
        return cls(size, len(nodes), size // len(nodes), device_type)


@dataclass(frozen=True)
class CPChoice:
    impl: str
    ulysses_degree: int | None
    reason: str


def hybrid_degree(topology: Topology, q_heads: int, kv_heads: int) -> int:
    """Largest Ulysses degree that divides the CP degree, fits in one node and splits the heads (1 = pure ring)."""
    fits = [d for d in range(topology.cp_size, 0, -1) if topology.cp_size % d == 0
            and topology.ranks_per_node % d == 0 and ulysses_feasible(q_heads, kv_heads, d)]
    proper = [d for d in fits if d < topology.cp_size]
    return (proper or fits or [1])[0]


def bytes_sent_per_call(impl: str, cp_size: int, q_heads: int, kv_heads: int, element_size: int) -> float:
    """Bytes one rank sends in one attention fwd+bwd, per local token and per head-dim element (CommStats counts
    exactly this; tests check it). ring: P-1 K/V hops forward, P-1 K/V hops and P float32 dK/dV hops backward.
    ulysses: (P-1)/P of Q, K, V (K/V heads replicated to lcm(kv_heads, P)) and of the output, forward and backward."""
    if impl == RING:
        return 2 * (cp_size - 1) * 2 * kv_heads * element_size + cp_size * 2 * kv_heads * 4
    if impl == ULYSSES:
        return 2 * (cp_size - 1) / cp_size * (2 * q_heads + 2 * math.lcm(kv_heads, cp_size)) * element_size
    raise Refusal(f"no byte model for {impl!r}")


@functools.lru_cache(maxsize=None)
def choose_cp_impl(topology: Topology, q_heads: int, kv_heads: int, load_balancer: str, has_documents: bool,
                   element_size: int = 4) -> CPChoice:
    """The `auto` rule; the measurements behind it are in docs/cp_variants.md.

    1. cp = 1: ring (no communication at all).
    2. CP spanning nodes: hybrid, Ulysses over the in-node ranks (USP), ring across nodes.
    3. One node: Ulysses when the heads split over the ranks, there are no documents (with documents both cut the
       work into the same per-document pieces, so Ulysses loses its one full-length kernel, and the ring skips the
       K/V blocks documents cannot reach; not re-measured since masks became pieces) and it sends less than
       ULYSSES_MAX_BYTE_RATIO of the ring's bytes (it then also runs one full-length kernel per rank, without
       log-sum-exp merges). Otherwise the ring, which overlaps its transfers
       with compute and needs no extra copies. All-gather is never picked: it was never the fastest here.
    """
    p = topology.cp_size
    if p == 1:
        choice = CPChoice(RING, None, "cp = 1: no communication, the ring path is plain attention")
    elif topology.nodes > 1 and topology.ranks_per_node > 1 and load_balancer != STRIPED \
            and hybrid_degree(topology, q_heads, kv_heads) > 1:
        u = hybrid_degree(topology, q_heads, kv_heads)
        choice = CPChoice(HYBRID, u, f"CP spans {topology.nodes} nodes: Ulysses over {u} in-node ranks "
                                       f"(heads {q_heads}/{kv_heads} split), ring over {p // u} node groups")
    else:
        ring = bytes_sent_per_call(RING, p, q_heads, kv_heads, element_size)
        ulysses = bytes_sent_per_call(ULYSSES, p, q_heads, kv_heads, element_size)
        sizes = f"{q_heads} query / {kv_heads} key-value heads over {p} ranks"
        if not ulysses_feasible(q_heads, kv_heads, p):
            choice = CPChoice(RING, None, f"{sizes}: the heads do not split for Ulysses")
        elif has_documents:
            choice = CPChoice(RING, None, f"{sizes}, document masking: both compute per-document pieces, "
                                            "Ulysses would lose its one full-length kernel")
        elif ulysses < ULYSSES_MAX_BYTE_RATIO * ring:
            choice = CPChoice(ULYSSES, None, f"{sizes}: Ulysses sends {ulysses / ring:.2f}x the ring's bytes and "
                                               "runs one full-length kernel per rank")
        else:
            choice = CPChoice(RING, None, f"{sizes}: Ulysses would send {ulysses / ring:.2f}x the ring's bytes "
                                            f"(it wins below {ULYSSES_MAX_BYTE_RATIO}); the ring overlaps its K/V "
                                            "transfers with compute")
    return choice


@functools.lru_cache(maxsize=None)  # once per process and distinct decision, not once per step
def announce(choice: CPChoice, asked: str) -> None:
    degree = f" (ulysses_degree {choice.ulysses_degree})" if choice.ulysses_degree else ""
    print(f"context parallel, cp_impl = {asked}: runs {choice.impl}{degree}: {choice.reason}", flush=True)


class CPAttention:
    """Sends one `context_parallel` block's SDPA calls to the chosen variant. Plans and document shards (with their
    pieces) are built at the first call and reused by every layer; `auto` is resolved then too (all ranks see the
    same heads)."""

    def __init__(self, cp_impl: str, group: dist.ProcessGroup, load_balancer: str,
                 full_document_ids: torch.Tensor | None, documents: DocumentShards | None,
                 stats: CommStats | None, ulysses_degree: int | None = None, subgroups: dict | None = None,
                 head_groups: int = 0, kernel: str = "auto"):
        check_cp_impl(cp_impl)
        self.kernel = kernel  # the block kernels' family (cp/kernel_blocks.py), passed to every variant
        self.head_groups = head_groups  # K/V head groups per call (cp/autograd.py; 0 = by size)
        self.subgroups = subgroups
        """{Ulysses degree: (Ulysses group, ring group)} made at setup; None: made on first use (world-sized CP only)."""
        self.cp_impl, self.group, self.load_balancer = cp_impl, group, load_balancer
        self.full_document_ids, self.documents, self.stats = full_document_ids, documents, stats
        self.ulysses_degree = ulysses_degree
        self.choice: CPChoice | None = None
        self._cache: dict = {}

    def resolve(self, q: torch.Tensor, k: torch.Tensor) -> CPChoice:
        if self.choice is None:
            topology = Topology.of(self.group, q.device.type)
            if self.cp_impl == AUTO:
                self.choice = choose_cp_impl(topology, q.size(1), k.size(1), self.load_balancer,
                                             self.full_document_ids is not None, q.element_size())
                if dist.get_rank() == 0:
                    announce(self.choice, AUTO)
            elif self.cp_impl == HYBRID:
                degree = self.ulysses_degree or hybrid_degree(topology, q.size(1), k.size(1))
                check_hybrid(topology.cp_size, degree, self.load_balancer)
                self.choice = CPChoice(HYBRID, degree, "the degree " + (
                    "asked for" if self.ulysses_degree else f"is the largest that fits {topology.ranks_per_node} "
                    f"in-node ranks and splits {q.size(1)}/{k.size(1)} heads"))
                if dist.get_rank() == 0:
                    announce(self.choice, HYBRID)
            else:
                self.choice = CPChoice(self.cp_impl, None, "asked for")
        return self.choice

    def hybrid_groups(self, degree: int):
        if self.subgroups is None:
            return hybrid_groups(self.group, degree)
        if degree not in self.subgroups:
            raise RuntimeError(f"hybrid CP runs Ulysses degree {degree}, but setup made subgroups for "
                               f"{sorted(self.subgroups) or 'none'}: groups are made at setup only "
                               "(parallelisms/stage_meshes.py); the setup's degree must match the attention's")
        return self.subgroups[degree]

    def head_exchange(self, q) -> HeadExchange:
        """Ulysses' or hybrid's exchange for this batch (the eager routes and the registered op's bodies share it)."""
        return (_hybrid_exchange if self.choice.impl == HYBRID else _ulysses_exchange)(self, q)

    def cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def __call__(self, q, k, v, *, is_causal: bool, scale: float | None) -> torch.Tensor:
        choice = self.resolve(q, k)
        common = dict(is_causal=is_causal, scale=scale, load_balancer=self.load_balancer, stats=self.stats,
                      head_groups=self.head_groups, kernel=self.kernel)
        return ROUTES[(choice.impl, layout_kind(self.load_balancer))](self, q, k, v, common)


def _ring(attn: CPAttention, q, k, v, common):
    return ring_attention(q, k, v, attn.group, _documents=attn.documents, **common)


def _allgather(attn: CPAttention, q, k, v, common):
    return allgather_attention(q, k, v, attn.group, _documents=attn.documents, **common)


def _seq_len(attn: CPAttention, q) -> int:
    return q.size(2) * dist.get_world_size(attn.group)


@dataclass(frozen=True)
class HeadExchange:
    """What Ulysses and hybrid run with, planned once per batch: the all-to-all `plan`, the ring group after it
    (None: Ulysses, one rank), that ring's layout and documents, and the Ulysses degree."""
    plan: object
    degree: int
    ring_group: dist.ProcessGroup | None
    load_balancer: str
    docs: DocumentShards | None

    def kv_repeats(self, q_heads: int, kv_heads: int) -> int:
        return kv_replication(q_heads, kv_heads, self.degree)


def _ulysses_exchange(attn: CPAttention, q) -> HeadExchange:
    seq_len, size = _seq_len(attn, q), dist.get_world_size(attn.group)
    if attn.load_balancer == DOCUMENTS:
        plan = attn.cached(("plan", seq_len), lambda: concatenated_order_plan(attn.group, seq_len))
        segments = attn.cached("segments", lambda: concatenated_documents(attn.documents))
        return HeadExchange(plan, size, None, DOCUMENTS, segments)
    plan = attn.cached(("plan", seq_len), lambda: global_order_plan(attn.group, seq_len, attn.load_balancer))
    segments = None
    if attn.full_document_ids is not None:
        segments = attn.cached("segments", lambda: document_segments(attn.full_document_ids))
    return HeadExchange(plan, size, None, CONTIGUOUS, segments)


def _hybrid_exchange(attn: CPAttention, q) -> HeadExchange:
    degree = attn.choice.ulysses_degree
    groups = attn.hybrid_groups(degree)
    rank, size = dist.get_rank(attn.group), dist.get_world_size(attn.group)
    if attn.load_balancer == DOCUMENTS:
        plan = attn.cached(("plan", _seq_len(attn, q)),
                           lambda: concatenated_order_plan(groups[0], q.size(2) * degree))
        docs = attn.cached("docs", lambda: documents_ring_shards(attn.documents, degree))
        return HeadExchange(plan, degree, groups[1], DOCUMENTS, docs)
    plan = attn.cached(("plan", _seq_len(attn, q)), lambda: hybrid_plan(groups[0], _seq_len(attn, q), rank, size,
                                                                         degree, attn.load_balancer))
    docs = None
    if attn.full_document_ids is not None:
        docs = attn.cached("docs", lambda: ring_documents(attn.full_document_ids, size, degree, attn.load_balancer))
    return HeadExchange(plan, degree, groups[1], attn.load_balancer, docs)


def _ulysses(attn: CPAttention, q, k, v, common):
    ex = attn.head_exchange(q)
    return ulysses_attention(q, k, v, attn.group, _plan=ex.plan, _documents=ex.docs, **common)


def _hybrid(attn: CPAttention, q, k, v, common):
    ex = attn.head_exchange(q)
    return hybrid_attention(q, k, v, attn.group, ulysses_degree=ex.degree, _plan=ex.plan, _documents=ex.docs,
                            _groups=attn.hybrid_groups(ex.degree), **common)


# The one dispatch table: (implementation, layout kind) -> the call that plans (once per batch, cached on the
# CPAttention) and runs it. Ring and all-gather pick their dense or sparse exchange from attention.BLOCK_EXCHANGES.
ROUTES = {
    (RING, DENSE): _ring, (RING, DOCUMENTS): _ring,
    (ALLGATHER, DENSE): _allgather, (ALLGATHER, DOCUMENTS): _allgather,
    (ULYSSES, DENSE): _ulysses, (ULYSSES, DOCUMENTS): _ulysses,
    (HYBRID, DENSE): _hybrid, (HYBRID, DOCUMENTS): _hybrid,
}
