"""The cuDNN block kernel (parallelisms/cp/kernel_blocks.py) on a CPU-only box.

1. On fake CUDA tensors the block calls the cuDNN aten ops (and no other attention op) with K/V unexpanded, and its
   outputs have the shapes, dtypes and strides the ring expects (the ops' meta kernels shape them).
2. The numbers of the ring's use of it, with a float64 stand-in for the two aten calls that answers in cuDNN's own
   layout (LSE (B, H, Lq, 1)): two blocks merged by the real `LseAccumulator`, then each block's backward against
   the merged out / lse, compared with full-sequence float64 SDPA. This checks the LSE conversions both ways.
3. `kernel_for(..., prefer="cudnn")` picks it where it serves, and the default choice is unchanged.
4. Every CUDA backward (flash, cuDNN, efficient, flash varlen) run without the forward's aux, as the CP op's
   backward runs it, gets dropout_p 0 and the int64 seed / offset placeholders on q's device.
The real kernel's numbers are for a GPU (`./run_tests.sh --gpu`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from config import Refusal
from parallelisms.cp import kernel_blocks
from parallelisms.cp.accumulators import LseAccumulator, lse_for_backward
from parallelisms.cp.kernel_blocks import CpuFlashBlock, CudaEfficientBlock, CudaFlashBlock, CudnnBlock, kernel_for
from parallelisms.cp.plan_piece import FULL, Piece
from tests.parallelisms.attention_reference import relative_error
from training.planning.fake.cuda import load_fake_cuda_guard

aten = torch.ops.aten
CUDNN_OPS = {aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_cudnn_attention_backward.default}


class AttentionCalls(TorchDispatchMode):
    """Records every op whose name mentions attention, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.name():
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def fake_cuda():
    """Slicing fake CUDA tensors needs a CUDA device guard, which a CPU-only build lacks (planning/fake/cuda.py)."""
    why = load_fake_cuda_guard()
    if why:
        pytest.skip(why)


def trainer_layout(batch, length, heads, head_dim, dtype, device):
    """(B, H, L, D) over (B, L, H, D) memory: how the model hands its projections to attention."""
    return torch.randn(batch, length, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("lq, lk, is_causal", [(16, 16, True), (16, 16, False), (16, 24, False)],
                         ids=["diagonal-causal", "off-diagonal-full", "rect-lq-ne-lk"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_cudnn_block_on_fake_cuda_tensors(lq, lk, is_causal, kv_heads):
    batch, heads, head_dim, dtype = 2, 8, 64, torch.bfloat16
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = trainer_layout(batch, lq, heads, head_dim, dtype, "cuda")
        k, v = (trainer_layout(batch, lk, kv_heads, head_dim, dtype, "cuda") for _ in range(2))
        block = CudnnBlock()
        with AttentionCalls() as forward_calls:
            out, lse, aux = block.forward(q, k, v, is_causal=is_causal, scale=None, mask=None)
        assert out.shape == (batch, heads, lq, head_dim) and out.dtype == dtype
        assert out.stride() == q.stride()  # the forward writes q's (B, L, H, D) memory order
        assert lse.shape == (batch, heads, lq) and lse.dtype == torch.float32
        dout = trainer_layout(batch, lq, heads, head_dim, dtype, "cuda")
        with AttentionCalls() as backward_calls:
            dq, dk, dv = block.backward(dout, q, k, v, out, lse_for_backward(lse), aux, is_causal=is_causal,
                                        scale=None, mask=None)
    for grad, like in ((dq, q), (dk, k), (dv, v)):  # GQA: dK/dV with K/V's own heads
        assert grad.shape == like.shape and grad.dtype == like.dtype and grad.stride() == like.stride()
    (fwd_op, fwd_args), = forward_calls.calls
    (bwd_op, bwd_args), = backward_calls.calls
    assert fwd_op is aten._scaled_dot_product_cudnn_attention.default
    assert bwd_op is aten._scaled_dot_product_cudnn_attention_backward.default
    assert fwd_args[1].size(1) == kv_heads and bwd_args[2].size(1) == kv_heads  # K never expanded
    grad_out, out_arg, lse_arg = bwd_args[0], bwd_args[4], bwd_args[5]
    assert grad_out.stride() == out_arg.stride() == q.stride()  # one layout for out and grad_out
    assert lse_arg.shape == (batch, heads, lq, 1) and lse_arg.dtype == torch.float32 and lse_arg.is_contiguous()


def test_cudnn_block_refuses_non_square_causal_blocks_and_masks(fake_cuda):
    """cuDNN's dense causal mask is top-left; no CP variant makes a causal Lq != Lk block (the all-gather fuses only
    full rectangles), so one reaching the block is a bug upstream and fails loudly instead of being masked wrongly."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = trainer_layout(1, 16, 4, 64, torch.bfloat16, "cuda")
        k = v = trainer_layout(1, 24, 2, 64, torch.bfloat16, "cuda")
        with AttentionCalls() as calls:
            with pytest.raises(AssertionError, match="must be square"):
                CudnnBlock().forward(q, k, v, is_causal=True, scale=None, mask=None)
            CudnnBlock().forward(q, k, v, is_causal=False, scale=None, mask=None)
        assert [op for op, _ in calls.calls] == [aten._scaled_dot_product_cudnn_attention.default]
        with pytest.raises(AssertionError, match="no mask"):
            CudnnBlock().forward(q, k, v, is_causal=False, scale=None, mask=torch.zeros(1, 1, 16, 24))


def test_lse_conversions_round_trip_and_lay_row_slices_out_contiguously():
    """The merge's lse reaches the backward as a row slice of (B, H, L); cuDNN's graph wants it contiguous
    (B, H, Lq, 1) float32, the layout its forward wrote."""
    cudnn_lse = torch.randn(2, 4, 10, 1)
    merged = kernel_blocks.lse_for_merge(cudnn_lse)
    assert merged.shape == (2, 4, 10) and torch.equal(kernel_blocks.lse_for_cudnn(merged), cudnn_lse)
    rows = torch.randn(2, 4, 30)[:, :, 10:20]
    back = kernel_blocks.lse_for_cudnn(rows)
    assert back.shape == (2, 4, 10, 1) and back.is_contiguous() and torch.equal(back.squeeze(-1), rows)
    with pytest.raises(AssertionError, match="B, H, Lq, 1"):
        kernel_blocks.lse_for_merge(torch.randn(2, 4, 10))


# ---- numbers, with a float64 stand-in for the two aten calls ----------------------------------------------------

def _reference_probabilities(q, k, is_causal, scale):
    """Scores of q against K expanded to q's heads, scaled and top-left causal-masked (as cuDNN's dense path)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        allowed = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, scale


def _fold(grad, kv_heads):
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def standin_forward(q, k, v, is_causal, scale):
    """cuDNN's forward outputs, computed in float64, in cuDNN's layout: LSE float32 (B, H, Lq, 1) contiguous."""
    scores, _ = _reference_probabilities(q, k, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    seed = offset = torch.zeros((), dtype=torch.long)
    return out.to(q.dtype), lse.float().contiguous(), None, None, q.size(2), k.size(2), seed, offset, None


def standin_backward(dout, q, k, v, out, lse, seed, offset, is_causal, scale):
    """cuDNN's backward in float64; takes the LSE only in the layout the forward produced."""
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32 and lse.is_contiguous(), lse.shape
    assert dout.stride() == out.stride()
    scores, scale = _reference_probabilities(q, k, is_causal, scale)
    probs = torch.exp(scores - lse.double())
    v_full = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    k_full = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    dv = probs.transpose(-1, -2) @ dout
    dprobs = dout @ v_full.transpose(-1, -2)
    dscores = probs * (dprobs - (dout * out).sum(dim=-1, keepdim=True))
    dq = dscores @ k_full * scale
    dk = dscores.transpose(-1, -2) @ q * scale
    return dq, _fold(dk, k.size(1)), _fold(dv, v.size(1))


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(kernel_blocks, "_cudnn_forward", standin_forward)
    monkeypatch.setattr(kernel_blocks, "_cudnn_backward", standin_backward)


@pytest.mark.parametrize("case", ["causal-ring-step", "rect-blocks"])
def test_merged_blocks_match_full_attention(standin, case):
    """causal-ring-step: rank 1's queries (rows 8..15 of 16) against K/V block 0 (full) and block 1 (diagonal,
    causal). rect-blocks: 8 queries against 20 keys cut into blocks of 12 and 8 (Lq != Lk), not causal."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, head_dim = 2, 4, 2, 16
    length, is_causal, cuts, rows = ((16, True, (8,), slice(8, 16)) if case == "causal-ring-step"
                                     else (20, False, (12,), slice(0, 8)))
    q_full = torch.randn(batch, heads, length, head_dim, dtype=torch.float64, generator=gen)
    k = torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64, generator=gen)
    v = torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64, generator=gen)
    q = q_full[:, :, rows]
    dout = torch.randn(batch, heads, q.size(2), head_dim, dtype=torch.float64, generator=gen)

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q_full, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=is_causal, enable_gqa=True)[:, :, rows]
    ref_lse = torch.logsumexp(_reference_probabilities(q_full, k, is_causal, None)[0], dim=-1)[:, :, rows]
    ref.backward(dout)

    edges = (0, *cuts, length)
    blocks = [(slice(a, b), is_causal and a == rows.start) for a, b in zip(edges, edges[1:])]
    block, acc, auxes = CudnnBlock(), LseAccumulator(q, v), []
    for kv_rows, diagonal in blocks:
        out_b, lse_b, aux = block.forward(q, k[:, :, kv_rows], v[:, :, kv_rows], is_causal=diagonal, scale=None,
                                          mask=None)
        assert lse_b.shape == (batch, heads, q.size(2)) and lse_b.dtype == torch.float32
        auxes.append(aux)
        acc.merge(out_b, lse_b, Piece(FULL, FULL, FULL, diagonal))
    out, lse = acc.finish()
    assert relative_error(out, ref) < 1e-5 and relative_error(lse, ref_lse) < 1e-5

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (kv_rows, diagonal), aux in zip(blocks, auxes):
        gq, gk, gv = block.backward(dout, q, k[:, :, kv_rows], v[:, :, kv_rows], out, lse_for_backward(lse), aux,
                                    is_causal=diagonal, scale=None, mask=None)
        assert gk.shape[1] == kv_heads
        dq += gq
        dk[:, :, kv_rows] += gk
        dv[:, :, kv_rows] += gv
    assert relative_error(dq, ref_q.grad[:, :, rows]) < 1e-5
    assert relative_error(dk, ref_k.grad) < 1e-5 and relative_error(dv, ref_v.grad) < 1e-5


# ---- kernel choice ----------------------------------------------------------------------------------------------

def test_prefer_cudnn_takes_cudnn_where_it_serves_and_flash_elsewhere():
    assert isinstance(kernel_for("cuda", torch.bfloat16, 128, False, prefer="cudnn"), CudnnBlock)
    assert isinstance(kernel_for("cuda", torch.float16, 64, False, prefer="cudnn"), CudnnBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 256, False, prefer="cudnn"), CudaFlashBlock)  # > 128
    assert isinstance(kernel_for("cuda", torch.bfloat16, 64, True, prefer="cudnn"), CudaEfficientBlock)  # mask
    assert isinstance(kernel_for("cuda", torch.float32, 64, False, prefer="cudnn"), CudaEfficientBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 60, False, prefer="cudnn"), CudaEfficientBlock)
    assert isinstance(kernel_for("cpu", torch.bfloat16, 64, False, prefer="cudnn"), CpuFlashBlock)
    with pytest.raises(Refusal, match="none of"):
        kernel_for("cuda", torch.bfloat16, 64, False, prefer="triton")


def test_default_kernel_choice_is_unchanged():
    for prefer in ({}, {"prefer": "flash"}):
        assert isinstance(kernel_for("cuda", torch.bfloat16, 64, False, **prefer), CudaFlashBlock)
        assert isinstance(kernel_for("cuda", torch.bfloat16, 256, False, **prefer), CudaFlashBlock)
        assert isinstance(kernel_for("cuda", torch.float16, 64, True, **prefer), CudaEfficientBlock)
        assert isinstance(kernel_for("cpu", torch.bfloat16, 64, False, **prefer), CpuFlashBlock)


RNG_ARGUMENTS = {  # backward op: its (seed, offset) arguments by schema name
    aten._scaled_dot_product_flash_attention_backward.default: ("philox_seed", "philox_offset"),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("philox_seed", "philox_offset"),
    aten._scaled_dot_product_efficient_attention_backward.default: ("philox_seed", "philox_offset"),
    aten._flash_attention_backward.default: ("rng_state", "unused"),
}


def _varlen_backward_without_aux(dout, q, k, v, out, lse):
    """kernel_varlen's flash call for one causal sequence of the whole block, as the CP op's backward makes it."""
    import numpy as np

    from parallelisms.cp.kernel_varlen import VarlenCall, varlen_backward
    length = q.size(2)
    rows, batch = torch.arange(length, device=q.device), torch.zeros(length, dtype=torch.int64, device=q.device)
    cum = torch.tensor([0, length], dtype=torch.int32, device=q.device)
    call = VarlenCall(True, batch, rows, batch, rows, cum, cum, length, length,
                      (np.zeros(length, dtype=np.int64), np.arange(length)))
    return varlen_backward(dout, q, k, v, out, lse, None, call, None)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_cudnn", "cuda_efficient", "flash_varlen"])
def test_a_backward_without_the_forwards_aux_runs_dropout_free_on_placeholders(fake_cuda, kernel):
    """The registered CP op's backward keeps no kernel state from the forward (cp/op_variants.py): every CUDA backward
    then gets `philox_placeholders`, int64 zeros on q's device (seed (2,), offset ()), and dropout_p 0.0. Torch
    2.11's flash (mha_bwd / mha_varlen_bwd), cuDNN (run_cudnn_SDP_bprop) and efficient backwards read seed and
    offset only when dropout_p > 0 (the lines: kernel_blocks.philox_placeholders), so the 0.0 is what makes the
    placeholders safe: this holds every call to it, on fake CUDA tensors."""
    batch, heads, kv_heads, length, head_dim, dtype = 1, 4, 2, 16, 64, torch.bfloat16
    blocks = {"cuda_flash": CudaFlashBlock(), "cuda_cudnn": CudnnBlock(), "cuda_efficient": CudaEfficientBlock(),
              "flash_varlen": CudaFlashBlock()}
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, dout = (trainer_layout(batch, length, heads, head_dim, dtype, "cuda") for _ in range(2))
        k, v = (trainer_layout(batch, length, kv_heads, head_dim, dtype, "cuda") for _ in range(2))
        block = blocks[kernel]
        out, lse, _aux = block.forward(q, k, v, is_causal=True, scale=None, mask=None)
        with AttentionCalls() as calls:
            if kernel == "flash_varlen":
                _varlen_backward_without_aux(dout, q, k, v, out, lse)
            else:
                block.backward(dout, q, k, v, out, lse_for_backward(lse), None, is_causal=True, scale=None, mask=None)
    backward_calls = [(op, args) for op, args in calls.calls if op in RNG_ARGUMENTS]
    assert len(backward_calls) == 1, [op for op, _ in calls.calls]
    (op, args), = backward_calls
    named = dict(zip((a.name for a in op._schema.arguments), args))
    seed, offset = (named[name] for name in RNG_ARGUMENTS[op])
    assert named["dropout_p"] == 0.0, (op, named["dropout_p"])
    assert seed.shape == (2,) and offset.shape == () and seed.dtype == offset.dtype == torch.int64, op
    assert seed.device == offset.device == q.device, op
