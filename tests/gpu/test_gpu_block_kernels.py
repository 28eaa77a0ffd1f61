"""Every block kernel under the ring against explicit float64 attention, used exactly as the ring uses it.

Per case, two key blocks are computed by the kernel under test: the block being tested (causal square, rectangular
Lq != Lk, or masked by a float additive mask whose key length is not a multiple of 16, with rows that see nothing)
and a second block standing for the rest of the ring. Their outputs merge through the log-sum-exp, and each block's
backward then gets the MERGED output and log-sum-exp, with q, dout and out as row slices of (B, L, H, D) or
(B, H, L, D) memory (the ring's layouts). Checked: each block's forward output and log-sum-exp, and the summed
dQ/dK/dV, against float64 math with GQA heads expanded, and the tested block's backward run again with placeholder
philox seed/offset tensors (as the registered CP op's backward runs it, keeping no kernel state) against the one
handed the forward's: torch's cuDNN and flash backwards bind them only under dropout (`dropout_probability != 0` in
aten/src/ATen/native/cudnn/MHA.cpp, `is_dropout` in flash_attn's mha_bwd: the sources indexed here, newer than 2.11),
and this settles it for the torch on the GPU (FA2's and cuDNN's dQ accumulate with atomics, so "the same" is within
the dtype's tolerance, not bit for bit). Rows that see nothing in a block get output 0 and
log-sum-exp -inf there (as `exchange_ring._block_forward` does); rows that see nothing at all must get zero
gradients.

The cpu variants run the CPU flash kernel in the fast tier; the cuda variants (`./run_tests.sh --gpu`) run
CudaFlashBlock and CudnnBlock (half precision, no mask) and CudaEfficientBlock (fp32 and bf16, masks). The
wrappers' shape and stride rules (mask padding, log-sum-exp padding) are also checked on meta tensors here, on any
machine (the cuDNN block's in tests/parallelisms/test_cudnn_block.py).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from parallelisms.cp.kernel_blocks import CpuFlashBlock, CudaEfficientBlock, CudaFlashBlock
from parallelisms.cp.kernel_blocks import CudnnBlock
from tests.gpu.devices import FAST_CPU, require

KERNELS = {"cpu_flash": CpuFlashBlock, "cuda_flash": CudaFlashBlock, "cuda_efficient": CudaEfficientBlock,
           "cuda_cudnn": CudnnBlock}
TOLERANCE = {("cpu", torch.float32): 1e-5, ("cuda", torch.float32): 1e-4}  # half precision: 3e-2
BATCH, HEADS, KV_HEADS, OTHER_KEYS = 2, 8, 2, 24


@dataclass(frozen=True)
class BlockCase:
    kernel: str
    dtype: torch.dtype
    mode: str  # "causal" (square, Lq == Lk), "rect" (Lq != Lk), "masked" (additive mask, Lk % 16 != 0)
    head_dim: int = 64

    @property
    def lengths(self) -> tuple[int, int]:
        return {"causal": (48, 48), "rect": (40, 72), "masked": (40, 50)}[self.mode]

    def __str__(self) -> str:
        return f"{self.kernel}-{str(self.dtype).replace('torch.', '')}-{self.mode}-d{self.head_dim}"


def block_cases(device: str) -> list[BlockCase]:
    if device == "cpu":
        return [BlockCase("cpu_flash", dtype, mode) for dtype in (torch.float32, torch.bfloat16)
                for mode in ("causal", "rect", "masked")]
    flash = [BlockCase("cuda_flash", dtype, mode) for dtype in (torch.bfloat16, torch.float16)
             for mode in ("causal", "rect")] + [BlockCase("cuda_flash", torch.bfloat16, "causal", head_dim=128)]
    efficient = [BlockCase("cuda_efficient", dtype, mode) for dtype in (torch.float32, torch.bfloat16)
                 for mode in ("causal", "rect", "masked")]
    cudnn = [BlockCase("cuda_cudnn", dtype, mode) for dtype in (torch.bfloat16, torch.float16)
             for mode in ("causal", "rect")] + [BlockCase("cuda_cudnn", torch.bfloat16, "causal", head_dim=128)]
    return flash + efficient + cudnn


def _allowed(case: BlockCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (B, Lq, Lk) visibility of the tested block and (B, Lq, OTHER_KEYS) of the other block. Masked mode:
    rows 0-2 see nothing anywhere, rows 3-5 nothing in the tested block but the whole other block."""
    lq, lk = case.lengths
    if case.mode == "causal":
        block = torch.ones(lq, lk, dtype=torch.bool).tril().expand(BATCH, lq, lk)
    elif case.mode == "rect":
        block = torch.ones(BATCH, lq, lk, dtype=torch.bool)
    else:
        block = torch.rand(BATCH, lq, lk, generator=gen) < 0.5
        block[:, :6] = False
    other = torch.ones(BATCH, lq, OTHER_KEYS, dtype=torch.bool)
    if case.mode == "masked":
        other[:, :3] = False
    return block.contiguous(), other


def _additive(allowed: torch.Tensor, dtype, device) -> torch.Tensor:
    """The ring's mask form: (B, 1, Lq, Lk) float, 0 where visible and -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return mask[:, None].to(device)


def _ring_layouts(case: BlockCase, device, gen):
    """q and dout as the second half of (B, L, H, D) memory seen as (B, H, L, D); keys of both blocks."""
    lq, lk = case.lengths
    d, dtype = case.head_dim, case.dtype

    def rows_of_token_major(n_rows):
        full = torch.randn(BATCH, 2 * n_rows, HEADS, d, generator=gen).to(device, dtype).transpose(1, 2)
        return full[:, :, n_rows:]

    q, dout = rows_of_token_major(lq), rows_of_token_major(lq)
    k, v = (torch.randn(BATCH, KV_HEADS, lk, d, generator=gen).to(device, dtype) for _ in range(2))
    k_other, v_other = (torch.randn(BATCH, KV_HEADS, OTHER_KEYS, d, generator=gen).to(device, dtype)
                        for _ in range(2))
    return q, dout, (k, v), (k_other, v_other)


def _reference(q, k, v, allowed, dout):
    """float64 attention with explicit scores: (out, lse, dq, dk, dv); rows that see nothing give output 0, log-sum-exp
    -inf and zero gradients."""
    q, k, v, dout = (t.detach().cpu().double() for t in (q, k, v, dout))
    groups = q.size(1) // k.size(1)
    q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)) / math.sqrt(q.size(-1))
    visible = allowed[:, None].expand_as(scores)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = probs @ v.repeat_interleave(groups, 1)
    out.backward(dout)
    return out.detach(), torch.logsumexp(scores.detach(), -1), q.grad, k.grad, v.grad


def _forward_block(kernel, q, k, v, is_causal, allowed, mask):
    """The kernel's forward with the ring's treatment of rows that see nothing (output 0, log-sum-exp -inf)."""
    out, lse, aux = kernel.forward(q, k, v, is_causal=is_causal, scale=None, mask=mask)
    empty = ~allowed.any(-1)[:, None].expand(lse.shape).to(lse.device)
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf")), aux


def _merge(out_a, lse_a, out_b, lse_b):
    """float32 merge of two blocks through their log-sum-exp (rows nobody sees stay 0 / -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(lse == float("-inf"), 0.0)
    out = out_a.float() * torch.exp(lse_a - ref)[..., None] + out_b.float() * torch.exp(lse_b - ref)[..., None]
    return out, lse


def _max_rel_error(value, reference, rows=None) -> float:
    value, reference = value.detach().cpu().double(), reference.double()
    if rows is not None:
        value, reference = value[:, :, rows], reference[:, :, rows]
    return ((value - reference).abs().max() / reference.abs().max()).item()


def run_block_case(case: BlockCase, device: torch.device) -> dict[str, float]:
    """Max relative errors of every checked quantity for one case."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    kernel = KERNELS[case.kernel]()
    lq, _ = case.lengths
    allowed, allowed_other = _allowed(case, gen)
    q, dout, (k, v), (k_o, v_o) = _ring_layouts(case, device, gen)
    masked = case.mode == "masked"
    mask = _additive(allowed, case.dtype, device) if masked else None
    mask_other = _additive(allowed_other, case.dtype, device) if masked else None

    out_b, lse_b, aux_b = _forward_block(kernel, q, k, v, case.mode == "causal", allowed, mask)
    out_o, lse_o, aux_o = _forward_block(kernel, q, k_o, v_o, False, allowed_other, mask_other)
    merged, lse = _merge(out_b, lse_b, out_o, lse_o)
    out_memory = torch.zeros(BATCH, HEADS, 2 * lq, case.head_dim, dtype=case.dtype, device=device)
    out_memory[:, :, lq:] = merged.to(case.dtype)  # the ring's output: (B, H, L, D) memory, rows of one block
    out = out_memory[:, :, lq:]
    lse_for_backward = lse.masked_fill(lse == float("-inf"), float("inf"))  # as ring_backward: exp(s - inf) = 0
    dq_b, dk, dv = kernel.backward(dout, q, k, v, out, lse_for_backward, aux_b, is_causal=case.mode == "causal",
                                   scale=None, mask=mask)
    dq_o, _, _ = kernel.backward(dout, q, k_o, v_o, out, lse_for_backward, aux_o, is_causal=False, scale=None,
                                 mask=mask_other)

    # the registered CP op's backward keeps no kernel state: it hands placeholders for the forward's philox seed and
    # offset (kernel_blocks.philox_placeholders), which a dropout-free backward must not read
    dq_p, dk_p, dv_p = kernel.backward(dout, q, k, v, out, lse_for_backward, None, is_causal=case.mode == "causal",
                                       scale=None, mask=mask)
    placeholders = max(_max_rel_error(a, b.detach().cpu()) for a, b in ((dq_p, dq_b), (dk_p, dk), (dv_p, dv)))

    seen = allowed.any(-1).all(0)  # rows of the tested block that see something in every batch row
    ref_out, ref_lse, _, _, _ = _reference(q, k, v, allowed, torch.zeros_like(dout))
    both = torch.cat([allowed, allowed_other], dim=-1)
    k_all, v_all = torch.cat([k, k_o], dim=2), torch.cat([v, v_o], dim=2)
    ref_total, _, ref_dq, ref_dk, ref_dv = _reference(q, k_all, v_all, both, dout)
    keys = k.size(2)
    return {"out": _max_rel_error(out_b, ref_out, seen), "lse": _max_rel_error(lse_b, ref_lse, seen),
            "merged out": _max_rel_error(out, ref_total), "dq": _max_rel_error(dq_b.float() + dq_o.float(), ref_dq),
            "dk": _max_rel_error(dk, ref_dk[:, :, :keys]), "dv": _max_rel_error(dv, ref_dv[:, :, :keys]),
            "backward without the forward's seed/offset": placeholders}


@pytest.mark.parametrize("device", FAST_CPU)
def test_block_kernels_match_float64_attention_as_the_ring_uses_them(device):
    torch_device = require(device)
    failures, checked = [], 0
    for case in block_cases(device):
        errors = run_block_case(case, torch_device)
        tolerance = TOLERANCE.get((device, case.dtype), 3e-2)
        bad = {name: f"{err:.2e}" for name, err in errors.items() if not err <= tolerance}  # NaN fails too
        if bad:
            failures.append(f"{case}: {bad} > {tolerance:g}")
        checked += 1
    assert not failures, "\n".join(failures)
    assert checked == len(block_cases(device)) > 0


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the arguments of the CUDA efficient attention ops (on meta tensors the ops check shapes only)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product_efficient_attention"):
            self.calls[name] = args
        return func(*args, **(kwargs or {}))


def test_efficient_wrapper_pads_masks_to_16_and_lse_rows_to_32_on_meta_tensors():
    """The CUDA rules gloo and the CPU kernel never enforce: the additive mask handed to the kernel sits in rows of a
    16-aligned width (any key length, here 50), expanded over the query heads without copies; the backward gets the
    log-sum-exp padded to a multiple of 32 rows (here 37 -> 64); dK/dV come back with the K/V heads (GQA)."""
    kernel, lq, lk = CudaEfficientBlock(), 37, 50
    q = torch.empty(BATCH, HEADS, lq, 64, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(BATCH, KV_HEADS, lk, 64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(BATCH, 1, lq, lk, device="meta", dtype=torch.bfloat16)
    recorder = _RecordOps()
    with recorder:
        out, lse, aux = kernel.forward(q, k, v, is_causal=False, scale=None, mask=mask)
        dq, dk, dv = kernel.backward(out, q, k, v, out, lse, aux, is_causal=False, scale=None, mask=mask)
    bias = recorder.calls["_scaled_dot_product_efficient_attention"][3]
    assert bias.shape == (BATCH, HEADS, lq, lk) and bias.stride(1) == 0 and bias.stride(2) % 16 == 0
    assert recorder.calls["_scaled_dot_product_efficient_attention_backward"][4].stride(2) % 16 == 0
    padded_lse = recorder.calls["_scaled_dot_product_efficient_attention_backward"][6]
    assert padded_lse.shape == (BATCH, HEADS, 64) and padded_lse.is_contiguous()
    assert lse.shape == (BATCH, HEADS, lq) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_block_cases_cover_every_cuda_kernel_class_and_mode():
    """The cuda variant's plan, checked where it cannot run: every CUDA class, flash and cuDNN in half precision
    only, masks only on the efficient kernel, fp32 and bf16, every mode."""
    cases = block_cases("cuda")
    assert {c.kernel for c in cases} == {"cuda_flash", "cuda_efficient", "cuda_cudnn"}
    assert all(c.dtype in (torch.bfloat16, torch.float16) and c.mode != "masked" for c in cases
               if c.kernel in ("cuda_flash", "cuda_cudnn"))
    efficient = {(c.dtype, c.mode) for c in cases if c.kernel == "cuda_efficient"}
    assert efficient == {(d, m) for d in (torch.float32, torch.bfloat16) for m in ("causal", "rect", "masked")}
    assert all(c.lengths[1] % 16 for c in cases if c.mode == "masked")
