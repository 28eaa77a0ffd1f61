"""A CPU stand-in for NCCL's device rule: a process group serves only the device types it was created for.

Under NCCL the run's tensors live on the GPU and a bookkeeping tensor created without a device lands on the CPU, for
which an NCCL group has no backend ("No backend type associated with device type cpu"). On a CPU-only box the run's
device IS the CPU, so the mistake is invisible. This module makes it visible again:

- every tensor that the project's own code (not torch's) creates without naming a device lands on `meta` instead of
  the CPU: `meta` plays the part of "the default device that is not the run's device";
- every c10d collective refuses `meta` tensors with NCCL's message (their meta kernels normally accept them silently,
  for tracing).

A tensor created with `device=<the run's device>` is untouched, so correct code trains as usual. Run a script under
it with `python -m tests.nccl_device_rule SCRIPT [ARGS...]` (e.g. train.py under torchrun).
"""
from __future__ import annotations

import os
import runpy
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("allreduce_", "allreduce_coalesced_", "allgather_", "allgather_into_tensor_coalesced_",
               "_allgather_base_", "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
               "broadcast_", "reduce_", "gather_", "scatter_", "alltoall_", "alltoall_base_", "send", "recv_")


def _from_project(frame) -> bool:
    path = os.path.abspath(frame.f_code.co_filename)
    return path.startswith(ROOT) and os.sep + ".venv" + os.sep not in path and "site-packages" not in path


class UnnamedDeviceIsNotTheRunDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None and _from_project(sys._getframe(1)):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _refuse(*args, **kwargs):
    raise RuntimeError("No backend type associated with device type meta (NCCL-rule emulation: a tensor created "
                       "without naming the run's device reached a collective)")


def install() -> tuple:
    """Enters the mode for the rest of the process and replaces the collectives' meta kernels; returns both handles."""
    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
        for name in COLLECTIVES:
            library.impl(name, _refuse, "Meta")
    mode = UnnamedDeviceIsNotTheRunDevice()
    mode.__enter__()
    return mode, library


if __name__ == "__main__":
    handles = install()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
