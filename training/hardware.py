"""Device and backend chosen at run time, the peak FLOP/s MFU is measured against, and memory readings."""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import torch

from config.accelerators import part_of

@dataclass
class Device:
    type: str        # "cuda" or "cpu"
    backend: str     # "nccl" or "gloo"
    torch_device: torch.device


def pick_device(local_rank: int, local_world_size: int) -> Device:
    """CUDA + NCCL when a GPU is visible, else CPU + gloo with the cores split between the local ranks."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return Device("cuda", "nccl", torch.device("cuda", torch.cuda.current_device()))
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    if torch.get_num_threads() != threads:  # a redundant call still costs: the CPU flash backward then runs ~18% slower
        torch.set_num_threads(threads)
    return Device("cpu", "gloo", torch.device("cpu"))


def measure_gemm_peak(dtype: torch.dtype, device: torch.device, size: int = 1024, seconds: float = 0.6) -> float:
    """FLOP/s of a square matmul in the run's dtype: the CPU 'physical limit' MFU is measured against.

    The fastest single matmul over the window counts, not the average: another process briefly taking the core
    (common at start-up, when every rank loads at once) must not make the peak look small and MFU exceed 100%.
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):
        a @ b
    fastest, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * size**3 / fastest


def peak_flops(device: Device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s per rank, where the number came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        part = part_of(name)  # the accelerator table's dense bf16 peak of this part (config/accelerators.py)
        if part is not None:
            scale = 0.5 if dtype == torch.float32 else 1.0  # TF32 tensor cores run at half the bf16 rate
            return part.bf16_flops * scale, f"table:{part.spelling}"
        return measure_gemm_peak(dtype, device.torch_device, size=4096), f"measured-gemm:{name}"
    return measure_gemm_peak(dtype, device.torch_device), f"measured-cpu-gemm:{str(dtype).replace('torch.', '')}"


def peak_memory_gib(device: Device) -> float:
    """Peak allocated bytes on the GPU, or the process's peak resident set on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
