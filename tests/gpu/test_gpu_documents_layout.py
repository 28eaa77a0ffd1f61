"""The "documents" CP layout (load_balancer = "documents") on the GPU tier: the sparse ring, the sparse all-gather,
Ulysses and hybrid (Ulysses 2 x ring 2) against every document run alone in float64 (per_document_attention), forward
and backward, as P ranks in threads of one process under the NCCL-rule double (tests/nccl_rules.py): on one GPU every
rank's pieces run on that device with the CUDA kernels. The cpu variant (fast tier) runs a thin pass in float32."""
from __future__ import annotations

import time

import pytest
import torch

from parallelisms.cp.plan_layout import DocumentLayout
from tests.gpu.cp_cases import hybrid_2x2_groups, tolerance
from tests.gpu.devices import FAST_CPU, RANKS_LIMIT_S, require
from tests.nccl_rules import run_ring_ranks
from tests.parallelisms.attention_reference import per_document_attention, random_documents

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _attention(variant: str, group, local, ids: torch.Tensor, layout: DocumentLayout):
    """This rank's output of `variant` on the documents layout, with the plans context_parallel would build."""
    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.exchange_hybrid import documents_ring_shards, hybrid_attention
    from parallelisms.cp.exchange_alltoall import concatenated_documents, concatenated_order_plan
    from parallelisms.cp.exchange_ulysses import ulysses_attention
    from parallelisms.cp.plan_pieces import DocumentShards

    shards = DocumentShards.from_layout(ids, layout)
    common = dict(is_causal=True, load_balancer="documents")
    if variant in ("ring", "allgather"):
        attention = ring_attention if variant == "ring" else allgather_attention
        return attention(*local, group, _documents=shards, **common)
    if variant == "ulysses":
        return ulysses_attention(*local, group, _plan=concatenated_order_plan(group, ids.size(1)),
                                 _documents=concatenated_documents(shards), **common)
    groups = hybrid_2x2_groups(group)
    return hybrid_attention(*local, group, ulysses_degree=2, _groups=groups, _documents=documents_ring_shards(shards, 2),
                            _plan=concatenated_order_plan(groups[0], 2 * local[0].size(2)), **common)


def _rank_errors(group, variant: str, device: torch.device, dtype: torch.dtype, seed: int) -> list[float]:
    size = group.size
    gen = torch.Generator().manual_seed(seed)
    seq = 32 * size
    ids = random_documents(2, seq, max_len=seq // 3, generator=gen)
    q, grad_out = (torch.randn(2, HEADS, seq, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, KV_HEADS, seq, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = per_document_attention(*full, True, ids)
    expected.backward(grad_out.double())
    layout = DocumentLayout.plan(ids, size)

    def shard(x):  # (B, H, S, D) -> this rank's (B, H, S / P, D) of the documents layout
        return layout.shard(x.transpose(1, 2), 1, group.rank).transpose(1, 2)

    local = [shard(t).to(device).contiguous().requires_grad_() for t in (q, k, v)]
    out = _attention(variant, group, local, ids.to(device), layout)
    out.backward(shard(grad_out).to(device).contiguous())
    assert out.device.type == device.type and out.dtype == dtype
    errors = []
    for got, want in zip([out, *(t.grad for t in local)], [expected, *(t.grad for t in full)]):
        diff = (got.detach().cpu().double() - shard(want.detach())).abs().max()
        errors.append((diff / want.detach().abs().max()).item())
    return errors


def _cases(device: str) -> list[tuple[str, int, str]]:
    """(variant, cp, dtype): on CUDA each distinct path once: every variant's varlen flash pieces (bf16) at cp 2,
    its efficient-kernel pieces (fp32) at cp 4, hybrid at 4 in bf16; on the CPU one float32 pass per variant."""
    if device != "cuda":
        return [(v, 2, "float32") for v in ("ring", "allgather", "ulysses")] + [("hybrid", 4, "float32")]
    cases = [(v, cp, d) for v in ("ring", "allgather", "ulysses") for cp, d in ((2, "bfloat16"), (4, "float32"))]
    return cases + [("hybrid", 4, "bfloat16")]


@pytest.mark.parametrize("device", FAST_CPU)
def test_documents_layout_of_every_variant_matches_each_document_alone(device, monkeypatch):
    torch_device = require(device)
    bad = []
    deadline = time.monotonic() + (RANKS_LIMIT_S if device == "cuda" else 300)
    for variant, cp, dtype in _cases(device):
        start = time.perf_counter()
        per_rank = run_ring_ranks(lambda g: _rank_errors(g, variant, torch_device, getattr(torch, dtype), cp),
                                  cp, monkeypatch, timeout=max(1.0, deadline - time.monotonic()))
        limit = tolerance(device, dtype)
        worst = max(max(errors) for errors in per_rank)
        print(f"documents layout, {variant} cp {cp} {dtype} on {device}: max error / max |reference| {worst:.2e} "
              f"({time.perf_counter() - start:.2f} s)", flush=True)  # the GPU report runs pytest with -s: live
        if not worst <= limit:
            bad.append(f"{variant} cp {cp} {dtype}: {worst:.2e} > {limit:g}")
    assert not bad, bad
