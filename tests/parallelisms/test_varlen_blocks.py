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
from torch._subclasses.fake_tensor import FakeTensorMode

import parallelisms.cp.kernel_calls as cp_toolkit
import parallelisms.cp.exchange_ring as ring_attention
from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.plan_host import BatchPlan
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.exchange_ring_sparse import sparse_backward, sparse_forward
from parallelisms.cp.layouts import DOCUMENTS
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.kernel_varlen import plan_calls
from tests.parallelisms.attention_reference import relative_error
from tests.parallelisms.varlen_reference import ReferenceVarlen
from training.planning import cuda_path_probe as probe
from training.planning.fake.counter import DispatchCounter
from training.planning.fake.cuda import load_fake_cuda_guard
from training.planning.fake.world import fake_process_group

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


@pytest.mark.parametrize("planned", [False, True], ids=["planned-at-first-layer", "moved-with-the-batch-plan"])
def test_varlen_blocks_are_exact_against_a_float64_per_document_reference(monkeypatch, planned):
    """planned: the varlen calls' indices come from the data workers' BatchPlan, moved with the batch."""
    row = _row(192, seed=1)
    if planned:
        plan = BatchPlan.build(row.numpy(), 4, 0, "ulysses").to("cpu")
        docs = concatenated_documents(DocumentShards.from_plan(plan))
    else:
        docs = _gathered_documents(row, cp=4)
    pieces = docs.layout_pieces(0, 0, True)
    calls = docs.planned_varlen_calls(pieces, torch.device("cpu")) if planned else plan_calls(pieces, "cpu")
    assert calls is not None
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
    why = load_fake_cuda_guard()
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
    counter = DispatchCounter(record=True)
    probe.measure_layer(docs, 1 if impl == "ring" else 0, impl, (1, length, 8, 2, 64), counter=counter)
    assert counter.attention_calls and counter.syncs == 0
    for func, args, kwargs, result in counter.attention_calls:
        _check_flash_call(func, args, kwargs, result, heads=8, kv_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [16, 64])
def test_with_the_batch_plan_no_layer_copies_anything_to_the_gpu_at_1m_tokens(fake_cuda, cp):
    """The data workers' plan carries the exchange rows and the varlen calls' indices (moved with the batch in
    non_blocking copies), so neither the first layer of a micro-step nor a later one makes a host-to-device copy:
    each pageable one would block the host until the GPU drained its queue. Without a plan the first layer plans
    and copies (the counter sees those copies), later layers reuse its cache. Slow tier since issue 56 (the fast tier
    runs in minutes; CI runs both): the 1M-token plans at cp 16 and 64, 30 s at cp 64."""
    ids = probe.web_like_row(1 << 20)
    plan = BatchPlan.build(ids[None], cp, 0, "ring")
    row = torch.from_numpy(ids)[None]
    copies = {}
    for planned in (True, False):
        docs = None if planned else DocumentShards.from_layout(row, DocumentLayout.plan(row, cp))
        if docs is not None:
            docs.pair_rows(True)  # the host planning the layers would do (on real tensors: fake ones hold no values)
        with fake_process_group(cp, 0) as group, FakeTensorMode(allow_non_fake_inputs=True):
            if planned:  # what step.move_batch does with the plan the data workers made
                docs = DocumentShards.from_plan(plan.to(torch.device("cuda", 0), non_blocking=True))
            q, k, v = probe._qkv(1, (1 << 20) // cp, 8, 2, 64, torch.bfloat16)
            spec = BlockSpec(group, True, None, DOCUMENTS, docs, None, 0, "flash")
            for layer in ("first", "later"):
                counter = DispatchCounter()
                with counter:
                    probe.run_layer(sparse_forward, sparse_backward, q, k, v, spec)
                assert counter.attention > 0
                copies[(planned, layer)] = counter.host_to_device
    assert copies[(True, "first")] == copies[(True, "later")] == 0, copies
    assert copies[(False, "first")] > 4 * cp and copies[(False, "later")] == 0, copies


@pytest.mark.slow
@pytest.mark.parametrize("cp", [16, 64])
def test_kernel_calls_per_layer_at_1m_tokens_stay_within_4p(fake_cuda, cp):
    """A 1M-token web-like row: the sparse ring's busiest rank and Ulysses on documents, forward + backward of one
    layer, counted by a dispatch mode on fake CUDA tensors (per-piece calls were ~2 x pieces). Slow tier since issue 56
    (the fast tier runs in minutes; CI runs both): the 1M-token plans at cp 16 and 64, 20 s at cp 64."""
    ids = probe.web_like_row(1 << 20)
    ring = probe.ring_counts(ids, cp, (1, (1 << 20) // cp, 8, 2, 64))
    assert ring.attention_kernel_calls_per_layer <= 4 * cp and ring.pieces > 4 * cp
    ulysses = probe.ulysses_counts(ids, cp, (1, 1 << 20, 1, 1, 64))
    assert ulysses.attention_kernel_calls_per_layer <= 4 * cp and ulysses.pieces > 4 * cp


def test_the_probes_fake_group_refuses_a_world_of_another_size():
    """Issue 50, bug 5: fake_group reused any process group already up, whatever its size, so a probe of CP 4 inside
    a world of 1 planned and counted for the wrong degree without a word."""
    import torch.distributed as dist

    with fake_process_group(1, 0):
        with pytest.raises(RuntimeError, match="already up"):
            with fake_process_group(4, 0):
                pass
        with fake_process_group(1, 0) as group:  # the same world: reused
            assert dist.get_world_size(group) == 1
