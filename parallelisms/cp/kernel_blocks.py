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
  instead (CudnnBlock below: GQA native, its own LSE layout). Schemas, layouts and strides are checked on meta / fake
  CUDA tensors in the CPU tiers; the numbers on a GPU by `./run_tests.sh --gpu`.
Blocks with `is_causal=True` always have Lq == Lk, so top-left (CPU) and bottom-right (CUDA flash) alignment agree.
Every kernel returns lse as float32 (B, H, Lq). The CP variants never pass a mask: document masking is computed as
mask-free pieces (plan_pieces.py), so half-precision runs with documents get CUDA flash too. The mask path stays for
callers with a genuinely dense mask. On CUDA flash the CP variants put all pieces of one block into at most two
varlen calls (kernel_varlen.py); these per-piece kernels serve CPU, the efficient kernel and undivided blocks.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from config.errors import Refusal
from config.schema import AttentionKernel, choices

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


def philox_placeholders(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) a dropout-free backward is handed when its forward's were not kept (the registered CP op's
    backward, cp/op_variants.py): int64 zeros on q's device, seed (2,), offset (). Every call here passes dropout_p
    0.0 (tests/parallelisms/test_cudnn_block.py), where torch 2.11's flash, cuDNN and efficient backwards never read
    them (the source lines: docs/gpu_step.md, "The op's backward gets no kernel auxiliaries")."""
    return (torch.zeros(2, dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64, device=q.device))


def sdpa_output_layout(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) over (B, L, H, D) memory: how the fused CUDA kernels write their output, and how the efficient
    backward READS it (its kernel derives out's row stride as num_heads * head_dim, whatever strides the tensor
    claims). The ring hands backward a merged output in (B, H, L, D) memory, sliced by rows: re-lay it out."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def grad_out_layout(dout: torch.Tensor) -> torch.Tensor:
    """The attention output's gradient as the device's backward kernels read it without a copy of their own. On CUDA
    `sdpa_output_layout`: flash, cuDNN and the efficient kernel read dout in out's layout, and the model's gradient
    arrives so already (the output's transpose back to (B, L, H, D) makes it a view of (B, L, H, D) memory): no copy
    for a whole-row dout or a row slice at batch 1. A contiguous (B, H, L, D) dout, as the CP op made before, cost
    one copy there and a second in each kernel call, back to this layout. On CPU contiguous (B, H, L, D), as the
    CPU flash kernel has always been given."""
    return sdpa_output_layout(dout) if dout.device.type == "cuda" else dout.contiguous()


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
        cum_q, cum_k, max_q, max_k, rng_state, unused = aux or (None, None, q.size(2), k.size(2),
                                                                 *philox_placeholders(q))
        return aten._scaled_dot_product_flash_attention_backward.default(
            sdpa_output_layout(dout), q, k, v, sdpa_output_layout(out), lse.contiguous(), cum_q, cum_k, max_q, max_k,
            0.0, is_causal, rng_state, unused, scale=scale)


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
        seed, offset = aux or philox_placeholders(q)
        n_heads, n_kv, lq = q.size(1), k.size(1), q.size(2)
        padded_rows = math.ceil(lq / self.LSE_ROW_ALIGN) * self.LSE_ROW_ALIGN
        lse = F.pad(lse, (0, padded_rows - lq)).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            sdpa_output_layout(dout), q, _expand_heads(k, n_heads), _expand_heads(v, n_heads),
            self._bias(mask, n_heads), sdpa_output_layout(out), lse, seed, offset, 0.0, [True, True, True, False],
            is_causal, scale=scale)
        return dq, _fold_heads(dk, n_kv), _fold_heads(dv, n_kv)


# ---- cuDNN fused attention (kernel_for(..., prefer="cudnn")) ----
# One attention block on cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention` + `_backward`): on Hopper
# it runs about twice as fast as the FlashAttention-2 kernels behind `CudaFlashBlock`; like them it is called as the
# aten primitive (the module docstring says why not `F.scaled_dot_product_attention`).
#
# Facts this block relies on, re-checked. Python side in torch 2.13.0+cpu and torch 2.11.0+cu130; CUDA side in
# aten/src/ATen/native/cudnn/MHA.cpp and transformers/cuda/sdp_utils.cpp of
# a stored recent PyTorch snapshot (not pinned to the v2.11.0 / v2.13 tags: re-check on a GPU, see the last line).
# - Schemas are identical in 2.11 and 2.13 (compared at run time): forward `(query, key, value, attn_bias?,
#   compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None) -> (output, logsumexp,
#   cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)`; backward `(grad_out, query, key,
#   value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
#   is_causal, *, scale=None) -> (dq, dk, dv)`. `attn_bias` / `cum_seq_*` are non-optional Tensors in the backward
#   schema, but None goes through as an undefined tensor (the dense path; the forward returns None for cum_seq_*).
# - LSE: float32 (B, Hq, Lq, 1), contiguous. Meta kernels: torch/_meta_registrations.py:6219-6260 (2.13) and
#   :5893-5934 (2.11). MHA.cpp run_cudnn_SDP_fprop: `at::empty({b, h, s_q, 1}, ...kFloat)` (with the experimental
#   TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 it is (B, Lq, H, 1) memory instead: not supported here). Natural log: torch's
#   own context parallel merges this LSE with the same natural-log formula as flash's
#   (torch/distributed/tensor/experimental/_context_parallel/_attention.py:151-187 in 2.13, cuDNN note at :154).
#   `lse_for_merge` / `lse_for_cudnn` are the one place converting to and from the merge's (B, H, Lq).
# - Output: allocated in the stride order of `query` (meta `alloc_with_matching_layout`, 2.13 :6197-6216, 2.11
#   :5874-5890; MHA.cpp the same); dq/dk/dv are `empty_like(query/key/value)` (meta backward, 2.13 :6600-6625, 2.11
#   :6243-6269).
# - Causal: the dense path asks cuDNN for a TOP-LEFT causal mask (MHA.cpp: `is_causal ? CausalMask::TOP_LEFT`),
#   flash aligns bottom-right. The ring's causal blocks are squares (Lq == Lk), where the two agree: asserted below.
# - dtypes: fp16 / bf16 only (MHA.cpp builds the graph with io type HALF or BFLOAT16). No mask here: the ring never
#   passes one, and cuDNN's bias path is left to the efficient kernel.
# - Head dim: a multiple of 8 and at most 128 (sdp_utils.cpp check_cudnn_tensor_shapes; 256 only on SM 9.0 with
#   cuDNN >= 9.10, which `kernel_for` cannot see, so it stays at 128).
# - GQA: native. The dense graph describes K and V by their own sizes and strides (MHA.cpp build_graph:
#   `K_->set_dim(k.sizes())`), and dK / dV come back with K/V's heads, so K/V are never expanded. The cuDNN backend
#   has taken K/V head counts that divide Q's since before 2.11 (pytorch/pytorch#139586, #150337).
# - Strides: the graphs are cached by the sizes and strides of q, k, v, out, grad_out and the LSE (MHA.cpp MHAParams),
#   and cuDNN < 9.5.1 needs grad_out laid out exactly like out (MHA.cpp run_cudnn_SDP_bprop). So the backward always
#   gets out AND grad_out in (B, H, L, D) over (B, L, H, D) memory (`sdpa_output_layout`, the layout the forward writes
#   for the trainer's (B, L, H, D) projections) and the LSE as contiguous float32 (B, H, Lq, 1): one graph per block
#   shape, no silent re-layout inside the op.
# The numbers of the real kernel (GQA and causal included) are checked on a GPU by tests/gpu/test_gpu_block_kernels.py
# (`./run_tests.sh --gpu`); this box has none.

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
    asks for (dropout is 0, so they are placeholders). Causal blocks are squares (Lq == Lk): the all-gather fuses
    only full rectangles (its causal diagonal stays a square), so cuDNN's top-left alignment is the right one, and a
    causal rectangle here would be a bug upstream (asserted). A block with one query or key row goes to flash: torch's
    own dispatcher refuses cuDNN there (sdp_utils.cpp), and the zigzag half of a 2-token shard is such a block."""
    name = "cuda_cudnn"

    @staticmethod
    def _flash_instead(q, k, is_causal, mask) -> bool:
        assert mask is None, "the cuDNN block takes no mask; the efficient kernel handles masked blocks"
        assert not is_causal or q.size(2) == k.size(2), (
            f"a causal cuDNN block must be square (top-left alignment), got Lq {q.size(2)} and Lk {k.size(2)}")
        return min(q.size(2), k.size(2)) <= 1

    def forward(self, q, k, v, *, is_causal, scale, mask):
        if self._flash_instead(q, k, is_causal, mask):
            return CudaFlashBlock().forward(q, k, v, is_causal=is_causal, scale=scale, mask=mask)
        out, lse, _cum_q, _cum_k, _max_q, _max_k, seed, offset, _ = _cudnn_forward(q, k, v, is_causal, scale)
        return out, lse_for_merge(lse), (seed, offset)

    def backward(self, dout, q, k, v, out, lse, aux, *, is_causal, scale, mask):
        if self._flash_instead(q, k, is_causal, mask):
            return CudaFlashBlock().backward(dout, q, k, v, out, lse, aux, is_causal=is_causal, scale=scale, mask=mask)
        seed, offset = aux or philox_placeholders(q)
        dq, dk, dv = _cudnn_backward(sdpa_output_layout(dout), q, k, v, sdpa_output_layout(out), lse_for_cudnn(lse),
                                     seed, offset, is_causal, scale)
        return dq, dk, dv


FLASH_MAX_HEAD_DIM = 256  # CUDA flash attention has kernels up to this head dim


# ---- which kernel family a run uses (`[parallelism] attention_kernel`) ----
# "flash" is torch's own flash ops (FlashAttention-2 on CUDA, the flash-CPU op on CPU). "fa3" / "fa4" run the same
# ops after `torch.nn.attention.activate_flash_attention_impl("FA3"/"FA4")` re-registered their CUDA kernels
# process-wide (torch/nn/attention/_fa3.py, _fa4.py in 2.11 and 2.13: FA3 from the `flash_attn_interface` module on
# SM 9.0, FA4 from `flash_attn.cute.interface` on SM 9.0 / 10.0; same LSE layout as FA2), so the block and varlen
# calls below do not change. "cudnn" sends dense half-precision blocks to CudnnBlock; packed documents stay on the
# flash ops (the varlen calls), as cuDNN's varlen backward fails in torch 2.11 (illegal memory access; fixed after
# 2.13's branch cut). cuDNN's fused attention needs SM 8.0+ (sdp_utils.cpp check_cudnn_hardware_support); "auto"
# takes it where torch itself prefers it (SM 9.x / 10.x with cuDNN > 9.15 and the backend enabled: Hopper, where it
# is about twice FlashAttention-2's speed), never under deterministic algorithms, and FA2 elsewhere.
ATTENTION_KERNELS = choices(AttentionKernel)
"""What `[parallelism] attention_kernel` and the CP API's `attention_kernel=` accept: "auto" and the concrete ones."""
CONCRETE_KERNELS = ("flash", "cudnn", "fa3", "fa4")
FLASH_IMPLEMENTATIONS = {"fa3": ("FA3", "flash_attn_interface", (9,)),
                         "fa4": ("FA4", "flash_attn.cute.interface", (9, 10))}
"""kernel -> (torch's registry name, the Python module that provides it, the SM majors it runs on)."""
CUDNN_MIN_CAPABILITY = (8, 0)
AUTO_CUDNN_CAPABILITY = (9, 0)


AUTO_CUDNN_MAJORS = (9, 10)
AUTO_CUDNN_MIN_VERSION = 91500
"""torch's own conditions for preferring cuDNN's attention (sdp_utils.cpp: SM 9.x / 10.x and cuDNN > 9.15, with
the cuDNN SDPA backend enabled); "auto" takes cuDNN only where torch itself would."""
AVOID_RECOMPILE_VARIABLE = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"


def concrete_kernel(asked: str, device_type: str, capability: tuple[int, int] | None,
                    cudnn_version: int | None = None, cudnn_sdp_enabled: bool = True,
                    deterministic: bool = False) -> str:
    """The kernel family `asked` means on this device: "auto" is cuDNN where torch itself prefers it (SM 9.x / 10.x,
    cuDNN > 9.15, its SDPA backend enabled; `cudnn_version` None: not known, as on a fake CUDA device, where the
    capability is None too) and flash elsewhere (A100, CPU). Under `torch.use_deterministic_algorithms(True)`
    (`deterministic`) "auto" is flash: cuDNN's attention backward is not deterministic."""
    if asked != "auto":
        return asked
    if device_type != "cuda" or capability is None or deterministic or not cudnn_sdp_enabled:
        return "flash"
    if tuple(capability) < AUTO_CUDNN_CAPABILITY or capability[0] not in AUTO_CUDNN_MAJORS:
        return "flash"
    if cudnn_version is not None and cudnn_version <= AUTO_CUDNN_MIN_VERSION:
        return "flash"
    return "cudnn"


def kernel_problem(asked: str, device_type: str, capability: tuple[int, int] | None, cudnn_available: bool,
                   module_found) -> str | None:
    """Why this device cannot run the kernel family `asked` (None: it can). `module_found(name)` says whether a
    Python module is installed (importlib.util.find_spec in the trainer)."""
    if (device_type == "cuda" and concrete_kernel(asked, device_type, capability) == "cudnn"
            and os.environ.get(AVOID_RECOMPILE_VARIABLE, "0") not in ("", "0")):
        return (f"{AVOID_RECOMPILE_VARIABLE}=1 makes torch read cuDNN's log-sum-exp as (B, Lq) rows instead of "
                f"(B, H, Lq) (wrong gradients for batch > 1); unset it")
    if asked in ("auto", "flash"):
        return None
    if device_type != "cuda":
        return f"{asked!r} runs on CUDA GPUs and this run is on {device_type}"
    if asked == "cudnn":
        if not cudnn_available:
            return "this torch has no cuDNN"

        if capability is not None and tuple(capability) < CUDNN_MIN_CAPABILITY:
            return (f"cuDNN's fused attention needs compute capability 8.0+, this GPU has "
                    f"{capability[0]}.{capability[1]}")
        return None
    registry_name, module, majors = FLASH_IMPLEMENTATIONS[asked]
    if capability is not None and capability[0] not in majors:
        return (f"{registry_name} runs on compute capability {' / '.join(f'{m}.0' for m in majors)}, this GPU has "
                f"{capability[0]}.{capability[1]}")
    if not module_found(module):
        return f"{registry_name} needs the `{module}` module, which is not installed"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `index`, read once per process."""
    return tuple(torch.cuda.get_device_capability(index))


def family_on(asked: str, device: torch.device) -> str:
    """The concrete kernel family on `device` (`concrete_kernel` with that device's capability, cuDNN version, the
    SDPA cuDNN switch and the deterministic-algorithms flag, read at the call: a user may flip the last two)."""
    if asked != "auto" or device.type != "cuda" or not torch.cuda.is_available():  # fake CUDA: no capability
        return concrete_kernel(asked, device.type, None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return concrete_kernel(asked, "cuda", _cuda_capability(index), torch.backends.cudnn.version(),
                           torch.backends.cuda.cudnn_sdp_enabled(), torch.are_deterministic_algorithms_enabled())


def kernel_family(asked: str, q: torch.Tensor) -> str:
    """The concrete kernel family of a call on `q`'s device."""
    return family_on(asked, q.device)


def sdpa_priority(asked: str, device: torch.device):
    """A context running torch's own SDPA calls with the family's backend order (the model's attention when no CP
    context routes it: cp = 1 without documents); nothing on CPU, where there is one kernel."""
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(sdpa_backends(family_on(asked, device)), set_priority=True)


def sdpa_backends(kernel: str) -> list:
    """torch SDPA's backends in the order the kernel family wants them (Ulysses' one whole-sequence call, which
    torch's own dispatcher serves): cuDNN first for "cudnn", and not at all otherwise."""
    from torch.nn.attention import SDPBackend

    flash_first = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.CUDNN_ATTENTION, *flash_first] if kernel == "cudnn" else flash_first


def module_installed(module: str) -> bool:
    """Whether a Python module (dotted name) can be imported here, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


def runnable_kernels(device: torch.device) -> list[str]:
    """The concrete families this device can run (on CPU every family is the flash-CPU op: "flash" stands for it)."""
    if device.type != "cuda":
        return ["flash"]
    capability = tuple(torch.cuda.get_device_capability(device))
    return [k for k in CONCRETE_KERNELS
            if kernel_problem(k, "cuda", capability, torch.backends.cudnn.is_available(), module_installed) is None]


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, needs_mask: bool, *, prefer: str = "flash"):
    """CPU flash on CPU; on CUDA flash for half precision without a mask (head dim a multiple of 8, at most 256),
    else memory-efficient. `prefer="cudnn"` takes cuDNN's fused attention (CudnnBlock, about twice flash's speed
    on Hopper) wherever it serves the case, and the same choice as "flash" elsewhere; "fa3"/"fa4" are the flash
    ops (re-registered by flash_impls.activate_flash_implementation)."""
    if prefer not in CONCRETE_KERNELS:
        raise Refusal(f"attention kernel {prefer!r} is none of {CONCRETE_KERNELS} (resolve 'auto' with "
                      "concrete_kernel first)")
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


def choose_block_kernel(q: torch.Tensor, needs_mask: bool, kernel: str = "flash"):
    """The block kernel for `q`'s device, dtype and head dim under the run's concrete kernel family."""
    return kernel_for(q.device.type, q.dtype, q.size(-1), needs_mask, prefer=kernel)
