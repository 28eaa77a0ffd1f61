"""What `training.cpu_offload` adds to a GPU step: AdamW on the host and each block's host/device copies.

Kept apart from price.py (the device's work) and added to its prediction by the dry run, because neither part runs
on the GPU:
- the optimizer: torch's fused CPU AdamW is memory-bound (28 bytes per fp32 parameter element) and a node's ranks
  share its host memory bandwidth (published figures, or `bench/bench_rates.py --host`'s in the rates file);
- the copies: per micro-step every block's parameter shards go host -> device for the forward's all-gather and again
  for the backward's (resharded after forward), its reduced gradient shards device -> host once: three times the
  rank's shard bytes over PCIe. FSDP2 posts them without blocking, so part hides behind compute; priced in full here
  (an upper bound, said so in the dry run's header).
"""
from __future__ import annotations

ADAMW_BYTES_PER_PARAMETER = 28
"""Fused AdamW on fp32: reads param, grad, exp_avg, exp_avg_sq (16 bytes), writes param, exp_avg, exp_avg_sq (12)."""
HOST_MEMORY_BYTES_PER_S = {"h100-sxm": 614e9, "h100-sxm-500w": 614e9, "h200": 614e9, "a100-80gb": 410e9,
                           "a100-40gb": 410e9}
"""Per node, data-sheet peaks of the DGX hosts: two Xeon 8480C with 8 DDR5-4800 channels each (2 x 307 GB/s) for
H100/H200; two EPYC 7742 with 8 DDR4-3200 channels each (2 x 205 GB/s) for A100."""
HOST_MEMORY_FRACTION = (0.6, 0.75)
"""STREAM triad on two-socket servers reaches 60-75% of the DDR peak (low, high)."""


def offload_step_s(param_shard_bytes: float, grad_accum: int, ranks_per_node: int, accelerator: str,
                   pcie_bytes_per_s: float, pcie_fraction: tuple[float, float], measured_host: float | None = None,
                   measured_copy: float | None = None) -> dict[str, tuple[float, float]]:
    """{"host_optimizer": (fast, slow) s, "host_copies": (fast, slow) s} for one optimizer step of one rank holding
    `param_shard_bytes` of fp32 parameter shards. `measured_host` / `measured_copy`: bench/bench_rates.py --host's
    bytes/s (the rates file's host_optimizer, per node, and host_copy, per GPU), used at their value where given."""
    host = (measured_host or HOST_MEMORY_BYTES_PER_S[accelerator]) / max(1, ranks_per_node)
    host_fractions = (1.0, 1.0) if measured_host else tuple(reversed(HOST_MEMORY_FRACTION))
    copy_rates = (measured_copy, measured_copy) if measured_copy else tuple(pcie_bytes_per_s * f
                                                                            for f in reversed(pcie_fraction))
    elements = param_shard_bytes / 4
    optimizer = tuple(ADAMW_BYTES_PER_PARAMETER * elements / (host * f) for f in host_fractions)
    copies = tuple(3 * param_shard_bytes * grad_accum / rate for rate in copy_rates)
    return {"host_optimizer": optimizer, "host_copies": copies}
