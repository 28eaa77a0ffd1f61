"""Device parametrization of the GPU tier: every test body is device-agnostic and runs once per device.

The "cuda" variant carries the `gpu` marker (selected by `./run_tests.sh --gpu`, deselected by the normal tiers); the
"cpu" variant runs in the normal tiers and proves the test's own logic on a machine without GPUs: in the fast tier
when it stays in one process (`FAST_CPU`), in the slow tier when it launches processes (`SLOW_CPU`).
"""
from __future__ import annotations

import os

import pytest
import torch

GPU_TEST_LIMIT_S = int(os.environ.get("GPU_TEST_LIMIT_S", "120"))
"""Every cuda variant finishes within this or fails at it (pytest-timeout's marker, which outranks `--timeout`); the
GPU report (harness/gpu_report.py) sets it per file, below that file's limit, so a hung test dumps its stacks before
the file is ended. 120 s by default: on the first H200 (bench/measurements/h200_gpu_report_2026-12-04) the longest
test took 54 s with four other test files sharing the GPU. A test that runs ranks in threads or processes gives
them `RANKS_LIMIT_S`, so a hung rank fails with its own stack before that."""
RANKS_LIMIT_S = max(10, GPU_TEST_LIMIT_S - 20)
_CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.timeout(GPU_TEST_LIMIT_S)])
FAST_CPU = [pytest.param("cpu", id="cpu"), _CUDA]
SLOW_CPU = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow), _CUDA]
CUDA_ONLY = [_CUDA]


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require(device: str, ranks: int = 1) -> torch.device:
    """The torch device a variant runs on; skips a CUDA variant when fewer than `ranks` GPUs are visible (a CPU
    variant runs its ranks as processes or threads on the CPU)."""
    if device == "cuda":
        have = visible_gpus()
        if have < ranks:
            pytest.skip(f"needs {ranks} GPU(s), {have} visible" if have else "no GPU visible")
    return torch.device(device)
