"""The `[hardware]` section of the recipe schema: the machines a recipe is meant for (split from config/schema.py,
which re-exports every name here, as it does config/schema_data.py's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeviceKind = Literal["auto", "cuda", "cpu"]
AcceleratorName = Literal["h100-sxm", "h100-sxm-500w", "h200", "a100-80gb", "a100-40gb"]


@dataclass
class HardwareConfig:
    """The machines a recipe is meant for: the launch check and the dry run read these (training itself picks CUDA or
    CPU at run time)."""
    device: DeviceKind = "auto"
    """auto: CUDA when visible, else CPU | cuda: a GPU-sized recipe; without enough GPUs the launcher refuses in one
    line (and suggests --dry-run) instead of starting | cpu: never look for GPUs."""
    gpus_per_node: int = 8
    """GPUs per node: nodes to ask Slurm for, and which collectives the dry run puts on NVLink vs InfiniBand."""
    accelerator: AcceleratorName = "h100-sxm"
    """The GPU the dry run and --plan-ramp predict for: its peak, HBM, NVLink, network, device and host memory
    (training/planning/accelerators.py). h100-sxm-500w: the H100 96GB capped at 500 W of TorchTitan's published runs."""
    device_memory_gib: float = 0.0
    """Memory per GPU the dry run holds every stage's peak against (0 = the accelerator's: H100 80, H200 141)."""
    host_memory_gib: float = 0.0
    """Host memory per node the dry run and the launch check hold each stage's host plan against: the ranks'
    processes, cpu_offload's training state, pinned activation offload, batches (training/planning/host_memory.py;
    a CPU run also against what the machine has available). 0 = the accelerator's node: 2048 for 8-GPU H100/H200
    nodes, 1024 for A100."""
    nvlink_gb_per_s: float = 0.0
    """NVLink per GPU and direction, GB/s (0 = the accelerator's)."""
    network_gb_per_s: float = 0.0
    """Inter-node network per GPU and direction, GB/s (0 = the accelerator's)."""


ACCELERATOR_MEMORY_GIB = {"h100-sxm": (80.0, 2048.0), "h100-sxm-500w": (96.0, 2048.0), "h200": (141.0, 2048.0),
                          "a100-80gb": (80.0, 1024.0), "a100-40gb": (40.0, 1024.0)}
"""(device GiB per GPU, host GiB per 8-GPU node) by accelerator: what hardware.device_memory_gib and host_memory_gib
default to."""
