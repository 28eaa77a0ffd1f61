"""Fake CUDA on a CPU-only build: the small C++ libraries that let FakeTensorMode's `cuda` tensors run the CUDA path.

FakeTensorMode makes `cuda` tensors on a CPU build (shapes, strides and the CUDA kernels' meta functions run, no
storage), but slicing one asks for a CUDA device guard, which a CPU build lacks, and autograd's backward asks for the
accelerator, its current streams and events. Two libraries, built by one builder:
- the guard (`load_fake_cuda_guard`): a no-op CUDA device guard, registered by loading it into this process; enough
  for one layer's attention forward and backward (training/planning/cuda_path_probe.py);
- the runtime (`fake_cuda_runtime`): a device guard with no-op streams and events on device 0 and CUDA hooks that
  report CUDA built and present (`torch.cuda.is_available()` stays False). The hooks are read once, when torch
  starts, so it must be preloaded (LD_PRELOAD, `fake_cuda_env`): the whole micro-step's probe
  (training/planning/step_sync_probe.py) and bench/bench_step_kernels.py run in a child process.

The builder caches each library in the temp folder under a key of its source, torch's version and torch's library
folder (`torch_library_path`).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import subprocess
import tempfile
import types

import torch

GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""

RUNTIME_SOURCE = r"""#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
using c10::Device; using c10::Stream;
struct FakeCudaGuard : c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> {
  Device getDevice() const override { return Device(c10::DeviceType::CUDA, 0); }
  Device exchangeDevice(Device) const override { return getDevice(); }
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(c10::DeviceType::CUDA, 0)); }
  Stream getNewStream(Device d, int) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  void record(void**, const Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
namespace at {
struct FakeCudaHooks : CUDAHooksInterface {
  FakeCudaHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks);
}
"""
RUNTIME_NAME = "fake_cuda_runtime"


def torch_library_path(name: str, source: str, torch_lib: str, torch_version: str) -> str:
    """Where library `name` built from `source` against the torch whose libraries are in `torch_lib` is cached:
    keyed by the source, torch's version AND that library folder. The build has an rpath to that folder, so a cache
    shared by two checkouts or virtual environments would otherwise hand one a library that points at the other's
    (possibly deleted) torch ("libc10.so: cannot open shared object file" once the other checkout was gone)."""
    digest = hashlib.sha256("\0".join((source, os.path.realpath(torch_lib), torch_version)).encode()).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"{name}_{torch_version.replace('+', '_')}_{digest[:12]}.so")


def build_torch_library(name: str, source: str, libs: list[str], timeout: float = 300) -> str:
    """Compiles `source` against this process's torch into its cached path (once) and returns the path; raises
    OSError / SubprocessError when it cannot (no compiler or headers)."""
    root = os.path.dirname(torch.__file__)
    torch_lib = os.path.join(root, "lib")
    lib = torch_library_path(name, source, torch_lib, torch.__version__)
    if not os.path.exists(lib):
        src = f"{lib[:-3]}.{os.getpid()}.cpp"  # per process: ranks and tests may build it at the same moment
        with open(src, "w") as f:
            f.write(source)
        try:
            subprocess.run(["g++", "-shared", "-fPIC", "-std=c++17", f"-I{root}/include", src, "-o", f"{src}.so",
                            f"-L{torch_lib}", *(f"-l{x}" for x in libs), f"-Wl,-rpath,{torch_lib}"],
                           check=True, capture_output=True, timeout=timeout)
            os.replace(f"{src}.so", lib)
        finally:
            os.remove(src)
    return lib


def load_fake_cuda_guard() -> str | None:
    """Registers the no-op CUDA device guard in this process (built once per torch), so fake CUDA tensors can be
    sliced and indexed on a CPU-only build. Returns None when it works, else why not (no compiler, no headers): the
    caller then skips its probe."""
    import ctypes

    try:
        lib = build_torch_library("fake_cuda_guard", GUARD_SOURCE, ["c10"], timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot build the no-op CUDA device guard ({type(e).__name__})"
    ctypes.CDLL(lib)  # registration is idempotent: the registry keeps one guard per device type
    return None


def fake_cuda_runtime() -> str:
    """The preloadable fake CUDA runtime library; raises when it cannot be built (no compiler or headers)."""
    return build_torch_library(RUNTIME_NAME, RUNTIME_SOURCE, ["c10", "torch_cpu"])


def fake_cuda_env(env: dict) -> dict:
    """`env` for a child process that runs on fake CUDA: the fake CUDA runtime preloaded."""
    preload = " ".join(x for x in (fake_cuda_runtime(), env.get("LD_PRELOAD", "")) if x)
    return dict(env, LD_PRELOAD=preload)


def fake_cuda_preloaded() -> bool:
    """Whether this process runs with the fake CUDA runtime preloaded (torch then reports CUDA as its accelerator)."""
    accelerator = torch._C._accelerator_getAccelerator()
    return RUNTIME_NAME in os.environ.get("LD_PRELOAD", "") and accelerator is not None and \
        accelerator.type == "cuda"


_FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")


@contextlib.contextmanager
def fsdp_streams_on_fake_cuda():
    """FSDP2 asks its device's module (`torch.cuda` on a cuda mesh) for the current device, streams and events, which
    a CPU build refuses. Until exit, its modules get torch.cpu's no-op streams and events, and device index 0, for
    "cuda": the ops FSDP issues (all-gathers, copies, reduce-scatters) are unchanged; only stream ordering is gone."""
    handle = types.SimpleNamespace(Stream=torch.cpu.Stream, Event=torch.cpu.Event, stream=torch.cpu.stream,
                                   current_stream=torch.cpu.current_stream, current_device=lambda: 0)
    modules = [importlib.import_module(f"torch.distributed.fsdp._fully_shard.{m}") for m in _FSDP_MODULES]
    saved = [m._get_device_handle for m in modules]
    for module, original in zip(modules, saved):
        module._get_device_handle = (lambda original: lambda device_type="cuda": handle if device_type == "cuda"
                                     else original(device_type))(original)
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module._get_device_handle = original
