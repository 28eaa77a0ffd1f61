"""cuDNN's packed-sequence (THD) attention on a real GPU (parallelisms/cp/kernel_cudnn_thd.py, through
nvidia-cudnn-frontend), in bf16 against float64:
- the graph wrapper alone: GQA 16/8, causal squares and full rectangles, sequences of 1 to 8K tokens, zero-length
  batch entries;
- the CP 1 packed path (one THD call each way per layer) and the CP 2 / CP 4 documents layouts in one process as
  Ulysses sees them (causal squares and fused rectangles) with cuDNN THD;
- the frontend refuses a cuDNN other than torch's.
Skipped with the reason where the frontend is not installed or the GPU cannot run it (kernel_cudnn_thd.thd_problem).
The orchestration's exactness on CPU (float64 stand-in of the frontend): tests/parallelisms/test_cudnn_thd.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from parallelisms.cp import kernel_cudnn_thd as thd
from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.kernel_blocks import module_installed
from parallelisms.cp.packed_documents import PackedDocuments, packed_attention
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_pieces import DocumentShards
from tests.gpu.devices import CUDA_ONLY, require
from tests.parallelisms.attention_reference import reference_attention, relative_error
from training.planning.fake.counter import DispatchCounter

TOLERANCE = 3e-2  # bf16 inputs and outputs (tests/gpu/test_gpu_varlen.py's bound)


def _thd_device(device: str) -> torch.device:
    dev = require(device)
    problem = thd.thd_problem(dev, module_installed)
    if problem:
        pytest.skip(problem)
    return dev


def _float64_varlen(q, k, v, dout, cu_q, cu_k, is_causal, scale):
    """Per-sequence float64 attention (bottom-right causal: ours are squares), forward and input gradients."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    outs = []
    for i in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qb == qa:
            continue
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (leaves[0][qa:qb], leaves[1][ka:kb], leaves[2][ka:kb]))
        groups = qs.size(1) // ks.size(1)
        ks, vs = (x.repeat_interleave(groups, dim=1) for x in (ks, vs))
        s = (qs @ ks.transpose(-1, -2)) * scale
        if is_causal:
            allowed = torch.arange(kb - ka, device=q.device)[None, :] <= torch.arange(qb - qa, device=q.device)[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(s, dim=-1) @ vs)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.double())
    return out, [x.grad for x in leaves]


@pytest.mark.parametrize("rectangles", [False, True], ids=["causal-squares", "full-rectangles"])
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_thd_graphs_match_float64(device, rectangles):
    dev = _thd_device(device)
    lengths_q = [1, 8192, 0, 63, 65, 2000, 129, 0, 7]
    lengths_k = [n + (40 if rectangles and n else 0) for n in lengths_q]
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=dev)
                  for n in (lengths_q, lengths_k))
    gen = torch.Generator(device=dev).manual_seed(0)
    make = lambda t, h: torch.randn(t, h, 128, generator=gen, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q, dout = make(sum(lengths_q), 16), make(sum(lengths_q), 16)
    k, v = make(sum(lengths_k), 8), make(sum(lengths_k), 8)
    call = thd.ThdCall(cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=not rectangles)
    graphs = thd.graphs_for(dev)
    out, stats = graphs.forward(q, k, v, call, 128 ** -0.5)
    grads = graphs.backward(dout, q, k, v, out, stats, call, 128 ** -0.5)
    expected, expected_grads = _float64_varlen(q, k, v, dout, cu_q.cpu(), cu_k.cpu(), not rectangles, 128 ** -0.5)
    assert torch.isfinite(out).all() and torch.isfinite(stats).all()
    assert relative_error(out, expected) < TOLERANCE
    for got, ref in zip(grads, expected_grads):
        assert relative_error(got, ref) < TOLERANCE


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_cp1_packed_documents_make_one_thd_call_each_way_and_match_float64(device):
    dev = _thd_device(device)
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in np.ceil(rng.lognormal(6.5, 1.0, 64))]
    ids = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)[:2048])[None]
    gen = torch.Generator(device=dev).manual_seed(2)
    make = lambda h: torch.randn(1, 2048, h, 128, generator=gen, device=dev,  # noqa: E731
                                 dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(16), make(8), make(8)
    dout = torch.randn(1, 16, 2048, 128, generator=gen, device=dev, dtype=torch.bfloat16)
    graphs = thd.graphs_for(dev)
    before = dict(graphs.built)
    with DispatchCounter() as counter:
        out = packed_attention(q, k, v, PackedDocuments.from_ids(ids.numpy()).to(dev), kernel="cudnn",
                               packed="cudnn_thd")
        out.backward(dout)
    assert counter.attention == 0  # no aten attention op ran: the frontend's graphs did
    assert sum(graphs.built.values()) - sum(before.values()) <= 2
    full = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]  # the reference on the host
    expected = reference_attention(*full, True, ids)
    expected.backward(dout.cpu().double())
    assert relative_error(out.cpu(), expected) < TOLERANCE
    for got, ref in zip((q.grad, k.grad, v.grad), full):
        assert relative_error(got.cpu(), ref.grad) < TOLERANCE


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_documents_layouts_on_thd_match_float64(device, cp, monkeypatch):
    """The CP 2 / CP 4 documents layout gathered as Ulysses sees it: causal squares and fused rectangles, with
    attention_kernel = "cudnn" (THD for the packed calls)."""
    dev = _thd_device(device)
    lengths = [683] + np.random.default_rng(cp).integers(1, 300, 2048).tolist()
    row = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)[:2048])[None]
    docs = concatenated_documents(DocumentShards.from_layout(row, DocumentLayout.plan(row, cp)))
    gen = torch.Generator(device=dev).manual_seed(3)
    make = lambda h: torch.randn(1, 2048, h, 128, generator=gen, device=dev,  # noqa: E731
                                 dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(16), make(8), make(8)
    dout = torch.randn(1, 16, 2048, 128, generator=gen, device=dev, dtype=torch.bfloat16)
    with DispatchCounter() as counter:
        out = local_segment_attention(q, k, v, docs, is_causal=True, kernel="cudnn")
        out.backward(dout)
    assert counter.by_kernel.get("flash", 0) == 0, counter.by_kernel  # the packed calls went to THD
    order = torch.argsort(docs.positions[0, 0])
    host = lambda x: x.detach().cpu()[:, :, order]  # noqa: E731  (the reference on the host, in sequence order)
    full = [host(x).double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*full, True, row)
    expected.backward(host(dout).double())
    assert relative_error(host(out), expected) < TOLERANCE
    for got, ref in zip((q.grad, k.grad, v.grad), full):
        assert relative_error(host(got), ref.grad) < TOLERANCE


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_the_frontend_runs_torchs_cudnn(device):
    _thd_device(device)
    import cudnn

    assert cudnn.backend_version() == torch.backends.cudnn.version()
