"""The CUDA varlen path of document blocks on a real GPU: one layer's attention over the documents layout, gathered
as Ulysses sees it (so every kind of piece occurs: causal squares, rectangles of a document split over ranks, rows
in both calls), in bf16 with GQA, against float64 per-document attention with the mask written out; output and
dQ/dK/dV. Also checks that the varlen kernel is what ran (two calls forward, two backward) and that the dense flash
block takes GQA K/V unexpanded. The kernel is asked for as "flash": "auto" sends packed documents to cuDNN THD on
an H100/H200 (tests/gpu/test_gpu_cudnn_thd.py), where this counter saw no varlen call on the first H200
(bench/measurements/h200_gpu_report_2026-12-04); FA2 varlen is what A100s and `attention_kernel = "flash"` run.
The same code's exactness on CPU (float64 stand-in for the kernel) and its schemas on fake CUDA tensors are in
tests/parallelisms/test_varlen_blocks.py."""
from __future__ import annotations

import pytest
import torch

from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.plan_pieces import DocumentShards
from tests.gpu.devices import CUDA_ONLY, require
from tests.parallelisms.attention_reference import relative_error
from training.planning.fake.counter import DispatchCounter

TOLERANCE = 3e-2  # bf16 inputs and outputs


def _row(seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    lengths = [seq // 3] + torch.randint(1, 300, (seq,), generator=gen).tolist()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
    return ids[None]


def _reference(q, k, v, ids, positions):
    groups = q.size(1) // k.size(1)
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    allowed = (ids[:, None] == ids[None, :]) & (positions[None, :] <= positions[:, None])
    s = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    return torch.softmax(s.masked_fill(~allowed.to(s.device), float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_varlen_documents_attention_matches_float64(device):
    dev = require(device)
    seq, heads, kv_heads, head_dim = 4096, 8, 2, 64
    row = _row(seq)
    docs = concatenated_documents(DocumentShards.from_layout(row, DocumentLayout.plan(row, 4)))
    gen = torch.Generator(device=dev).manual_seed(0)
    make = lambda h: torch.randn(1, seq, h, head_dim, generator=gen, device=dev,  # noqa: E731
                                 dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    dout = torch.randn(1, heads, seq, head_dim, generator=gen, device=dev, dtype=torch.bfloat16)
    with DispatchCounter() as counter:
        out = local_segment_attention(q, k, v, docs, is_causal=True, kernel="flash")
        out.backward(dout)
    assert counter.attention == 4  # causal squares and fused rectangles, forward and backward
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = _reference(*leaves, docs.per_rank[0][0], docs.positions[0, 0])
    expected.backward(dout.double())
    assert relative_error(out, expected) < TOLERANCE
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        assert relative_error(got, ref.grad) < TOLERANCE
