"""The CUDA varlen path of document blocks (parallelisms/cp/kernel_varlen.py), checked without a GPU:
- exactness of its orchestration (packed gathers, fused rectangles, log-sum-exp merges of the causal and the
  rectangle call, gradient scatters with repeated key rows) on CPU, the two varlen ops answered by a float64
  stand-in, against a float64 per-document reference with explicit masks;
- on fake CUDA tensors: every flash call's schema, dtypes, strides, GQA heads (unexpanded) and log-sum-exp layout
  ((H, total_q), packed), and the kernel calls of one layer at 1M tokens (<= 4 x P, P = 16 and 64).
The numbers of the real kernels: tests/gpu/test_gpu_varlen.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import parallelisms.cp.kernel_calls as cp_toolkit
import parallelisms.cp.exchange_ring as ring_attention
from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.kernel_varlen import plan_calls
from tests.parallelisms.attention_reference import relative_error
from tests.parallelisms.varlen_reference import ReferenceVarlen
from training.planning import cuda_path_probe as probe

aten = torch.ops.aten


def _row(seq: int, seed: int) -> torch.Tensor:
    """(1, S) ids: short documents and one longer than a quarter of the row (split over every rank)."""
    rng = np.random.default_rng(seed)
    lengths = [seq // 3] + [int(x) for x in rng.integers(1, 24, seq)]
    ids = np.repeat(np.arange(len(lengths)), lengths)[:seq]
    return torch.from_numpy(ids)[None]


def _gathered_documents(row: torch.Tensor, cp: int) -> DocumentShards:
    """What Ulysses attends over on the documents layout: every rank's shard concatenated in rank order."""
    return concatenated_documents(DocumentShards.from_layout(row, DocumentLayout.plan(row, cp)))


def _reference(q, k, v, ids, positions):
    """float64 attention with the documents-and-causal mask written out (token i sees j: same document and
    position_j <= position_i)."""
    groups = q.size(1) // k.size(1)
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    allowed = (ids[:, None] == ids[None, :]) & (positions[None, :] <= positions[:, None])
    s = (q.double() @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def test_varlen_blocks_are_exact_against_a_float64_per_document_reference(monkeypatch):
    row = _row(192, seed=1)
    docs = _gathered_documents(row, cp=4)
    pieces = docs.layout_pieces(0, 0, True)
    calls = plan_calls(pieces, torch.device("cpu"))
    assert [c.is_causal for c in calls] == [True, False]  # squares in one call, rectangles in the other
    assert any(len(set(zip(*[t.tolist() for t in (c.k_batch, c.k_rows)]))) < c.k_rows.numel() for c in calls)
    for name in ("uses_varlen",):  # CPU has no varlen kernel: route through the varlen code with the stand-in
        monkeypatch.setattr(cp_toolkit, name, lambda q, p: True)
        monkeypatch.setattr(ring_attention, name, lambda q, p: True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 192, 4, 16, generator=gen).transpose(1, 2).requires_grad_()  # (B, L, H, D) memory
    k, v = (torch.randn(1, 192, 2, 16, generator=gen).transpose(1, 2).requires_grad_() for _ in range(2))
    dout = torch.randn(1, 4, 192, 16, generator=gen)
    with ReferenceVarlen() as stand_in:
        out = local_segment_attention(q, k, v, docs, is_causal=True)
        out.backward(dout)
    assert stand_in.calls == 4  # two calls forward, two backward for the whole block
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = _reference(*leaves, docs.per_rank[0][0], docs.positions[0, 0])
    expected.backward(dout.double())
    assert relative_error(out, expected) < 1e-5
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        assert relative_error(got, ref.grad) < 1e-5


@pytest.fixture(scope="module")
def fake_cuda():
    why = probe.load_fake_cuda_guard()
    if why:
        pytest.skip(why)


def _check_flash_call(func, args, kwargs, result, heads, kv_heads):
    if func is aten._flash_attention_forward.default:
        q, k, v, cum_q, cum_k, max_q, max_k = args[:7]
        out, lse = result[:2]
        assert q.dim() == 3 and q.size(1) == heads and k.size(1) == v.size(1) == kv_heads  # GQA unexpanded
        assert cum_q.dtype == cum_k.dtype == torch.int32 and cum_q.numel() == cum_k.numel() >= 2
        assert all(x.is_contiguous() and x.device.type == "cuda" for x in (q, k, v, cum_q, cum_k))
        assert isinstance(max_q, int) and isinstance(max_k, int) and max_q <= q.size(0) and max_k <= k.size(0)
        assert out.shape == q.shape and lse.shape == (heads, q.size(0)) and lse.dtype == torch.float32
        assert lse.stride() == (q.size(0), 1)  # packed (H, total_q), not padded per sequence
    elif func is aten._flash_attention_backward.default:
        dout, q, k, v, out, lse, cum_q, cum_k = args[:8]
        assert lse.shape == (heads, q.size(0)) and lse.is_contiguous() and lse.dtype == torch.float32
        assert all(x.is_contiguous() and x.shape == q.shape for x in (dout, out))
        assert [g.shape for g in result] == [q.shape, k.shape, v.shape] and k.size(1) == kv_heads
    else:
        raise AssertionError(f"unexpected attention kernel {func}")


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_every_flash_call_fits_its_schema_on_fake_cuda(fake_cuda, impl):
    row = _row(512, seed=2)
    layout_docs = DocumentShards.from_layout(row, DocumentLayout.plan(row, 4))
    docs = layout_docs if impl == "ring" else concatenated_documents(layout_docs)
    length = 128 if impl == "ring" else 512
    counter = probe.LaunchCounter(record=True)
    probe.measure_layer(docs, 1 if impl == "ring" else 0, impl, (1, length, 8, 2, 64), counter=counter)
    assert counter.attention_calls and counter.syncs == 0
    for func, args, kwargs, result in counter.attention_calls:
        _check_flash_call(func, args, kwargs, result, heads=8, kv_heads=2)


@pytest.mark.parametrize("cp", [16, 64])
def test_kernel_calls_per_layer_at_1m_tokens_stay_within_4p(fake_cuda, cp):
    """A 1M-token web-like row: the sparse ring's busiest rank and Ulysses on documents, forward + backward of one
    layer, counted by a dispatch mode on fake CUDA tensors (per-piece calls were ~2 x pieces)."""
    ids = probe.web_like_row(1 << 20)
    ring = probe.ring_counts(ids, cp, (1, (1 << 20) // cp, 8, 2, 64))
    assert ring.attention_kernel_calls_per_layer <= 4 * cp and ring.pieces > 4 * cp
    ulysses = probe.ulysses_counts(ids, cp, (1, 1 << 20, 1, 1, 64))
    assert ulysses.attention_kernel_calls_per_layer <= 4 * cp and ulysses.pieces > 4 * cp
