"""What a step launches, counted on fake tensors: every aten op that reaches the dispatcher, by kind, with the bytes
of its tensor inputs and outputs.

One aten op reaching the dispatcher is one or more device kernels on a GPU (a GEMM one cuBLAS launch, a _foreach op
one launch per chunk of tensors, fused AdamW a few multi-tensor launches). Ops that launch nothing (views, detach,
allocations, prim/profiler records, reading a CPU scalar) go to the "no kernel" kind. The bytes are what an eager
kernel reads and writes: an elementwise op reads each input once and writes its output once, so for the kinds the
step model prices by bandwidth ("elementwise/other" and "copy/cast") their sum is the step's HBM traffic (a view
counts its whole tensor; an in-place op counts its tensor as input and as output).

Used by the dry run's memory probe (training/planning/memory_probe.py), which prices an eager step's elementwise
work from these bytes (training/planning/price.py), and by bench/bench_step_kernels.py, which compares our
step with the plain transformers loop (issue 36).
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("gemm", "attention", "copy/cast", "optimizer", "collective", "elementwise/other", "no kernel")
BANDWIDTH_KINDS = ("copy/cast", "elementwise/other")
"""The kinds whose time is their bytes over HBM bandwidth (the step model prices GEMMs, attention, the optimizer and
collectives from their own rates)."""
NO_KERNEL_OPS = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                 "lift_fresh", "_local_scalar_dense", "resize_", "set_", "record_stream"}
GEMM_OPS = {"mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "_grouped_mm", "_scaled_mm",
            "addmv", "mv", "dot"}
COPY_OPS = {"_to_copy", "copy_", "clone", "contiguous", "copy", "_copy_from", "_copy_from_and_resize",
            "to", "lift_fresh_copy"}


def kind_of(func) -> str:
    """The kind of one aten op (an OpOverload): by its packet name and namespace."""
    ns = getattr(func, "namespace", "")
    name = getattr(func, "_opname", None) or str(func).split("::")[-1].split(".")[0]
    return kind_of_name(ns, name, bool(getattr(func, "is_view", False)))


def kind_of_name(namespace: str, name: str, is_view: bool = False) -> str:
    """The kind of an op given by namespace and packet name (e.g. "aten", "mm"), as kind_of rules it; the profiled
    step (training/step_profile.py) uses it on profiler event names, which carry no OpOverload."""
    if namespace in ("prim", "profiler") or name in NO_KERNEL_OPS or is_view:
        return "no kernel"
    if namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
        return "collective"
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash" in name or "efficient_attention" in name or "cudnn_attention" in name:
        return "attention"
    if name.startswith("_foreach_") or name.startswith("_fused_adam"):
        return "optimizer"
    if name in COPY_OPS:
        return "copy/cast"
    return "elementwise/other"


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except Exception:  # noqa: BLE001 - a tensor subclass without sizes
        return 0


class OpCensus(TorchDispatchMode):
    """Counts every aten op and the bytes of its tensor inputs + outputs, per op and per kind (KINDS)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.bytes = collections.Counter()
        self.paused = 0

    @contextlib.contextmanager
    def uncounted(self):
        """Ops inside are run, not counted (work the caller prices another way, e.g. casts that compile fuses)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        flat = tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]
        self.ops[func] += 1
        self.bytes[func] += sum(_nbytes(x) for x in flat if isinstance(x, torch.Tensor))
        return out

    def by_kind(self) -> dict:
        ops = dict.fromkeys(KINDS, 0)
        moved = dict.fromkeys(KINDS, 0)
        for func, n in self.ops.items():
            k = kind_of(func)
            ops[k] += n
            moved[k] += self.bytes[func]
        return {"ops": ops, "bytes": moved, "total_ops": sum(self.ops.values()),
                "total_bytes": sum(self.bytes.values()), "per_op": {str(f): n for f, n in self.ops.items()}}

    def bandwidth_bytes(self) -> int:
        """Bytes of the ops priced by HBM bandwidth (BANDWIDTH_KINDS)."""
        return sum(n for func, n in self.bytes.items() if kind_of(func) in BANDWIDTH_KINDS)

    def kernels(self) -> int:
        """Ops that launch at least one kernel."""
        return sum(n for func, n in self.ops.items() if kind_of(func) != "no kernel")
