"""One attention block on a fused SDPA primitive that also returns the log-sum-exp, chosen by device at run time.

The ring merges blocks through their log-sum-exp and runs the backward of every block against the FINAL output and
log-sum-exp, so it needs the aten primitives themselves (not `F.scaled_dot_product_attention`, which would also be
routed back into the ring by the context-parallel mode):
- CPU:  `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`); handles GQA and a float additive mask.
- CUDA: `aten._scaled_dot_product_flash_attention` (+ `_backward`) for fp16/bf16 without a mask and head dim <= 256,
  otherwise `aten._scaled_dot_product_efficient_attention` (+ `_backward`), whose mask needs a 16-aligned last dim,
  whose log-sum-exp is padded to a multiple of 32 rows, and whose backward reads `out` in the (B, L, H, D) memory of
  its own forward output (`sdpa_output_layout`). GQA: flash takes K/V unexpanded (native); the efficient kernel gets
  them expanded. With `prefer="cudnn"` (kernel_for) half-precision mask-free blocks go to cuDNN's fused attention
  instead (kernel_cudnn.py: GQA native, its own LSE layout). Schemas, layouts and strides are checked on meta / fake
  CUDA tensors in the CPU tiers; the numbers on a GPU by `./run_tests.sh --gpu`.
Blocks with `is_causal=True` always have Lq == Lk, so top-left (CPU) and bottom-right (CUDA flash) alignment agree.
Every kernel returns lse as float32 (B, H, Lq). The CP variants never pass a mask: document masking is computed as
mask-free pieces (plan_pieces.py), so half-precision runs with documents get CUDA flash too. The mask path stays for
callers with a genuinely dense mask. On CUDA flash the CP variants put all pieces of one block into at most two
varlen calls (kernel_varlen.py); these per-piece kernels serve CPU, the efficient kernel and undivided blocks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from config.errors import Refusal
from parallelisms.cp.kernel_cudnn import CudnnBlock, cudnn_serves
from parallelisms.cp.rows import sdpa_output_layout

aten = torch.ops.aten


class CpuFlashBlock:
    name = "cpu_flash"

    def forward(self, q, k, v, *, is_causal: bool, scale: float | None, mask: torch.Tensor | None):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, aux, *, is_causal: bool, scale: float | None,
                 mask: torch.Tensor | None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)


def _expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    groups = n_heads // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_heads(grad: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    groups = h // n_kv_heads
    return grad if groups == 1 else grad.view(b, n_kv_heads, groups, s, d).sum(dim=2)


class CudaFlashBlock:
    """fp16/bf16, no mask. aux keeps the forward's bookkeeping outputs that the backward schema asks for. K/V go in
    with their own heads: CUDA flash serves GQA natively (query head h reads K/V head h // (Hq / Hkv)) and returns
    dK/dV with K/V's heads, so there is no expanded K/V transient (training/planning/cuda_path_probe.py measures it)."""
    name = "cuda_flash"

    def forward(self, q, k, v, *, is_causal, scale, mask):
        assert mask is None, "the CUDA flash kernel takes no mask; the efficient kernel handles masked blocks"
        res = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, is_causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = res
        return out, lse, (cum_q, cum_k, max_q, max_k, rng_state, unused)

    def backward(self, dout, q, k, v, out, lse, aux, *, is_causal, scale, mask):
        cum_q, cum_k, max_q, max_k, rng_state, unused = aux
        return aten._scaled_dot_product_flash_attention_backward.default(
            dout.contiguous(), q, k, v, sdpa_output_layout(out), lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0,
            is_causal, rng_state, unused, scale=scale)


class CudaEfficientBlock:
    """Any float dtype, optional additive mask (padded to a 16-aligned row, expanded over heads)."""
    name = "cuda_efficient"
    LSE_ROW_ALIGN = 32
    MASK_COL_ALIGN = 16

    def _bias(self, mask, n_heads):
        if mask is None:
            return None
        b, _, lq, lk = mask.shape
        padded = mask.new_zeros(b, 1, lq, math.ceil(lk / self.MASK_COL_ALIGN) * self.MASK_COL_ALIGN)
        padded[..., :lk] = mask
        return padded[..., :lk].expand(b, n_heads, lq, lk)

    def forward(self, q, k, v, *, is_causal, scale, mask):
        n_heads, lq = q.size(1), q.size(2)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(
            q, _expand_heads(k, n_heads), _expand_heads(v, n_heads), self._bias(mask, n_heads), True, 0.0,
            is_causal, scale=scale)
        return out, lse[..., :lq], (seed, offset)

    def backward(self, dout, q, k, v, out, lse, aux, *, is_causal, scale, mask):
        seed, offset = aux
        n_heads, n_kv, lq = q.size(1), k.size(1), q.size(2)
        padded_rows = math.ceil(lq / self.LSE_ROW_ALIGN) * self.LSE_ROW_ALIGN
        lse = F.pad(lse, (0, padded_rows - lq)).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            dout.contiguous(), q, _expand_heads(k, n_heads), _expand_heads(v, n_heads), self._bias(mask, n_heads),
            sdpa_output_layout(out), lse, seed, offset, 0.0, [True, True, True, False], is_causal, scale=scale)
        return dq, _fold_heads(dk, n_kv), _fold_heads(dv, n_kv)


FLASH_MAX_HEAD_DIM = 256  # CUDA flash attention has kernels up to this head dim


KERNEL_PREFERENCES = ("flash", "cudnn")


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, needs_mask: bool, *, prefer: str = "flash"):
    """CPU flash on CPU; on CUDA flash for half precision without a mask (head dim a multiple of 8, at most 256),
    else memory-efficient. `prefer="cudnn"` takes cuDNN's fused attention (kernel_cudnn.py, about twice flash's speed
    on Hopper) wherever it serves the case, and the same choice as "flash" elsewhere."""
    if prefer not in KERNEL_PREFERENCES:
        raise Refusal(f"attention kernel preference {prefer!r} is none of {KERNEL_PREFERENCES}")
    if device_type == "cpu":
        return CpuFlashBlock()
    if device_type == "cuda":
        if prefer == "cudnn" and cudnn_serves(dtype, head_dim, needs_mask):
            return CudnnBlock()
        if (dtype in (torch.float16, torch.bfloat16) and not needs_mask and head_dim % 8 == 0
                and head_dim <= FLASH_MAX_HEAD_DIM):
            return CudaFlashBlock()
        return CudaEfficientBlock()
    raise Refusal(f"ring attention has no block kernel for device {device_type!r} (CPU and CUDA only)")


def choose_block_kernel(q: torch.Tensor, needs_mask: bool):
    return kernel_for(q.device.type, q.dtype, q.size(-1), needs_mask)
