"""The torch releases this project supports, and every torch API newer than the oldest of them that the product
(config/, data/, models/, parallelisms/, training/, train.py) calls, each behind one function with its fallback.

Supported: torch 2.11 (`OLDEST_TORCH`: GPU images ship 2.11.0+cu130) to 2.13 (`NEWEST_TESTED_TORCH`: the pin in
requirements.txt, which CI runs). train.py calls `exit_if_unsupported_torch` before its other imports, so an older
torch stops in one line before any process group starts; a newer one runs, after one warning line.

How the list below was made: every torch name the product references (imports, attribute chains from `torch`,
`dist`, ..., `getattr(dist, "...")`, the `torch.ops.aten` ops), every keyword argument it passes to a torch callable,
and the methods it calls on DeviceMesh (`_flatten`, `_unflatten`, `_concatenate`), DTensor, FSDPModule,
PipelineStage, the pipeline schedules and nn.Module were resolved, with their signatures, under the torch 2.11.0+cu130
wheel from PyPI (imported on CPU) and under the pin, and compared; the 2.12.0+cu130 wheel dates each API below.
Present in 2.11 and unchanged for the product's calls, among others: DCP's HuggingFaceStorageReader/Writer,
fully_shard / MixedPrecisionPolicy, the `_fully_shard` modules' `_get_device_handle` (training/planning), every
pipeline schedule name of config/schema.py, `torch._C._accelerator_getAccelerator`, `cudaHostRegister` /
`cudaHostUnregister` of `torch.cuda.cudart()`. Missing in 2.11, so wrapped here: `NEWER_TORCH_APIS`.
"""
from __future__ import annotations

import os
import re
import sys

import torch
import torch.distributed as dist

OLDEST_TORCH = (2, 11)
"""The oldest torch (major, minor) the product runs on: the GPU images' torch 2.11.0+cu130."""
NEWEST_TESTED_TORCH = (2, 13)
"""The newest torch (major, minor) tested: requirements.txt's pin (tests/test_torch_support.py keeps them equal)."""

NEWER_TORCH_APIS: tuple[tuple[str, str], ...] = (
    ("torch.accelerator.empty_host_cache", "empty_host_cache"),
    ("torch.distributed.all_gather_single", "all_gather_single"),
    ("torch.distributed.reduce_scatter_single", "reduce_scatter_single"),
)
"""(torch API missing in torch 2.11, the function here that calls it or its fallback): the product calls the
function, never the API (tests/test_torch_support.py scans the product's source for direct uses)."""


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.11.0+cu130" -> (2, 11), "2.12.0a0+git1234" -> (2, 12)); None
    when it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _dotted(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def unsupported_torch(version: str | None = None) -> str | None:
    """The one-line refusal of a torch older than `OLDEST_TORCH` (`version`: the installed torch.__version__ unless
    given), or None when it is supported or its version cannot be read."""
    version = torch.__version__ if version is None else version
    release = torch_release(version)
    if release is None or release >= OLDEST_TORCH:
        return None
    return (f"torch {version} is older than the oldest supported torch {_dotted(OLDEST_TORCH)} (tested up to "
            f"{_dotted(NEWEST_TESTED_TORCH)}); install torch>={_dotted(OLDEST_TORCH)} (requirements.txt pins "
            f"torch=={_dotted(NEWEST_TESTED_TORCH)}.0; TORCH_SPEC picks a CUDA build) or point PYTHON at an "
            "interpreter that has one")


def untested_torch(version: str | None = None) -> str | None:
    """The one-line warning for a torch newer than `NEWEST_TESTED_TORCH`, or None."""
    version = torch.__version__ if version is None else version
    release = torch_release(version)
    if release is None or release <= NEWEST_TESTED_TORCH:
        return None
    return (f"torch {version} is newer than the newest tested torch {_dotted(NEWEST_TESTED_TORCH)}; running on it "
            "(requirements.txt pins the tested one)")


def exit_if_unsupported_torch(version: str | None = None, warn: bool = True) -> None:
    """train.py's first step: exits with status 2 after one `error:` line (rank 0 prints it, as train.py prints a
    RecipeError) when torch is older than `OLDEST_TORCH`; prints one `warning:` line when it is newer than
    `NEWEST_TESTED_TORCH` from a process that torchrun did not start (run_train.sh's one-process --check, --dry-run,
    ...), so a launch warns once, not once per rank. `warn=False`: the refusal only (training/launcher.py, whose launch
    check loads train.py, which warns)."""
    refusal = unsupported_torch(version)
    if refusal:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {refusal}", file=sys.stderr)
        raise SystemExit(2)
    warning = untested_torch(version)
    if warning and warn and "LOCAL_RANK" not in os.environ:
        print(f"warning: {warning}", file=sys.stderr)


def empty_host_cache() -> None:
    """Gives the pinned blocks that torch's CachingHostAllocator keeps cached back to the OS (at an offload stage
    switch, parallelisms/activation_offload.py), so a previous ramp stage's host buffers stay pinned no longer.

    `torch.accelerator.empty_host_cache` came in torch 2.12 (2.11's torch/accelerator has no such name). Before it:
    `torch._C._host_emptyCache`, the CUDA host allocator's own empty-cache call, which torch 2.11 registers in its CUDA
    module (libtorch_python) and calls itself before a CUDA graph capture (torch/cuda/graphs.py): the same release on
    CUDA, at no extra cost. With neither (another accelerator on torch < 2.12) the cached pinned blocks stay pinned
    until the process ends: host memory only, no error. Without an accelerator nothing is cached (and on a CPU-only
    build the accelerator call raises), so nothing is called."""
    if not torch.accelerator.is_available():
        return
    release = getattr(torch.accelerator, "empty_host_cache", None)
    if release is not None:
        release()
    elif torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's `input` concatenated into `output`: `dist.all_gather_single` since torch 2.13 (which deprecates
    the older name with a FutureWarning per call), `dist.all_gather_into_tensor` before (2.11 and 2.12 have only
    that): the same collective under its older name, at no cost. Looked up per call, so a patched `dist` is seen."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum over ranks of `input`, this rank's slice into `output`: `dist.reduce_scatter_single` since torch 2.13,
    `dist.reduce_scatter_tensor` before (2.11 and 2.12): the same collective under its older name, at no cost."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)
