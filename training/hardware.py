"""Device and backend chosen at run time, the peak FLOP/s MFU is measured against, and memory readings."""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass

import torch

from config.accelerators import part_of
from training.checkpoint_files import write_json_atomically

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


def peak_flops(device: Device, dtype: torch.dtype, cache_dir: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s per rank, where the number came from). On CPU the measured peak is kept in
    `cache_dir`/cpu_gemm_peak.json (data.cache_dir) for the next runs on the same CPU, dtype, thread count and torch."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        part = part_of(name)  # the accelerator table's dense bf16 peak of this part (config/accelerators.py)
        if part is not None:
            scale = 0.5 if dtype == torch.float32 else 1.0  # TF32 tensor cores run at half the bf16 rate
            return part.bf16_flops * scale, f"table:{part.spelling}"
        return measure_gemm_peak(dtype, device.torch_device, size=4096), f"measured-gemm:{name}"
    source = f"measured-cpu-gemm:{str(dtype).replace('torch.', '')}"
    if cache_dir is None:
        return measure_gemm_peak(dtype, device.torch_device), source
    return CpuPeakCache(cache_dir).peak(dtype, device.torch_device), source


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


class CpuPeakCache:
    """The CPU GEMM peak, measured once per (CPU model, dtype, threads, torch) and then read from a JSON file.

    Measuring costs each rank 0.6 s of a busy core at every start (0.78 CPU-s in float32 here): in a test suite of a
    thousand short runs, minutes of CPU for the same number again. The peak only scales the MFU column on a CPU, so a
    number from an earlier run of the same machine serves as well; a new CPU, dtype, thread count or torch measures
    again."""

    FILE = "cpu_gemm_peak.json"

    def __init__(self, cache_dir: str):
        self.path = os.path.join(cache_dir, self.FILE)

    @staticmethod
    def key(dtype: torch.dtype) -> str:
        return f"{_cpu_model()} | {str(dtype).replace('torch.', '')} | threads {torch.get_num_threads()} | " \
               f"torch {torch.__version__}"

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                table = json.load(f)
            return table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            return {}

    def peak(self, dtype: torch.dtype, device: torch.device) -> float:
        key = self.key(dtype)
        known = self._read().get(key)
        if isinstance(known, (int, float)) and known > 0:
            return float(known)
        measured = measure_gemm_peak(dtype, device)
        try:  # ranks of one run may measure at once: the last rename wins, a lost race only measures again later
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            write_json_atomically(self.path, {**self._read(), key: measured})
        except OSError:  # a read-only cache folder: measure every time, as before
            pass
        return measured


def peak_memory_gib(device: Device) -> float:
    """Peak allocated bytes on the GPU, or the process's peak resident set on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return peak_host_gib()


def peak_host_gib() -> float:
    """This process's peak resident set in GiB (ru_maxrss, KiB on Linux): the host side of a step, which is where
    `training.cpu_offload` keeps the whole training state and activation offload its block inputs; the dry run
    predicts it per rank (dry_run.json `host_peak_gib_per_rank`) and the GPU report holds the two side by side."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
