"""The accelerators a recipe can name (`[hardware] accelerator`): the data sheets of config/accelerators.py (what
the roofline uses) with the kernel-level figures the calibrated step-time model (price.py) uses, each with its
source: published benchmarks of the kernels one training step runs (and of the CP ring's attention), never end-to-end
training throughputs, which are what the model is checked against (tests/training/test_price.py,
docs/predictions.md). A (low, high) pair is the spread the sources give; the model's band comes from these pairs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from config.accelerators import DATA_SHEETS, DataSheet

# FlashAttention-2 on an H100 80GB SXM5 at 700 W, TFLOP/s (causal work counted as half), by sequence length of one
# call (batch x seq = 16K tokens, 2,048 hidden): Shah et al. 2024, "FlashAttention-3", arXiv 2407.08608, Fig. 5
# (forward, head dim 64 / 128 / 256, causal and not) and Fig. 6 (backward, head dim 64 / 128, not causal).
# PyTorch's SDPA flash backend is FlashAttention-2, so these are its rates.
FA2_H100_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_H100 = {
    ("fwd", 128, False): (309, 350, 362, 368, 370, 370),
    ("fwd", 128, True): (191, 260, 298, 319, 333, 335),
    ("bwd", 128, False): (214, 260, 291, 310, 318, 322),
    ("bwd", 64, False): (198, 238, 264, 279, 287, 291),
    ("fwd", 256, False): (208, 251, 278, 293, 297, 298),
}
"""Causal backward is not in the paper: it is taken as the non-causal backward times the forward's causal /
non-causal ratio at the same length (the same tiles skipped); head dims without a row use the nearest one scaled by
the backward's head-dim ratio (64 vs 128)."""

CUDNN_VS_FA2_HOPPER = {"fwd": 0.96 / 0.48, "bwd": 2.37 / 1.42}
"""cuDNN's fused attention (its sm90 wgmma kernels, what torch 2.11's SDPA runs on Hopper) against PyTorch's
FlashAttention-2 on the same call, per phase: measured on one H100 80GB SXM at 700 W with torch 2.11 / CUDA 13, causal
bf16, q (1, 16, 8192, 128) with 8 K/V heads (this project's issue 37): forward 0.48 vs 0.96 ms, backward 1.42 vs
2.37 ms. Applied to the FlashAttention-2 table at every length and head dim (an assumption: one shape measured). A
rates file measured on the device (issue 37) replaces it."""

EFFICIENT_VS_FLASH = 0.5
"""The memory-efficient (cutlass, xFormers-derived) kernel, used for float32 attention (flash is fp16/bf16 only), at
about half FlashAttention-2's rate: Dao 2023, "FlashAttention-2", arXiv 2307.08691, Fig. 4-5 (xFormers cutlass vs
FlashAttention-2 on A100, forward + backward, head dim 64 / 128: 0.4-0.6x)."""

RING_ZIGZAG_FWD = (0.817, 0.852)
"""A CP ring's attention relative to one FlashAttention call over the rank's own block (causal, the same length):
zhuzilin/ring-flash-attention README, "Performance Summary", batch API, zigzag_ring vs "theoretic flash_attn"
(Llama 3.1 8B's 32 query / 8 K/V heads of 128, batch 1, 8K tokens per GPU, bf16, 8 GPUs over NVLink): forward only
81.7% on 8x A100, 85.2% on 8x H800. It carries what a ring adds to the kernel time: a launch per hop, the
float32 merges of partial outputs, the smaller half-blocks of the balanced layout, P2P kernels beside the
attention. TorchTitan's CP (torch's experimental context_parallel, head-tail load balancing) is the same zigzag."""
RING_ZIGZAG_FWD_BWD = (0.898, 0.902)
"""The same table, forward + backward: 89.8% on 8x A100, 90.2% on 8x H800 (the backward's own share:
ring_efficiency)."""
RING_MEASURED_LENGTH = 8192
"""Tokens per GPU of that benchmark; the figures are applied at every block length and ring size (an assumption:
per-hop overheads shrink relative to the quadratic work at longer blocks)."""


@dataclass(frozen=True, kw_only=True)
class AcceleratorSpec(DataSheet):
    """A data sheet of config/accelerators.py (peaks, memory, links) with the kernel-level figures the calibrated
    model prices at; each (low, high) pair is the spread its sources give."""
    gemm_fraction: tuple[float, float] = (0.68, 0.80)
    """Large bf16 GEMMs, share of the peak. High: the best shape of a cuBLAS sweep (Bekman, "Machine Learning
    Engineering", compute/accelerator: Maximum Achievable Matmul FLOPS: H100 SXM 794.5 of 989 TFLOP/s = 0.80, A100
    SXM 271.2 of 312 = 0.87). Low: 0.85 x that, for one layer's shapes (K/V projections with N = 1,024, the
    transposed backward GEMMs), an assumption stated here, not a measurement."""
    flash_scale: float = 1.0
    """This GPU's FlashAttention-2 rates relative to the H100 table above at the same clock."""
    flash_fraction: tuple[float, float] = (0.85, 1.0)
    """Spread around the FlashAttention-2 table: high = the paper's standalone kernel, low = 0.85x for PyTorch's
    built-in build of it and shapes unlike the benchmark's (GQA, batch 1, 32 heads); an assumption stated here."""
    clock_fraction: tuple[float, float] = (1.0, 1.0)
    """Sustained tensor clock under a power cap below the data sheet's: dynamic power ~ f V^2 with V ~ f in the DVFS
    range gives f ~ P^(1/3) (high); with static power and the voltage floor f ~ P^(1/2) (low)."""
    hbm_fraction: tuple[float, float] = (0.85, 0.92)
    """STREAM-like copy kernels (BabelStream, TheBandwidthBenchmark) reach 85-92% of the data-sheet HBM bandwidth on
    A100 and H100."""
    nvlink_busbw_fraction: tuple[float, float] = (0.75, 0.82)
    """NCCL-tests all_gather_perf / reduce_scatter_perf bus bandwidth for large messages on one 8-GPU NVSwitch node:
    ~340-370 GB/s of NVLink 4's 450 GB/s per direction on H100, ~230-245 GB/s of NVLink 3's 300 on A100."""
    ib_busbw_fraction: tuple[float, float] = (0.80, 0.92)
    """NCCL-tests across nodes, one 400G (NDR) / 200G (HDR) NIC per GPU: 40-46 GB/s of 50 (NDR)."""
    pcie_fraction: tuple[float, float] = (0.75, 0.85)
    """CUDA bandwidthTest pinned host<->device: ~48-55 GB/s on PCIe Gen5 x16 (64 GB/s), ~24-27 on Gen4 (32)."""


def _spec(name: str, **kernel_figures) -> AcceleratorSpec:
    return AcceleratorSpec(**dataclasses.asdict(DATA_SHEETS[name]), **kernel_figures)


A100_FLASH_SCALE = 0.312 / 0.989 * (0.73 / 0.374)
"""FlashAttention-2 reaches up to 73% of the A100's peak forward (Dao 2023, Fig. 4) vs 37.4% (370 of 989) on the
H100: the H100 table scaled by that ratio."""
ACCELERATORS = {
    "h100-sxm": _spec("h100-sxm"),
    "h100-sxm-500w": _spec("h100-sxm-500w", clock_fraction=((500 / 700) ** 0.5, (500 / 700) ** (1 / 3))),
    "h100-pcie": _spec("h100-pcie", flash_scale=756 / 989),  # the SXM part's kernels at the PCIe card's clock
    "h100-nvl": _spec("h100-nvl", flash_scale=835 / 989),
    "h200": _spec("h200"),
    "a100-80gb": _spec("a100-80gb", gemm_fraction=(0.74, 0.87), flash_scale=A100_FLASH_SCALE),
    "a100-40gb": _spec("a100-40gb", gemm_fraction=(0.74, 0.87), flash_scale=A100_FLASH_SCALE),
}
"""Every accelerator of the table (config/accelerators.DATA_SHEETS), with its kernel-level figures."""


def accelerator_for(hw) -> AcceleratorSpec:
    """The recipe's accelerator (`[hardware]`) with its link overrides (nvlink_gb_per_s, network_gb_per_s)."""
    links = {"nvlink_bytes_per_s": hw.nvlink_gb_per_s * 1e9, "ib_bytes_per_s": hw.network_gb_per_s * 1e9}
    return dataclasses.replace(ACCELERATORS[hw.accelerator], **{k: v for k, v in links.items() if v > 0})


def kernel_on(name: str, asked: str) -> str:
    """The CP attention's kernel family `asked` resolves to on accelerator `name`, as the trainer resolves it on the
    GPU itself (auto: cuDNN from SM 9.0, i.e. H100/H200; FlashAttention-2 on A100)."""
    from parallelisms.cp.kernel_blocks import concrete_kernel

    return concrete_kernel(asked, "cuda", ACCELERATORS[name].compute_capability)


def attention_rate(spec: AcceleratorSpec, kernel: str, phase: str, head_dim: int, causal: bool, length: float) -> float:
    """FLOP/s of one call on the kernel family `kernel` (parallelisms/cp/kernel_blocks.py): FlashAttention-2's table,
    times cuDNN's measured per-phase speed-up over it on Hopper for "cudnn"."""
    rate = flash_rate(spec, phase, head_dim, causal, length)
    return rate * CUDNN_VS_FA2_HOPPER[phase] if kernel == "cudnn" and spec.compute_capability >= (9, 0) else rate


def flash_rate(spec: AcceleratorSpec, phase: str, head_dim: int, causal: bool, length: float) -> float:
    """FlashAttention-2 FLOP/s of one call whose query/key blocks are `length` tokens, at the data sheet's clock."""
    dim = min((64, 128, 256), key=lambda d: abs(d - head_dim))
    full = _row(phase, dim, False)
    rate = _interpolate(full, length)
    if causal:
        rate *= _interpolate(FA2_H100[("fwd", 128, True)], length) / _interpolate(FA2_H100[("fwd", 128, False)],
                                                                                  length)
    return rate * 1e12 * spec.flash_scale


def ring_efficiency(phase: str, head_dim: int) -> tuple[float, float]:
    """(low, high) share of one causal FlashAttention call's rate that a zigzag CP ring reaches, per phase. The
    backward's is solved from the forward and forward + backward figures at each end of their spread, with the
    forward / backward time split of FlashAttention-2 at the benchmark's length (backward = 2.5x the forward's
    FLOPs): t_f / e_f + t_b / e_b = (t_f + t_b) / e_fb."""
    if phase == "fwd":
        return RING_ZIGZAG_FWD
    length = RING_MEASURED_LENGTH
    t_f = 1.0 / flash_rate(ACCELERATORS["h100-sxm"], "fwd", head_dim, True, length)
    t_b = 2.5 / flash_rate(ACCELERATORS["h100-sxm"], "bwd", head_dim, True, length)
    ends = [t_b / ((t_f + t_b) / both - t_f / fwd) for fwd, both in zip(RING_ZIGZAG_FWD, RING_ZIGZAG_FWD_BWD)]
    return min(ends), max(ends)


def _row(phase: str, dim: int, causal: bool) -> tuple[float, ...]:
    if (phase, dim, causal) in FA2_H100:
        return FA2_H100[phase, dim, causal]
    base = FA2_H100[phase, 128, causal] if (phase, 128, causal) in FA2_H100 else FA2_H100["fwd", 128, False]
    if dim == 64:  # the backward's head-dim 64 / 128 ratio, applied to the forward
        ratio = [a / b for a, b in zip(FA2_H100["bwd", 64, False], FA2_H100["bwd", 128, False])]
    else:  # 256: the forward's 256 / 128 ratio, applied to the backward
        ratio = [a / b for a, b in zip(FA2_H100["fwd", 256, False], FA2_H100["fwd", 128, False])]
    return tuple(b * r for b, r in zip(base, ratio))


def _interpolate(row: tuple[float, ...], length: float) -> float:
    """Linear in log2(length) between the table's lengths, flat beyond its ends."""
    if length <= FA2_H100_LENGTHS[0]:
        return row[0] * max(length, 64) / FA2_H100_LENGTHS[0]  # below 512 a call is launch- and tail-bound
    return float(np.interp(math.log2(length), np.log2(FA2_H100_LENGTHS), row))
