"""CP attention in K/V head groups (parallelisms/cp/autograd.py): every variant that merges blocks through the
log-sum-exp (dense ring, the documents layout's sparse ring and all-gather, P = 1) against float64 references, under
NCCL's rules (tests/nccl_rules.py), and what a group's transient is on fake CUDA tensors."""
import pytest
import torch

from parallelisms.cp.autograd import HEAD_GROUP_BYTES, head_group_count
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_sharding import shard_sequence, unshard_sequence
from tests.nccl_rules import run_ring_ranks
from tests.parallelisms.attention_reference import (per_document_attention, random_documents, reference_attention,
                                                    relative_error)

pytestmark = pytest.mark.timeout(120)
HQ, HKV, D = 8, 4, 8


def test_group_count_caps_at_a_divisor_and_sizes_by_the_float32_query_gradient():
    k = torch.empty(1, 8, 4, 2, device="meta")
    small = torch.empty(1, 32, 4, 2, device="meta")
    assert [head_group_count(small, k, asked) for asked in (1, 2, 3, 5, 8, 64)] == [1, 2, 2, 4, 8, 8]
    assert head_group_count(small, k, 0) == 1  # a test-sized call is one group
    # Llama 3.1 8B, 32 query / 8 K/V heads of 128, one row: 1 GiB of float32 dQ per 64K tokens
    q8b, k8b = (torch.empty(1, h, 524288, 128, device="meta") for h in (32, 8))
    assert 32 * 524288 * 128 * 4 == 8 * HEAD_GROUP_BYTES and head_group_count(q8b, k8b, 0) == 8
    q128k = torch.empty(1, 32, 131072, 128, device="meta")
    assert head_group_count(q128k, k8b[:, :, :131072], 0) == 2


def _inputs(seq: int, dtype=torch.float32, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HQ, seq, D, generator=gen).to(dtype)
    k, v = (torch.randn(2, HKV, seq, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(2, HQ, seq, D, generator=gen).to(dtype)


def _dense_ring(group, q, k, v, grad_out, ids, head_groups):
    from parallelisms.context_parallel import ring_attention

    def shard(x, dim=2):
        return shard_sequence(x, dim, group.rank, group.size, "zigzag")

    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, is_causal=True, load_balancer="zigzag", head_groups=head_groups,
                         document_ids=None if ids is None else shard(ids, 1))
    out.backward(shard(grad_out))
    return [out.detach(), *(t.grad for t in local)]


@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_dense_ring_in_head_groups_matches_float64_sdpa(monkeypatch, cp, with_documents):
    seq = 16 * cp
    q, k, v, grad_out = _inputs(seq)
    ids = random_documents(2, seq, max_len=seq // 3, generator=torch.Generator().manual_seed(1)) \
        if with_documents else None
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, True, ids)
    expected.backward(grad_out.double())
    wanted = [expected, *(t.grad for t in full)]
    per_groups = {}
    for head_groups in (1, 2, 4):
        per_rank = run_ring_ranks(lambda g: _dense_ring(g, q, k, v, grad_out, ids, head_groups), cp, monkeypatch)
        got = [torch.cat([r[i] for r in per_rank], dim=2) for i in range(4)]  # zigzag shards in rank order
        per_groups[head_groups] = got
        for i, want in enumerate(wanted):
            full_want = shard_sequence_all(want, cp)
            assert relative_error(got[i], full_want) <= 1e-5, (head_groups, i)
    for head_groups in (2, 4):  # the same arithmetic per head (the CPU kernel may split its work differently)
        assert max(relative_error(a, b) for a, b in zip(per_groups[head_groups], per_groups[1])) <= 1e-6


def shard_sequence_all(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Every rank's zigzag shard of a (B, H, S, D) tensor, concatenated in rank order."""
    return torch.cat([shard_sequence(x, 2, r, cp, "zigzag") for r in range(cp)], dim=2)


def _documents_layout(group, q, k, v, grad_out, ids, impl, head_groups):
    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.plan_pieces import DocumentShards

    layout = DocumentLayout.plan(ids, group.size)

    def shard(x):
        return layout.shard(x.transpose(1, 2), 1, group.rank).transpose(1, 2)

    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    attention = ring_attention if impl == "ring" else allgather_attention
    out = attention(*local, group, is_causal=True, load_balancer="documents", head_groups=head_groups,
                    _documents=DocumentShards.from_layout(ids, layout))
    out.backward(shard(grad_out))
    return [out.detach(), *(t.grad for t in local)]


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_documents_layout_in_head_groups_matches_every_document_alone(monkeypatch, impl):
    cp, seq = 2, 48
    q, k, v, grad_out = _inputs(seq, seed=9)
    ids = random_documents(2, seq, max_len=30, generator=torch.Generator().manual_seed(2))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = per_document_attention(*full, True, ids)
    expected.backward(grad_out.double())
    layout = DocumentLayout.plan(ids, cp)
    per_rank = run_ring_ranks(lambda g: _documents_layout(g, q, k, v, grad_out, ids, impl, 4), cp, monkeypatch)
    for i, want in enumerate([expected, *(t.grad for t in full)]):
        for r in range(cp):
            assert relative_error(per_rank[r][i], layout.shard(want.transpose(1, 2), 1, r).transpose(1, 2)) <= 1e-5


def test_bf16_grouped_output_keeps_the_query_memory_layout():
    """The model transposes the output back to (B, S, H * D): a view only when it is laid out like q."""
    from parallelisms.cp.attention import local_segment_attention

    q, k, v, _ = _inputs(32, torch.bfloat16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, S, D) over (B, S, H, D) memory, as the model's
    out = local_segment_attention(q, k, v, None, is_causal=True, head_groups=2)
    assert out.dtype == torch.bfloat16 and out.stride() == q.stride()
    assert relative_error(out, reference_attention(q.double(), k.double(), v.double(), True, None)) <= 1.5e-2
