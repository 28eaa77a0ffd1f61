"""One attention block on cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention` + `_backward`).

Why: on Hopper cuDNN's fused attention runs about twice as fast as the FlashAttention-2 kernels behind
`CudaFlashBlock`; the ring needs the aten primitives themselves because it merges blocks through their log-sum-exp
and runs every block's backward against the FINAL output and log-sum-exp (kernel_blocks.py says why not
`F.scaled_dot_product_attention`).

Facts this module relies on, re-checked. Python side in torch 2.13.0+cpu and torch
2.11.0+cu130; CUDA side in aten/src/ATen/native/cudnn/MHA.cpp and transformers/cuda/sdp_utils.cpp of
a stored recent PyTorch snapshot (not pinned to the v2.11.0 / v2.13 tags: re-check on a GPU, see the last line).
- Schemas are identical in 2.11 and 2.13 (compared at run time): forward `(query, key, value, attn_bias?,
  compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None) -> (output, logsumexp,
  cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)`; backward `(grad_out, query, key,
  value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
  is_causal, *, scale=None) -> (dq, dk, dv)`. `attn_bias` / `cum_seq_*` are non-optional Tensors in the backward
  schema, but None goes through as an undefined tensor (the dense path; the forward returns None for cum_seq_*).
- LSE: float32 (B, Hq, Lq, 1), contiguous. Meta kernels: torch/_meta_registrations.py:6219-6260 (2.13) and
  :5893-5934 (2.11). MHA.cpp run_cudnn_SDP_fprop: `at::empty({b, h, s_q, 1}, ...kFloat)` (with the experimental
  TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 it is (B, Lq, H, 1) memory instead: not supported here). Natural log: torch's
  own context parallel merges this LSE with the same natural-log formula as flash's
  (torch/distributed/tensor/experimental/_context_parallel/_attention.py:151-187 in 2.13, cuDNN note at :154).
  `lse_for_merge` / `lse_for_cudnn` are the one place converting to and from the merge's (B, H, Lq).
- Output: allocated in the stride order of `query` (meta `alloc_with_matching_layout`, 2.13 :6197-6216, 2.11
  :5874-5890; MHA.cpp the same); dq/dk/dv are `empty_like(query/key/value)` (meta backward, 2.13 :6600-6625, 2.11
  :6243-6269).
- Causal: the dense path asks cuDNN for a TOP-LEFT causal mask (MHA.cpp: `is_causal ? CausalMask::TOP_LEFT`),
  flash aligns bottom-right. The ring's causal blocks are squares (Lq == Lk), where the two agree: asserted below.
- dtypes: fp16 / bf16 only (MHA.cpp builds the graph with io type HALF or BFLOAT16). No mask here: the ring never
  passes one, and cuDNN's bias path is left to the efficient kernel.
- Head dim: a multiple of 8 and at most 128 (sdp_utils.cpp check_cudnn_tensor_shapes; 256 only on SM 9.0 with
  cuDNN >= 9.10, which `kernel_for` cannot see, so it stays at 128).
- GQA: native. The dense graph describes K and V by their own sizes and strides (MHA.cpp build_graph:
  `K_->set_dim(k.sizes())`), and dK / dV come back with K/V's heads, so K/V are never expanded. The cuDNN backend
  has taken K/V head counts that divide Q's since before 2.11 (pytorch/pytorch#139586, #150337).
- Strides: the graphs are cached by the sizes and strides of q, k, v, out, grad_out and the LSE (MHA.cpp MHAParams),
  and cuDNN < 9.5.1 needs grad_out laid out exactly like out (MHA.cpp run_cudnn_SDP_bprop). So the backward always
  gets out AND grad_out in (B, H, L, D) over (B, L, H, D) memory (`sdpa_output_layout`, the layout the forward writes
  for the trainer's (B, L, H, D) projections) and the LSE as contiguous float32 (B, H, Lq, 1): one graph per block
  shape, no silent re-layout inside the op.
The numbers of the real kernel (GQA and causal included) are checked on a GPU by tests/gpu/test_gpu_block_kernels.py
(`./run_tests.sh --gpu`); this box has none.
"""
from __future__ import annotations

import torch

from parallelisms.cp.rows import sdpa_output_layout

aten = torch.ops.aten

CUDNN_DTYPES = (torch.float16, torch.bfloat16)
CUDNN_MAX_HEAD_DIM = 128  # 256 needs SM 9.0 and cuDNN >= 9.10; the kernel choice sees neither


def cudnn_serves(dtype: torch.dtype, head_dim: int, needs_mask: bool) -> bool:
    """Whether the cuDNN block takes this case: half precision, no mask, head dim a multiple of 8 up to 128."""
    return dtype in CUDNN_DTYPES and not needs_mask and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM


def lse_for_merge(lse: torch.Tensor) -> torch.Tensor:
    """cuDNN's float32 (B, H, Lq, 1) log-sum-exp as the merge's float32 (B, H, Lq) (a view)."""
    assert lse.dim() == 4 and lse.size(-1) == 1, f"cuDNN LSE should be (B, H, Lq, 1), got {tuple(lse.shape)}"
    return lse.squeeze(-1)


def lse_for_cudnn(lse: torch.Tensor) -> torch.Tensor:
    """The merge's (B, H, Lq) log-sum-exp (possibly a row slice) as the contiguous float32 (B, H, Lq, 1) the
    backward graph was built for."""
    return lse.to(torch.float32).contiguous().unsqueeze(-1)


def _cudnn_forward(q, k, v, is_causal: bool, scale: float | None):
    """The aten forward call, module-level so the CPU tests can stand a float64 reference in for it."""
    return aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, is_causal, False, scale=scale)


def _cudnn_backward(dout, q, k, v, out, lse, seed, offset, is_causal: bool, scale: float | None):
    """The aten backward call (dense path: no bias, no cumulative lengths), module-level like `_cudnn_forward`."""
    return aten._scaled_dot_product_cudnn_attention_backward.default(
        dout, q, k, v, out, lse, seed, offset, None, None, None, q.size(2), k.size(2), 0.0, is_causal, scale=scale)


class CudnnBlock:
    """fp16/bf16, no mask, GQA native. aux keeps the forward's philox seed and offset, which the backward schema
    asks for (dropout is 0, so they are placeholders)."""
    name = "cuda_cudnn"

    @staticmethod
    def _check(q, k, is_causal, mask):
        assert mask is None, "the cuDNN block takes no mask; the efficient kernel handles masked blocks"
        assert not is_causal or q.size(2) == k.size(2), (
            "cuDNN's causal mask is top-left, flash's bottom-right: they agree only on square blocks")

    def forward(self, q, k, v, *, is_causal, scale, mask):
        self._check(q, k, is_causal, mask)
        out, lse, _cum_q, _cum_k, _max_q, _max_k, seed, offset, _ = _cudnn_forward(q, k, v, is_causal, scale)
        return out, lse_for_merge(lse), (seed, offset)

    def backward(self, dout, q, k, v, out, lse, aux, *, is_causal, scale, mask):
        self._check(q, k, is_causal, mask)
        seed, offset = aux
        dq, dk, dv = _cudnn_backward(sdpa_output_layout(dout), q, k, v, sdpa_output_layout(out), lse_for_cudnn(lse),
                                     seed, offset, is_causal, scale)
        return dq, dk, dv
