"""A calibrated step time: what one optimizer step should take on real GPUs, as a band (low..high) and a prediction.

The roofline (training/planning/roofline.py) is a bound: every FLOP at the data-sheet peak. This model prices each
class of work of one Workload at the rate published kernel benchmarks reach (training/planning/accelerators.py states
each figure and its source), or at the rate a file measured on the device holds (training/planning/rates.py): GEMMs
at cuBLAS's rate (op-level AC re-runs some of them, `op_recomputed_matmul_share`); attention at its kernel's rate on
the visible query-key pairs (`_attention_s`; packed documents at CP 1 piece by piece, documents_cost.py); memory-bound
work as bytes at the achieved HBM bandwidth, eager or fused (`_elementwise`); collectives at NCCL's bus bandwidth,
exposed where compute does not hide them (`_exposed_comm`). No constant is fitted to an end-to-end result. `low`
takes every rate at the high end of its source's spread, `high` at the low end; the prediction takes the middle.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.llama import LlamaConfig
from training.planning.accelerators import (EFFICIENT_VS_FLASH, AcceleratorSpec, attention_rate, flash_rate,
                                           ring_efficiency)
from training.planning.documents_cost import PUBLISHED, packed_attention_seconds
from training.planning.float8_cost import cast_bytes, converted_gemm_share
from training.planning.rates import MeasuredRates
from training.planning.workload import Workload, comm_bytes, parameter_count, recomputed_block_fraction

@dataclass
class StepPrediction:
    step_s: float
    band: tuple[float, float]
    parts: dict
    """Seconds per class of work at the prediction's rates (compute classes, then exposed communication)."""
    tokens_per_rank: float

    @property
    def tokens_per_sec_per_gpu(self) -> float:
        return self.tokens_per_rank / self.step_s


def predict_step(w: Workload, acc: AcceleratorSpec, rates: MeasuredRates | None = None) -> StepPrediction:
    """The step time at the middle of every source's spread, and the band from its ends. `rates`: the accelerator's
    measured rates (training/planning/rates.py); a measured component has no spread."""
    fast, mid, slow = (_step_parts(w, acc, where, rates) for where in (1.0, 0.5, 0.0))
    rows = w.local_batch_size * w.grad_accum
    tokens_per_rank = rows * w.seq_len / (w.layout.cp * w.layout.tp * w.layout.pp)  # per GPU
    return StepPrediction(sum(mid.values()), (sum(fast.values()), sum(slow.values())), mid, tokens_per_rank)


def _pick(pair: tuple[float, float], where: float) -> float:
    low, high = pair
    return low + where * (high - low)


def _step_parts(w: Workload, acc: AcceleratorSpec, where: float, rates: MeasuredRates | None = None) -> dict:
    """Seconds per class for one step, every efficiency at `where` in its (low, high) spread (1 = fastest); a
    component `rates` measured is priced at its measured rate."""
    m, lay = w.model, w.layout
    clock = _pick(acc.clock_fraction, where)
    dtype_factor = 2.0 if w.dtype == "float32" else 1.0
    m_gemm = rates.gemm_rate(m.dim, m.ffn_hidden_dim) if rates is not None else None
    gemm_rate = (m_gemm or acc.bf16_flops * _pick(acc.gemm_fraction, where) * clock) / dtype_factor
    hbm = rates.hbm if rates is not None and rates.hbm else acc.hbm_bytes_per_s * _pick(acc.hbm_fraction, where)
    tokens = w.local_batch_size * w.seq_len / lay.cp  # per micro-batch, before TP splits the work
    layers = m.n_layers / lay.pp
    block_recompute = recomputed_block_fraction(w.ac_mode, w.ac_every)
    op_ac = w.ac_mode == "op"
    gemm_recompute = op_recomputed_matmul_share(m) if op_ac else block_recompute
    attn_recompute = 0.0 if op_ac else block_recompute  # op-level AC saves the attention outputs
    elementwise_recompute = 1.0 if op_ac else block_recompute  # op-level AC re-runs every op it does not save

    block_gemm = 2.0 * m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads) + 6.0 * m.dim * m.ffn_hidden_dim
    output_gemm = 2.0 * m.dim * m.vocab_size
    block_flops = tokens / lay.tp * layers * block_gemm * (3 + gemm_recompute)
    if w.sublayer_groups:  # the q/k/v projections once more, in the grouped sublayer's backward
        block_flops += tokens / lay.tp * layers * 2.0 * m.dim * m.head_dim * (m.n_heads + 2 * m.num_kv_heads)
    output_flops = tokens / lay.tp * output_gemm * (3 + (1 if w.loss_chunk_tokens else 0))
    float8_share = converted_gemm_share(m, w.tiled_mlp) if w.float8 != "off" else 0.0
    parts = {"gemm": (block_flops * (1 - float8_share) + output_flops) / gemm_rate * w.grad_accum}
    if float8_share:
        m_fp8 = rates.gemm_rate(m.dim, m.ffn_hidden_dim, float8=True) if rates is not None else None
        fp8_rate = m_fp8 or acc.fp8_flops * _pick(acc.gemm_fraction, where) * clock
        parts["float8_gemm"] = block_flops * float8_share / fp8_rate * w.grad_accum
    flash = clock * _pick(acc.flash_fraction, where)
    parts["attention"] = _attention_s(w, acc, flash, dtype_factor, attn_recompute, where, rates) * w.grad_accum
    eager = not w.compile
    parts.update(_elementwise(w, layers, elementwise_recompute, hbm))
    if float8_share and not (eager and w.bandwidth_bytes):  # fused (compiled: the probe leaves them uncounted)
        weight_bytes = 2 if w.dtype != "float32" and lay.dp_shard * lay.cp * lay.tp * lay.dp_replicate > 1 else 4
        casts = cast_bytes(m, w.float8, w.tiled_mlp, tokens / lay.tp, 1 + elementwise_recompute, weight_bytes)
        parts["float8_casts"] = casts * layers / hbm * w.grad_accum
    local_params = parameter_count(m) / (lay.pp * lay.tp * lay.dp_shard * lay.cp)
    optimizer_rate = rates.optimizer if rates is not None and rates.optimizer else hbm
    parts["optimizer"] = local_params * 32 / optimizer_rate  # AdamW + clipping: read p, g, m, v (fp32), write p, m, v
    compute = sum(parts.values())
    parts.update(_exposed_comm(w, acc, where, compute, parts["attention"]))
    return parts


def _elementwise(w: Workload, layers: float, recompute: float, hbm: float) -> dict:
    """Seconds of the memory-bound work: the blocks' elementwise kernels, the loss's and FSDP2's copies. Counted
    (`bandwidth_bytes`: every cast, copy and FSDP2 copy an eager micro-step launches): eager, all of it; compiled,
    the blocks' share keeps the per-op formula's compiled / eager ratio (`elementwise_bytes_per_token`), while
    FSDP2's copies and the chunked loss, which run eagerly under compile too, keep their eager bytes. Not counted:
    bytes per token of each op class."""
    m, lay = w.model, w.layout
    loss_bytes = w.micro_tokens / lay.tp * m.vocab_size * 28  # the chunked loss runs eagerly, compiled or not
    if w.bandwidth_bytes:
        if w.compile:
            eager_rest = fsdp_copy_bytes(w) + loss_bytes
            kept = (elementwise_bytes_per_token(m, False, w.dtype) / elementwise_bytes_per_token(m, True, w.dtype))
            counted = max(0.0, w.bandwidth_bytes - eager_rest) * kept + min(eager_rest, w.bandwidth_bytes)
        else:
            counted = w.bandwidth_bytes
        return {"elementwise": counted / hbm * w.grad_accum, "fsdp_copies": 0.0}
    per_token = elementwise_bytes_per_token(m, not w.compile, w.dtype) * layers * (3 + recompute)
    return {"elementwise": (w.micro_tokens / lay.tp * per_token + loss_bytes) / hbm * w.grad_accum,
            "fsdp_copies": fsdp_copy_bytes(w) / hbm * w.grad_accum}


def op_recomputed_matmul_share(m: LlamaConfig) -> float:
    """Share of one block's matmul FLOPs that op-level AC runs again. Its policy
    (parallelisms/activation_checkpoint._op_policy, as TorchTitan's selective op AC) numbers a block's matmuls in
    call order and saves the odd-numbered ones: of wq, wk, wv, wo, w1, w3, w2 it recomputes wk, wo and w3 (about
    0.37 of the block's matmul FLOPs for Llama 3 8B, not half). Everything else it does not save (norms, RoPE, the
    SwiGLU gate, residual adds, casts) runs again too: the caller counts one more forward of the elementwise work."""
    q, kv, d, f = m.n_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.dim, m.ffn_hidden_dim
    in_call_order = (d * q, d * kv, d * kv, q * d, d * f, d * f, f * d)  # wq, wk, wv, wo, w1, w3, w2
    return sum(in_call_order[1::2]) / sum(in_call_order)


def fsdp_copy_bytes(w: Workload) -> float:
    """HBM bytes of FSDP2's own copies per micro-step, outside the collectives: each all-gather's output is copied
    out into the unsharded parameters (torch.distributed.fsdp _fsdp_collectives.foreach_all_gather_copy_out,
    split_with_sizes_copy: read and write every unsharded parameter), once for forward and again for backward when
    resharded after forward; each reduce-scatter's input is packed from the unsharded gradients in the float32
    reduce dtype (foreach_reduce, torch._chunk_cat: read the gradient, write float32)."""
    lay = w.layout
    if lay.dp_shard * lay.cp == 1:
        return 0.0
    params = parameter_count(w.model) / (lay.pp * lay.tp)
    e = 4 if w.dtype == "float32" else 2
    gathers = 2 if w.reshard_after_forward else 1
    return params * (gathers * 2 * e + e + 4)


def elementwise_bytes_per_token(m: LlamaConfig, eager: bool, dtype: str) -> float:
    """HBM bytes one block's forward moves per token outside GEMMs and attention (backward ~2x, counted by the
    caller). Eager: one kernel per op (RMSNorm upcasts to float32: ~7 passes of 4 bytes; RoPE through float32
    complex numbers: ~6; the SwiGLU gate: silu then multiply; two residual adds; layout copies around attention).
    Compiled, as measured on an H100 at 8K tokens (bench/bench_predictions.py's profile) when compile took the
    forward of attention and of feed-forward only: RoPE, the layout copies and the SwiGLU gate fused, the two norms
    and the residual adds between them eager (6 of the eager step's 32 ms of elementwise kernels went). The whole
    block compiles now (apply_compile); until a GPU measures it this split stays the price (an upper bound: a
    whole-block formula gave 0.76 of that measured row)."""
    e = 4 if dtype == "float32" else 2
    q, kv, d, f = m.n_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.dim, m.ffn_hidden_dim
    if eager:
        norms = 2 * d * (4 * e + 5 * 4)
        rope = (q + kv) * (2 * e + 4 * 4)
        layout = 2 * e * (2 * q + 2 * kv)
        gate = f * 5 * e
        residual = 2 * 3 * d * e
        return norms + rope + layout + gate + residual
    norms, residual = 2 * d * (4 * e + 5 * 4), 2 * 3 * d * e  # eager between the compiled regions
    return norms + residual + (q + kv) * 2 * e + f * 3 * e


def _attention_s(w: Workload, acc: AcceleratorSpec, clock: float, dtype_factor: float, recompute: float,
                 where: float, rates: MeasuredRates | None = None) -> float:
    """One micro-batch's attention: forward (+ recomputed forward) and backward (2.5x: five GEMMs to two) FLOPs on
    the visible pairs, at FlashAttention-2's rate for one call's block length. Without CP one causal call; a CP ring
    at the rate of one causal call over the rank's block times the zigzag ring's measured efficiency
    (accelerators.ring_efficiency), which carries the ring's per-hop launches, float32 merges and half-blocks."""
    m, lay = w.model, w.layout
    if w.document_pieces is not None and lay.cp == 1 and dtype_factor == 1:  # one packed call per layer and way
        measured = rates.packed_calls if rates is not None and rates.packed_calls else PUBLISHED
        per_layer = packed_attention_seconds(acc, w.documents_kernel, dict(w.document_pieces), m.n_heads / lay.tp,
                                             m.head_dim, 1 + recompute, measured, rows=w.local_batch_size)
        return per_layer * m.n_layers / lay.pp
    fraction = w.visible_pair_fraction if w.visible_pair_fraction is not None else (w.seq_len + 1) / (2 * w.seq_len)
    pairs = w.local_batch_size * fraction * w.seq_len ** 2 / lay.cp
    fwd = 4.0 * pairs * m.n_heads / lay.tp * m.head_dim * m.n_layers / lay.pp
    length = w.attention_length or w.seq_len / lay.cp
    seconds = 0.0
    for phase, flops in (("fwd", fwd * (1 + recompute)), ("bwd", 2.5 * fwd)):
        measured = (rates.attention_rate(w.attention_kernel, phase, length) if rates is not None and dtype_factor == 1
                    else None)
        if measured is not None:  # the measured call, carried to this length and head dim by the table's shape
            rate_at, length_at, head_dim_at = measured
            rate = rate_at * (flash_rate(acc, phase, m.head_dim, True, length)
                              / flash_rate(acc, phase, head_dim_at, True, length_at))
        else:
            rate = attention_rate(acc, w.attention_kernel, phase, m.head_dim, True, length) * clock
        if lay.cp > 1:
            rate *= _pick(ring_efficiency(phase, m.head_dim), where)
        if dtype_factor > 1:  # float32: the memory-efficient kernel
            rate *= EFFICIENT_VS_FLASH
        seconds += flops / rate
    return seconds


def _exposed_comm(w: Workload, acc: AcceleratorSpec, where: float, compute_s: float, attention_s: float) -> dict:
    """Seconds each collective waits beyond the compute: FSDP's prefetched gathers (per micro-step the first gather
    and the last reduce-scatter wait, and whatever exceeds the compute), TP's all of it, the ring beyond its
    layer's attention, activation offload's copies beyond the compute (all of the copies back without prefetch).
    Bytes: workload.comm_bytes."""
    lay = w.layout
    nvlink = acc.nvlink_bytes_per_s * _pick(acc.nvlink_busbw_fraction, where)
    ib = acc.ib_bytes_per_s * _pick(acc.ib_busbw_fraction, where)
    seconds = {name: nbytes / (nvlink if lay.intra_node(span) else ib)
               for name, (nbytes, span) in comm_bytes(w).items()}
    fsdp = seconds["fsdp"] + seconds["fsdp_replicate"]
    edges = 2 * fsdp / max(w.model.n_layers / lay.pp, 1) if lay.dp_shard * lay.cp > 1 else 0.0
    out = {"fsdp_exposed": edges + max(0.0, fsdp - edges - compute_s)}
    if "tp" in seconds:
        out["tp_exposed"] = seconds["tp"]
    if "ring" in seconds:
        out["ring_exposed"] = max(0.0, seconds["ring"] - attention_s)
    if w.offload_bytes:
        pcie = acc.pcie_bytes_per_s * _pick(acc.pcie_fraction, where)
        one_way = w.offload_bytes * w.grad_accum / pcie
        if w.offload_prefetch:  # both ways under compute
            out["offload_exposed"] = max(0.0, 2 * one_way - compute_s)
        else:  # the copies back are waited for, the copies out still run under the forward
            out["offload_exposed"] = one_way + max(0.0, one_way - compute_s)
    return out


PREDICTION_STATEMENT = ("predicted: calibrated step time (training/planning/price.py): GEMMs at cuBLAS's measured "
                        "rate, attention at its kernel's (cuDNN on H100/H200: FlashAttention-2's rate times cuDNN's "
                        "measured speed-up; FlashAttention-2 on A100; a CP ring at the zigzag ring's measured share of "
                        "one call; packed documents at CP 1 piece by piece at cuDNN THD's or FlashAttention-2 varlen's "
                        "rate times its measured per-call overhead), "
                        "elementwise work at achieved HBM bandwidth, collectives at NCCL's bus bandwidth with FSDP "
                        "prefetch and the ring under attention; band = the sources' spread (docs/predictions.md)")
