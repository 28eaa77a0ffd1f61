"""A stated roofline for one optimizer step on GPUs: compute at the data-sheet peak, collectives at link bandwidth.

A bound, not a benchmark, over the same Workload and AcceleratorSpec as the calibrated prediction (price.py). Two
step times: "overlap" (step = max(compute, NVLink time, network time)) and "serial" (their sum); real runs land
between the two, minus kernel efficiency (real matmuls and flash attention reach ~60-75% of peak).
"""
from __future__ import annotations

from models.llama import LlamaConfig
from training.planning.accelerators import AcceleratorSpec
from training.planning.workload import Workload, comm_bytes, recomputed_block_fraction

ROOFLINE_STATEMENT = ("roofline: the accelerator's data-sheet dense bf16 peak (fp32 at half), NVLink and network at "
                      "their link rates per GPU per direction; 'overlap' = max(compute, comm), 'serial' = sum")


def forward_flops_per_token(m: LlamaConfig, seq_len: int) -> tuple[float, float]:
    """(block forward FLOPs, output-projection forward FLOPs) per token; causal attention scores count half."""
    attn_proj = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads)
    block_matmuls = attn_proj + 3 * m.dim * m.ffn_hidden_dim
    attention = 2 * m.n_heads * m.head_dim * seq_len  # QK^T and PV: 2 x 2 x H x D x S, halved by causality
    return m.n_layers * (2.0 * block_matmuls + attention), 2.0 * m.dim * m.vocab_size


def roofline(w: Workload, acc: AcceleratorSpec) -> dict:
    """Per-rank step times of the bound: model FLOPs (causal attention as half) plus activation-checkpoint
    recomputation at the peak (fp32 as TF32, half of it), each collective's bytes at its link's rate."""
    lay = w.layout
    tokens = w.local_batch_size * w.grad_accum * w.seq_len / (lay.cp * lay.tp * lay.pp)  # per rank per step
    block_fwd, output_fwd = forward_flops_per_token(w.model, w.seq_len)
    model_flops = 3.0 * (block_fwd + output_fwd) * tokens
    hardware_flops = model_flops + block_fwd * tokens * recomputed_block_fraction(w.ac_mode, w.ac_every)
    nvlink_bytes = ib_bytes = 0.0
    for nbytes, span in comm_bytes(w).values():
        if lay.intra_node(span):
            nvlink_bytes += nbytes
        else:
            ib_bytes += nbytes
    compute = hardware_flops * (2.0 if w.dtype == "float32" else 1.0) / acc.bf16_flops
    nvlink, ib = nvlink_bytes / acc.nvlink_bytes_per_s, ib_bytes / acc.ib_bytes_per_s
    overlap, serial = max(compute, nvlink, ib), compute + nvlink + ib
    return {"compute_s": compute, "nvlink_s": nvlink, "ib_s": ib, "overlap_s": overlap, "serial_s": serial,
            "mfu_overlap": model_flops / (overlap * acc.bf16_flops) if overlap else 0.0,
            "mfu_serial": model_flops / (serial * acc.bf16_flops) if serial else 0.0,
            "tokens_per_gpu_s": tokens / overlap if overlap else 0.0, "comm_bytes": nvlink_bytes + ib_bytes}
