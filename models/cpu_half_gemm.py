"""bf16 and fp16 GEMMs on a CPU without native half-precision kernels run as float32 GEMMs.

Why: torch sends a CPU bf16/fp16 matmul to oneDNN only on a CPU with AVX-512 (or AMX); on any other x86-64 CPU it
takes torch's portable fallback loop. Measured on a 2-core AVX2 box (torch 2.13, one thread, 256^3): float32 0.83 ms
(40.5 GFLOP/s, MKL), bf16 26.2 ms (1.3 GFLOP/s), fp16 26.8 ms: 31x. A bf16 run on such a CPU (FSDP2's bf16 mixed
precision, the one-device autocast path, float8's bf16 layers) then cost ten times a float32 one, and how long the
test suite took depended on which CPU it drew (the float8 learning test: 53 s on an AVX-512 box, over 600 s here).

What: the CPU kernels of `aten::mm`, `addmm`, `bmm` and `baddbmm` are replaced in this process by ones that, for
bf16/fp16 operands, compute the product in float32 (the half operands convert exactly) and round the result to the
operands' dtype once: what oneDNN's bf16 GEMM computes (float32 accumulation, one rounding of the output), up to the
order of the sums. Every other dtype goes to the same `.out` kernel torch's own op runs. Nothing changes on a CPU
whose torch has native half GEMMs (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`), on CUDA, or under fake tensors
(their kernels run before the CPU key). Compiled graphs call `mm.out` directly and are not rerouted.
"""
from __future__ import annotations

import warnings

import torch

HALF = (torch.bfloat16, torch.float16)


def native_half_gemm() -> bool:
    """Whether this CPU's torch runs bf16 GEMMs natively (oneDNN on AVX-512 / AMX, or an Arm CPU with bf16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: the portable loop
        return False


def _product(out_op, shape, tensors, **scalars) -> torch.Tensor:
    """`out_op(*tensors, **scalars, out=...)` into a new tensor of `shape`; half operands computed in float32."""
    dtype = tensors[-1].dtype
    if dtype in HALF and all(t.dtype == dtype for t in tensors):
        out = torch.empty(shape, dtype=torch.float32, device=tensors[0].device)
        out_op(*(t.float() for t in tensors), **scalars, out=out)
        return out.to(dtype)
    out = torch.empty(shape, dtype=dtype, device=tensors[0].device)
    return out_op(*tensors, **scalars, out=out)


def _mm(a, b):
    return _product(torch.ops.aten.mm.out, (a.shape[0], b.shape[1]), (a, b))


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return _product(torch.ops.aten.addmm.out, (a.shape[0], b.shape[1]), (bias, a, b), beta=beta, alpha=alpha)


def _bmm(a, b):
    return _product(torch.ops.aten.bmm.out, (a.shape[0], a.shape[1], b.shape[2]), (a, b))


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _product(torch.ops.aten.baddbmm.out, (a.shape[0], a.shape[1], b.shape[2]), (bias, a, b), beta=beta,
                    alpha=alpha)


def reroute_half_gemms(device_type: str):
    """On a CPU run whose torch has no native half GEMM, installs the float32 kernels above for this process and
    returns the registration (the caller keeps it: a torch.library.Library deregisters its kernels when collected);
    otherwise None."""
    if device_type != "cpu" or native_half_gemm():
        return None
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a registered kernel is overridden: that is the point here
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name, kernel in (("mm", _mm), ("addmm", _addmm), ("bmm", _bmm), ("baddbmm", _baddbmm)):
            library.impl(name, kernel, "CPU")
    return library
