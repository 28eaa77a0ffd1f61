"""CP parity cases for the GPU tier: every variant (ring, all-gather, Ulysses, hybrid) against full-sequence float64
attention, with one body for both ways of running P ranks: threads in one process under the NCCL-rule double
(tests/nccl_rules.py; on one GPU every rank's blocks run on that device) and real processes (NCCL on GPUs, gloo on
CPU). The reference is computed on the CPU in float64 from the same seeded inputs on every rank; each rank compares
its own shard of output, dQ, dK and dV, scaled by the full reference's largest magnitude.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.parallelisms.attention_reference import random_documents, reference_attention

VARIANTS = ("ring", "allgather", "ulysses", "hybrid")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 48, 32


@dataclass(frozen=True)
class CpCase:
    variant: str
    balancer: str
    is_causal: bool
    kv_heads: int
    dtype: str
    documents: bool
    kernel: str = "auto"
    """The kernel family (parallelisms/cp/kernel_blocks.py): auto is cuDNN on Hopper for dense bf16 blocks."""

    def __str__(self) -> str:
        docs = "-docs" if self.documents else ""
        kernel = "" if self.kernel == "auto" else f"-{self.kernel}"
        return (f"{self.variant}-{self.balancer}-{'causal' if self.is_causal else 'full'}-kv{self.kv_heads}-"
                f"{self.dtype}{docs}{kernel}")


def tolerance(device_type: str, dtype: str) -> float:
    """Max |error| / max |reference|: fp32 1e-5 on CPU, 1e-4 on CUDA (other kernels, other summation orders);
    bf16 3e-2 (inputs and outputs rounded to 8 bits of mantissa)."""
    if dtype == "bfloat16":
        return 3e-2
    return 1e-5 if device_type == "cpu" else 1e-4


def cp_cases(size: int, thorough: bool) -> list[CpCase]:
    """Every variant that runs at this degree (hybrid: 2 x 2 at CP=4). `thorough` (the GPU tier): each distinct
    CUDA path of each variant once, in 6 cases: varlen flash (bf16, documents), dense causal and full (bf16: cuDNN on
    Hopper, flash elsewhere), dense causal again on FlashAttention-2 (kernel "flash"),
    the efficient kernel with documents and full (fp32), each layout the variant takes, GQA and plain heads, and for
    Ulysses every K/V head count (K/V replication below the degree). The full product of those options (112 cases at
    CP 2, 160 at CP 4) ran past the GPU tier's per-test limit; the CPU tiers cover the rest of it. Otherwise one
    pass over each variant's distinct paths (GQA, K/V replication for Ulysses, documents with causality, bf16)."""
    cases = []
    for variant in VARIANTS:
        if variant == "hybrid" and size != 4:
            continue
        b0, b1 = ("zigzag", "contiguous") if variant == "hybrid" else ("zigzag", "striped")
        kv = (4, 2, 1) if variant in ("ulysses", "hybrid") else (4, 2)
        fewest, middle, most = kv[-1], kv[len(kv) // 2], kv[0]
        if thorough:
            cases += [CpCase(variant, b0, True, fewest, "bfloat16", True),
                      CpCase(variant, b1, True, middle, "bfloat16", False),
                      CpCase(variant, b0, False, most, "bfloat16", False),
                      CpCase(variant, b1, True, fewest, "float32", True),
                      CpCase(variant, b0, False, middle, "float32", False),
                      CpCase(variant, b1, True, middle, "bfloat16", False, kernel="flash")]  # FA2 where auto is cuDNN
        else:
            cases += [CpCase(variant, b0, True, fewest, "float32", True),
                      CpCase(variant, b1, False, most, "bfloat16", False)]
    return cases


def hybrid_2x2_groups(group) -> tuple:
    """This rank's (Ulysses, ring) groups of hybrid 2 x 2, as the trainer's setup makes them
    (parallelisms/stage_meshes.py): built directly for threads under the NCCL-rule double (its `new_group` serves
    members only), made by every rank for real processes (parallelisms/cp/exchange_hybrid.hybrid_groups)."""
    from tests.nccl_rules import SimGroup
    if isinstance(group, SimGroup):
        members, rank = group.members, group.rank
        return (SimGroup(group.world, group.global_rank, members[rank // 2 * 2:rank // 2 * 2 + 2]),
                SimGroup(group.world, group.global_rank, members[rank % 2::2]))
    from parallelisms.cp.exchange_hybrid import hybrid_groups
    return hybrid_groups(group, 2)


def attention_for(variant: str, group):
    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.exchange_hybrid import hybrid_attention
    from parallelisms.cp.exchange_ulysses import ulysses_attention
    if variant == "hybrid":
        groups = hybrid_2x2_groups(group)
        return lambda *args, **kwargs: hybrid_attention(*args, ulysses_degree=2, _groups=groups, **kwargs)
    return {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}[variant]


def _inputs(case: CpCase, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(BATCH, case.kv_heads, SEQ, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen).to(dtype)
    docs = random_documents(BATCH, SEQ, max_len=SEQ // 4, generator=gen) if case.documents else None
    return q, k, v, grad_out, docs


def run_cp_case(group, device: torch.device, case: CpCase, seed: int = 0) -> list[float]:
    """This rank's max relative errors of (out, dq, dk, dv) for `case` on `group`, computed on `device`."""
    from parallelisms.cp.plan_sharding import shard_sequence

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, grad_out, docs = _inputs(case, seed)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, case.is_causal, docs)
    expected.backward(grad_out.double())

    def shard(x, dim=2):
        return shard_sequence(x, dim, rank, size, case.balancer)

    local = [shard(t).to(device).contiguous().requires_grad_() for t in (q, k, v)]
    out = attention_for(case.variant, group)(*local, group, is_causal=case.is_causal, load_balancer=case.balancer,
                                      document_ids=None if docs is None else shard(docs, 1).to(device),
                                      kernel=case.kernel)
    out.backward(shard(grad_out).to(device))
    assert out.dtype == q.dtype and out.device.type == device.type
    errors = []
    for got, want in zip([out, *(t.grad for t in local)], [expected, *(t.grad for t in full)]):
        diff = (got.detach().cpu().double() - shard(want.detach())).abs().max()
        errors.append((diff / want.detach().abs().max()).item())
    return errors


def failures(case_errors: list[tuple[CpCase, list[float]]], device_type: str) -> list[str]:
    """Lines naming every case whose error exceeds its tolerance (NaN included)."""
    names = ("out", "dq", "dk", "dv")
    bad = []
    for case, errors in case_errors:
        limit = tolerance(device_type, case.dtype)
        over = {n: f"{e:.2e}" for n, e in zip(names, errors) if not e <= limit}
        if over:
            bad.append(f"{case}: {over} > {limit:g}")
    return bad
