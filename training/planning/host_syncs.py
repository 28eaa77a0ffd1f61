"""Counting the points where the host would wait for the device (issue 27): `.item()` / `bool()` / `int()` of a
device tensor (aten._local_scalar_dense; of any tensor with `strict`), device-to-host copies (`.cpu()`, `.to("cpu")`, `.tolist()` of a device tensor),
and, on a CPU-only run standing in for a GPU run (`strict`), the host reads of any tensor (`.cpu()`, `.numpy()`,
`.tolist()`), which on the GPU would be reads of a device tensor.

Use it around the code whose syncs you count; the dry run on fake CUDA tensors counts the same way (its tensors are
on "cuda", so `strict` is not needed there):

    with HostSyncCounter(strict=True) as syncs:
        step.micro_step(setup, batch, tokens)
    syncs.total, syncs.counts   # Counter of "_local_scalar_dense", "device_to_host", "host_read:<method>"
"""
from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_COPIES = (aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default)
_HOST_READS = ("cpu", "numpy", "tolist")


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root (this file is training/planning/host_syncs.py): frames anywhere in it are named."""
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")
"""Frames of the repository's own torch modes (context_parallel's routing): they pass calls on, never make them."""


def _where() -> str:
    """The innermost frame of this repository (not this module) that made the call: where to look for the sync."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_REPO) and not frame.filename.endswith("host_syncs.py") and \
                frame.name not in _MODE_HOOKS and "site-packages" not in frame.filename:  # a .venv in the checkout
            return f"{os.path.relpath(frame.filename, _REPO)}:{frame.lineno} {frame.name}"
    return "outside the repository"


def _device_of(value) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, places: collections.Counter | None, host_scalars: bool):
        super().__init__()
        self.counts, self.places = counts, places
        self.host_scalars = host_scalars
        """Count scalar reads of CPU tensors too (strict: CPU stands in for the device); else only of device
        tensors, since reading a host tensor (a plan's host integers) does not wait for the device."""

    def count(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.places is not None:
            self.places[f"{kind} at {_where()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if self.host_scalars or args[0].device.type != "cpu":
                self.count("_local_scalar_dense")
        elif func in _COPIES:
            source = _device_of(args[1] if func is aten.copy_.default else args[0])
            target = kwargs.get("device") or (_device_of(args[0]) if func is aten.copy_.default else None)
            if func is aten._to_copy.default and target is None:
                target = source
            if source is not None and source.type != "cpu" and target is not None and \
                    torch.device(target).type == "cpu":
                self.count("device_to_host")
        return func(*args, **kwargs)


class _HostReadCounter(TorchFunctionMode):
    """Host reads of CPU tensors (no dispatch happens for them, so only the Python call can be seen)."""

    def __init__(self, counter: _DispatchCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.counter.count(f"host_read:{name}")
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """A context manager counting host syncs of the code run inside it (see the module docstring)."""

    def __init__(self, strict: bool = False, where: bool = False):
        self.strict = strict
        self.counts: collections.Counter = collections.Counter()
        self.places: collections.Counter | None = collections.Counter() if where else None
        """With `where`: "<kind> at <file:line function>" -> count, the repository's frame that made each sync."""
        self._modes: list = []

    def __enter__(self) -> "HostSyncCounter":
        dispatch = _DispatchCounter(self.counts, self.places, host_scalars=self.strict)
        self._modes = [dispatch]
        if self.strict:
            self._modes.append(_HostReadCounter(dispatch))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
