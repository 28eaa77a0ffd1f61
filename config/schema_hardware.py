"""The `[hardware]` section of the recipe schema: the machines a recipe is meant for (split from config/schema.py,
which re-exports every name here, as it does config/schema_data.py's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from config.accelerators import DATA_SHEETS

DeviceKind = Literal["auto", "cuda", "cpu"]
AcceleratorName = Literal[tuple(DATA_SHEETS)]  # type: ignore[valid-type]  # the accelerator table's names


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
    (config/accelerators.py). h100-sxm-500w: the H100 96GB capped at 500 W of TorchTitan's published runs; h100-pcie,
    h100-nvl: the PCIe cards (756 and 835 TFLOP/s bf16)."""
    device_memory_gib: float = 0.0
    """Memory per GPU the dry run holds every stage's peak against (0 = the accelerator's: H100 80, H200 141)."""
    host_memory_gib: float = 0.0
    """Host memory per node the dry run and the launch check hold each stage's host plan against: the ranks'
    processes, cpu_offload's training state, pinned activation offload, batches (training/launch_checks/host_memory.py;
    a CPU run also against what the machine has available). 0 = the accelerator's node: 2048 for 8-GPU H100/H200
    nodes, 1024 for A100."""
    nvlink_gb_per_s: float = 0.0
    """NVLink per GPU and direction, GB/s (0 = the accelerator's)."""
    network_gb_per_s: float = 0.0
    """Inter-node network per GPU and direction, GB/s (0 = the accelerator's)."""


ACCELERATOR_MEMORY_GIB = {name: (s.memory_gib, s.host_memory_gib_per_node) for name, s in DATA_SHEETS.items()}
"""(device GiB per GPU, host GiB per 8-GPU node) by accelerator (config/accelerators.py): what
hardware.device_memory_gib and host_memory_gib default to."""
