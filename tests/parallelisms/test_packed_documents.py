"""Packed documents at CP 1 (parallelisms/cp/packed_documents.py): one packed-sequence attention call per layer.

- exactness on CPU (one flash-CPU call per document) against float64 SDPA with the documents mask written out;
- the CUDA orchestration (one varlen flash call forward, one backward, over views of the model's projections) on
  CPU, the two varlen ops answered by the float64 stand-in of tests/parallelisms/varlen_reference.py;
- on fake CUDA tensors: exactly 1 attention call forward and 1 backward per layer, no host-to-device copy and no
  host sync once the batch (and its cu_seqlens) moved;
- the debug-shaped model through `context_parallel` with a CP group of one: loss and gradients equal the documents
  layout's path (the sparse ring at P = 1, which a BatchPlan still selects) within 1e-6 relative, fp32.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import parallelisms.cp.packed_documents as packed_module
from parallelisms.context_parallel import context_parallel
from parallelisms.cp.packed_documents import PackedDocuments, packed_attention, packed_backward, packed_forward
from parallelisms.cp.plan_host import BatchPlan
from tests.parallelisms.attention_reference import random_documents, reference_attention, relative_error
from tests.parallelisms.varlen_reference import ReferenceVarlen
from training.planning import cuda_path_probe as probe
from training.planning.fake.counter import DispatchCounter
from training.planning.fake.cuda import load_fake_cuda_guard

aten = torch.ops.aten


def _qkv(batch, seq, heads, kv_heads, head_dim, seed=0, dtype=torch.float32):
    """q, k, v as the model hands them over: (B, S, H, D) projections seen as (B, H, S, D)."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, head_dim, generator=gen).to(dtype).transpose(1, 2)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def test_ids_become_sequence_offsets_over_the_flattened_batch():
    ids = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    docs = PackedDocuments.from_ids(ids)
    assert docs.host_cu.tolist() == [0, 2, 5, 6, 12] and docs.cu_seqlens.dtype == torch.int32
    assert docs.max_seqlen == 6 and docs.documents == 4
    assert [(p.batch.start, p.q_rows.start, p.q_rows.stop) for p in docs.pieces(True)] == [(0, 0, 2), (0, 2, 5),
                                                                                        (0, 5, 6), (1, 0, 6)]
    # one id in two separate runs of a row is one document (the CP contract): no packed form
    assert PackedDocuments.from_ids(np.array([[0, 0, 1, 1, 0, 0]])) is None


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("stand_in", [False, True], ids=["per-document-cpu", "one-varlen-call"])
def test_packed_attention_is_exact_against_float64_sdpa(monkeypatch, kv_heads, is_causal, stand_in):
    """stand_in: the CUDA path (one varlen call per direction over the (B x S, H, D) views) with the varlen ops
    answered in float64, as no varlen kernel exists on CPU."""
    gen = torch.Generator().manual_seed(3)
    ids = random_documents(2, 96, max_len=40, generator=gen)
    ids[1] = 0  # a row that is one whole document
    q, k, v = (x.requires_grad_() for x in _qkv(2, 96, 4, kv_heads, 16, seed=4))
    dout = torch.randn(2, 4, 96, 16, generator=gen)
    docs = PackedDocuments.from_ids(ids.numpy())
    calls = contextlib.nullcontext()
    if stand_in:
        monkeypatch.setattr(packed_module, "one_packed_call", lambda q, kernel: True)
        calls = ReferenceVarlen()
    with calls:
        out = packed_attention(q, k, v, docs, is_causal=is_causal)
        out.backward(dout)
    if stand_in:
        assert calls.calls == 2  # one call forward, one backward, for the whole batch
    full = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*full, is_causal, ids)
    expected.backward(dout.double())
    assert relative_error(out, expected) < 1e-5
    for got, ref in zip((q.grad, k.grad, v.grad), full):
        assert got.shape == ref.shape and relative_error(got, ref.grad) < 1e-5


class OpNames(TorchDispatchMode):
    """Every op dispatched, by name, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def fake_cuda():
    why = load_fake_cuda_guard()
    if why:
        pytest.skip(why)


def test_one_layer_on_fake_cuda_makes_one_call_each_way_and_no_copy_or_sync(fake_cuda):
    """8K tokens, Llama's 16 / 8 heads, web-like documents: the batch's cu_seqlens moved with it (outside the count),
    then the layer's forward and backward: one FlashAttention varlen call each, no host-to-device copy, no host
    sync, and no gather or scatter (the kernels read views of the projections)."""
    ids = probe.web_like_row(8192)[None]
    host = PackedDocuments.from_ids(ids)
    counter, ops = DispatchCounter(record=True), OpNames()
    with FakeTensorMode(allow_non_fake_inputs=True):
        docs = host.to("cuda", non_blocking=True)
        q, k, v = (x.to("cuda") for x in _qkv(1, 8192, 16, 8, 128, dtype=torch.bfloat16))
        dout = torch.empty_like(q)  # the gradient arrives laid out like the output: (B, S, H, D) memory
        with counter, ops:
            out, saved = packed_forward(q, k, v, docs, True, None, "flash")
            packed_backward(dout, q, k, v, saved, docs, True, None, "flash")
    names = [str(func) for func, *_ in counter.attention_calls]
    assert names == ["aten._flash_attention_forward.default", "aten._flash_attention_backward.default"]
    assert counter.host_to_device == 0 and counter.syncs == 0
    forward_args = counter.attention_calls[0][1]
    assert forward_args[0].shape == (8192, 16, 128) and forward_args[1].shape == (8192, 8, 128)  # GQA unexpanded
    assert forward_args[3] is docs.cu_seqlens and forward_args[5] == host.max_seqlen
    # everything else is a view: no gather, scatter, copy, accumulator or merge kernel (the layout path: 32)
    views = {"aten.transpose.int", "aten.view.default", "prim.device.default"}
    assert [name for name in ops.names if name not in views] == names


def _tiny_llama():
    from models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,
                              rope_theta=10000.0))
    model.init_weights(0)
    return model


def _loss_and_grads(model, batch, plan):
    """The trainer's CP 1 documents micro-step, shortened: buffers sharded in place (a no-op at P = 1), SDPA routed,
    the summed token loss and its backward inside the context."""
    model.zero_grad()
    tokens, positions, ids = (batch[n].clone() for n in ("tokens", "positions", "ids"))
    with context_parallel(dist.group.WORLD, [tokens, positions, ids], [1, 1, 1], no_restore_buffers={tokens},
                          load_balancer="documents", document_ids=ids, plan=plan):
        logits = model(tokens, positions)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_debug_model_at_cp1_equals_the_documents_layout_path(monkeypatch):
    """Loss and every gradient of the packed path equal the documents layout's sparse ring at P = 1 (fp32)."""
    layers = []
    real_forward = packed_module.packed_forward
    monkeypatch.setattr(packed_module, "packed_forward", lambda *a: layers.append(1) or real_forward(*a))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(5)
        ids = random_documents(2, 128, max_len=50, generator=gen)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        run = torch.cumsum(starts.long(), 1) - 1  # each token's document, counted from the row's first
        positions = torch.stack([torch.arange(128) - torch.nonzero(starts[b]).flatten()[run[b]] for b in range(2)])
        batch = {"tokens": torch.randint(0, 96, (2, 128), generator=gen), "positions": positions, "ids": ids}
        model = _tiny_llama()
        packed_loss, packed_grads = _loss_and_grads(model, batch, None)
        assert len(layers) == 2  # the packed path ran, once per layer; the BatchPlan below selects the layout's
        layout_loss, layout_grads = _loss_and_grads(model, batch, BatchPlan.build(ids.numpy(), 1, 0, "ring",
                                                                                   varlen=False).to("cpu"))
        assert len(layers) == 2
        assert relative_error(packed_loss, layout_loss) <= 1e-6
        for got, ref in zip(packed_grads, layout_grads):
            assert relative_error(got, ref) <= 1e-6
    finally:
        dist.destroy_process_group()
