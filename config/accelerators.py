"""The one accelerator table: each GPU part's data sheet (peaks, memory, the node's host memory, links) and the
device names `torch.cuda.get_device_name()` gives it.

Everything that names a GPU reads it: the schema's `hardware.accelerator` choices and memory defaults
(config/schema_hardware.py), the dry run's prices (training/planning/accelerators.py adds the kernel-level figures),
MFU's peak (training/hardware.py), the benches (bench/our_runs.py) and the GPU report (harness/gpu_report.py).
It lives in config/, the leaf package, so the schema can read it without importing the trainer.

Sources: NVIDIA's data sheets (H100 SXM5 / PCIe / NVL, H200, A100; dense figures, no sparsity); TorchTitan's MFU
table takes the same 989 / 756 / 835 TFLOP/s for H100 SXM / PCIe / NVL.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSheet:
    name: str
    bf16_flops: float
    """Dense bf16 tensor-core FLOP/s at the data sheet's boost clock (fp32 matmuls as TF32 at half of it)."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per GPU, one direction."""
    ib_bytes_per_s: float
    """Per GPU, one direction (one NIC per GPU)."""
    pcie_bytes_per_s: float
    """Host <-> device, one direction, pinned memory (data sheet link rate)."""
    memory_gib: float
    host_memory_gib_per_node: float
    """A typical 8-GPU node of this kind (DGX / HGX: 2 TiB for H100 and H200, 1 TiB for A100)."""
    fp8_flops: float = 0.0
    """Dense FP8 tensor-core FLOP/s (H100/H200 SXM: 1,979 TFLOP/s, twice bf16); 0 = no FP8 tensor cores (A100):
    training.float8 cannot run there (training/planning/float8_cost.py)."""
    compute_capability: tuple[int, int] = (9, 0)
    """CUDA compute capability: picks the attention kernel the trainer would (parallelisms/cp/kernel_blocks.py)."""
    notes: str = ""


_H100 = dict(nvlink_bytes_per_s=450e9, ib_bytes_per_s=50e9, pcie_bytes_per_s=64e9, host_memory_gib_per_node=2048.0)
_PCIE_CARD = dict(nvlink_bytes_per_s=300e9, ib_bytes_per_s=50e9, pcie_bytes_per_s=64e9, host_memory_gib_per_node=1024.0)
_A100 = dict(nvlink_bytes_per_s=300e9, ib_bytes_per_s=25e9, pcie_bytes_per_s=32e9, host_memory_gib_per_node=1024.0,
             compute_capability=(8, 0))
DATA_SHEETS = {s.name: s for s in (
    DataSheet("h100-sxm", 989e12, 3.35e12, memory_gib=80.0, fp8_flops=1979e12, **_H100,
              notes="H100 SXM5 80GB, 700 W: 989 TFLOP/s bf16 dense, HBM3 3.35 TB/s, NVLink 4 900 GB/s both "
              "directions, NDR 400 Gb/s per GPU, PCIe Gen5"),
    DataSheet("h100-sxm-500w", 989e12, 2.4e12, memory_gib=96.0, fp8_flops=1979e12, **_H100,
              notes="H100 SXM 96GB HBM2e at its default 500 W limit (TorchTitan's published runs, Grand Teton hosts; "
              "their docs/performance.md: 2.4 TB/s, peak FLOP/s 'between SXM and NVL'): the 700 W part's peak, the "
              "cap's clock in training/planning/accelerators.py"),
    DataSheet("h100-pcie", 756e12, 2.0e12, memory_gib=80.0, fp8_flops=1513e12, **_PCIE_CARD,
              notes="H100 PCIe 80GB, 350 W: 756 TFLOP/s bf16 dense, HBM2e 2.0 TB/s, NVLink bridge 600 GB/s both "
              "directions between a pair (larger groups cross PCIe: the NVLink figure is optimistic beyond 2 GPUs)"),
    DataSheet("h100-nvl", 835e12, 3.9e12, memory_gib=94.0, fp8_flops=1671e12, **_PCIE_CARD,
              notes="H100 NVL 94GB, 400 W: 835 TFLOP/s bf16 dense, HBM3 3.9 TB/s, NVLink bridge 600 GB/s both "
              "directions between a pair (larger groups cross PCIe: the NVLink figure is optimistic beyond 2 GPUs)"),
    DataSheet("h200", 989e12, 4.8e12, memory_gib=141.0, fp8_flops=1979e12, **_H100,
              notes="H200 SXM 141GB: the H100's compute (989 TFLOP/s), HBM3e 4.8 TB/s"),
    DataSheet("a100-80gb", 312e12, 2.039e12, memory_gib=80.0, **_A100,
              notes="A100 SXM4 80GB: 312 TFLOP/s bf16, HBM2e 2.04 TB/s, NVLink 3 600 GB/s both directions, HDR 200 "
              "Gb/s, PCIe Gen4"),
    DataSheet("a100-40gb", 312e12, 1.555e12, memory_gib=40.0, **_A100, notes="A100 SXM4 40GB: HBM2 1.56 TB/s"),
)}


@dataclass(frozen=True)
class Part:
    """A GPU as its device name spells it: the dense bf16 peak MFU is measured against, and the accelerator the dry
    run prices it as (None: no data sheet here, MFU only)."""
    spelling: str
    bf16_flops: float
    accelerator: str | None


PARTS = (  # first match wins: the specific spellings before "H100"
    Part("H100 PCIE", 756e12, "h100-pcie"), Part("H100 NVL", 835e12, "h100-nvl"), Part("GH200", 989e12, None),
    Part("H200", 989e12, "h200"), Part("H100", 989e12, "h100-sxm"), Part("H800", 989e12, None),
    Part("A100", 312e12, "a100-80gb"), Part("A800", 312e12, None), Part("L40S", 362e12, None),
    Part("A10G", 70e12, None), Part("L4", 121e12, None), Part("B200", 2250e12, None), Part("MI300X", 1307e12, None),
)


def part_of(device_name: str) -> Part | None:
    upper = device_name.upper()
    return next((p for p in PARTS if p.spelling in upper), None)


def accelerator_of(device_name: str, memory_gib: float | None = None) -> str | None:
    """hardware.accelerator of a CUDA device (None: none in the table). An A100's size by its name ("80GB"), else by
    the memory it reports."""
    part = part_of(device_name)
    if part is None or part.accelerator != "a100-80gb":
        return part and part.accelerator
    if "80G" in device_name.upper() or (memory_gib or 0) > 60:
        return "a100-80gb"
    return "a100-40gb"
