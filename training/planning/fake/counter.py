"""The one dispatch counter of the planning probes: what a step launches, counted on fake (or real) tensors.

`DispatchCounter` is a dispatch mode that sees every aten op reaching the dispatcher and answers, from one pass:
- op kinds and bytes (`by_kind`, `bandwidth_bytes`, `kernels`): one aten op is one or more device kernels on a GPU
  (a GEMM one cuBLAS launch, a _foreach op one launch per chunk, fused AdamW a few multi-tensor launches); views,
  allocations, detach and prim/profiler records launch none ("no kernel"). The bytes are what an eager kernel reads
  and writes (each tensor input once, each output once; a view counts its whole tensor, an in-place op its tensor
  twice), so for the kinds priced by bandwidth their sum is the step's HBM traffic (training/planning/price.py);
- attention calls (`attention`, `by_kernel`, and with `record` every call's op, arguments and result);
- host syncs (`counts`, `syncs`) and, with `where`, the repository frame that made each one (`places`);
- host-to-device copies (`host_to_device`): from pageable memory each one waits for the queue to drain.

The device-to-host rule (one rule for every probe): the host waits for the device at a scalar read
(`aten._local_scalar_dense`: `.item()`, `bool()`, `int()`) of a tensor on the device, and at a copy whose source
is on the device and whose target is on the host. "The device" is every non-CPU device; with `strict` the CPU
stands in for it (a CPU-only run standing in for a GPU run), so scalar reads of any tensor count, and so do the
Python-level host reads of CPU tensors (`.cpu()`, `.numpy()`, `.tolist()`), which on a GPU would be copies. A scalar
read of a host tensor on a device run does not count: plans keep host integers (Ulysses' exchange plan reads them
with int()), and reading them never waits for the stream.

A sync is counted before its op runs: on fake tensors a read of a value fails right after it, counted and located.
"""
from __future__ import annotations

import collections
import contextlib
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.tile_loops import active_sampler

aten = torch.ops.aten

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

KERNEL_OF_OP = {getattr(aten, name).default: kernel for kernel, names in {
    "flash": ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_backward"),
    "efficient": ("_efficient_attention_forward", "_efficient_attention_backward",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
    "cpu_flash": ("_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "cudnn": ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
}.items() for name in names}
"""Every attention op the CP kernels call, by the kernel that runs it (flash: FlashAttention-2, or FA3/FA4 once
activated; cudnn: cuDNN's fused attention)."""

_COPIES = (aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default)
_HOST_READS = ("cpu", "numpy", "tolist")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
"""The repository root (this file is training/planning/fake/counter.py): frames anywhere in it are named."""
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")
"""Frames of the repository's own torch modes (context_parallel's routing): they pass calls on, never make them."""


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


def _tensor_bytes(x) -> int:
    """Bytes of every tensor in an op's arguments or result (nested in lists, tuples and dicts, as aten passes them):
    a loop of its own, as torch's pytree flattening took 12% of a probe's step."""
    if isinstance(x, torch.Tensor):
        try:
            return x.numel() * x.element_size()
        except Exception:  # noqa: BLE001 - a tensor subclass without sizes
            return 0
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_tensor_bytes(y) for y in x.values())
    return 0


def _where() -> str:
    """The innermost frame of this repository (not this module) that made the call: where to look for the sync."""
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_REPO) and frame.filename != here and frame.name not in _MODE_HOOKS and \
                "site-packages" not in frame.filename:  # a .venv in the checkout
            return f"{os.path.relpath(frame.filename, _REPO)}:{frame.lineno} {frame.name}"
    return "outside the repository"


def _copy_ends(func, args, kwargs) -> tuple:
    """(source device, target device) of a copy op, either None when it is not a tensor's."""
    device = lambda x: x.device if isinstance(x, torch.Tensor) else None  # noqa: E731
    source = device(args[1] if func is aten.copy_.default else args[0])
    target = kwargs.get("device") or (device(args[0]) if func is aten.copy_.default else None)
    if func is aten._to_copy.default and target is None:
        target = source
    return source, None if target is None else torch.device(target)


class DispatchCounter(TorchDispatchMode):
    """Counts what the code run inside it dispatches (see the module docstring). `strict`: the CPU stands in for
    the device; `where`: name the repository frame of every sync; `record`: keep every attention call."""

    def __init__(self, strict: bool = False, where: bool = False, record: bool = False):
        super().__init__()
        self.strict, self.record = strict, record
        self.calls: collections.Counter = collections.Counter()
        """{aten op: calls}."""
        self.bytes: collections.Counter = collections.Counter()
        """{aten op: bytes of its tensor inputs and outputs}."""
        self.counts: collections.Counter = collections.Counter()
        """{"_local_scalar_dense" | "device_to_host" | "host_read:<method>": host syncs}."""
        self.places: collections.Counter | None = collections.Counter() if where else None
        """With `where`: "<kind> at <file:line function>" -> count, the repository's frame that made each sync."""
        self.attention_calls: list = []
        """(op, args, kwargs, result) of every attention call, when recording."""
        self.by_kernel: dict[str, int] = {}
        """Attention calls per kernel (KERNEL_OF_OP)."""
        self.host_to_device = 0
        self._paused = 0
        self._tiles = None
        """The SampledTiles entered below this counter, if any (models/tile_loops.py): its weight scales every count."""
        self._host_reads = _HostReadCounter(self) if strict else None

    def __enter__(self):
        self._tiles = active_sampler()
        super().__enter__()
        if self._host_reads is not None:
            self._host_reads.__enter__()
        return self

    def __exit__(self, *exc):
        if self._host_reads is not None:
            self._host_reads.__exit__(*exc)
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def uncounted(self):
        """Ops inside are run, not counted (work the caller prices another way, e.g. casts that compile fuses)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def count_sync(self, kind: str) -> None:
        weight = self._weight()
        self.counts[kind] += weight
        if self.places is not None:
            self.places[f"{kind} at {_where()}"] += weight

    def _weight(self) -> int:
        """How many tiles or head groups the op now running stands for (models/tile_loops.py); 1 outside them."""
        return self._tiles.weight if self._tiles is not None else 1

    def _on_device(self, device: torch.device | None) -> bool:
        return device is not None and (self.strict or device.type != "cpu")

    def _count_transfers(self, func, args, kwargs) -> None:
        if func is aten._local_scalar_dense.default:
            if self._on_device(args[0].device):
                self.count_sync("_local_scalar_dense")
        elif func in _COPIES:
            source, target = _copy_ends(func, args, kwargs)
            if source is not None and target is not None and source.type != "cpu" and target.type == "cpu":
                self.count_sync("device_to_host")
            elif source is not None and target is not None and source.type == "cpu" and target.type != "cpu":
                self.host_to_device += self._weight()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = self._weight()  # a sampled tile or head group stands for `weight`; 0: a dry run's ballast
        if self._paused or weight == 0:
            return func(*args, **kwargs)
        self._count_transfers(func, args, kwargs)
        self.calls[func] += weight
        out = func(*args, **kwargs)
        self.bytes[func] += weight * (_tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out))
        if func in KERNEL_OF_OP:
            self.by_kernel[KERNEL_OF_OP[func]] = self.by_kernel.get(KERNEL_OF_OP[func], 0) + weight
            if self.record:
                self.attention_calls.append((func, args, kwargs, out))
        return out

    @property
    def ops(self) -> int:
        """Every aten op counted."""
        return sum(self.calls.values())

    @property
    def attention(self) -> int:
        """Attention kernel calls (KERNEL_OF_OP)."""
        return sum(self.by_kernel.values())

    @property
    def syncs(self) -> int:
        """Host syncs of every kind."""
        return sum(self.counts.values())

    def by_kind(self) -> dict:
        ops, moved = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
        for func, n in self.calls.items():
            k = kind_of(func)
            ops[k] += n
            moved[k] += self.bytes[func]
        return {"ops": ops, "bytes": moved, "total_ops": self.ops, "total_bytes": sum(self.bytes.values()),
                "per_op": {str(f): n for f, n in self.calls.items()}}

    def bandwidth_bytes(self) -> int:
        """Bytes of the ops priced by HBM bandwidth (BANDWIDTH_KINDS)."""
        return sum(n for func, n in self.bytes.items() if kind_of(func) in BANDWIDTH_KINDS)

    def kernels(self) -> int:
        """Ops that launch at least one kernel."""
        return sum(n for func, n in self.calls.items() if kind_of(func) != "no kernel")


class _HostReadCounter(TorchFunctionMode):
    """Host reads of CPU tensors under `strict` (no dispatch happens for them, so only the Python call is seen)."""

    def __init__(self, counter: DispatchCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.counter.count_sync(f"host_read:{name}")
        return func(*args, **(kwargs or {}))
