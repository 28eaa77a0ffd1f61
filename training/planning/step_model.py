"""A calibrated step time: what one optimizer step should take on real GPUs, as a band (low..high) and a prediction.

The roofline (training/planning/roofline.py) is a bound: every FLOP at the data-sheet peak. This model prices each class of
work at the rate published kernel benchmarks reach (training/planning/accelerators.py states each figure and its source):
- large GEMMs (every linear layer, forward, backward = 2x forward, recomputation: op-level AC re-runs the
  even-numbered matmuls of a block) at the cuBLAS rate;
- attention at the rate of the kernel the stage runs (`stage_attention_kernel`: cuDNN on H100/H200 at
  FlashAttention-2's measured rate times cuDNN's measured speed-up, FlashAttention-2 on A100 and for packed
  documents), for its head dim and the length of one call, on the visible query-key pairs (document masking: from a
  stated document mix); a CP ring at one causal call's rate over the rank's block (S / cp) times the zigzag ring's
  measured efficiency against that call; a rates file measured on the device (training/planning/rates.py) replaces
  each published rate it holds;
- memory-bound elementwise work (norms, RoPE, SwiGLU's gate, residual adds, casts, the loss's softmax, AdamW,
  FSDP2's copy-out of gathered parameters and copy-in of gradients) as bytes moved at the achieved HBM bandwidth,
  eager (one kernel per op) or fused under torch.compile; op-level AC re-runs all of a block's elementwise work;
- collectives at NCCL's achieved bus bandwidth: FSDP's all-gathers and reduce-scatters prefetched under compute
  (exposed: the first gather and the last reduce-scatter of each micro-step, plus whatever does not fit under the
  compute), the CP ring's P2P under that layer's attention, TP's collectives exposed, activation offload's PCIe
  copies on a side stream under compute.
No constant is fitted to an end-to-end result. `low` takes every rate at the high end of its source's spread,
`high` at the low end; the prediction takes the middle of each spread.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.llama import LlamaConfig
from training.planning.accelerators import (EFFICIENT_VS_FLASH, AcceleratorSpec, attention_rate, flash_rate,
                                           ring_efficiency)
from training.planning.float8_cost import cast_bytes, converted_gemm_share, converted_params_per_block
from training.planning.rates import MeasuredRates
from training.planning.roofline import Layout, fsdp_bytes_per_step, parameter_count, recomputed_block_fraction

DOCUMENT_MIX = ((0.5, None), (0.5, 4096))
"""Without the recipe's prepared stores: half the tokens in documents at least a row long (plain causal over the
row), half in 4,096-token documents (a ProLong-like long-document mix). (share of tokens, document length)."""


@dataclass(frozen=True)
class Workload:
    """What one rank runs in one optimizer step (the recipe, resolved)."""
    model: LlamaConfig
    layout: Layout
    seq_len: int
    local_batch_size: int
    grad_accum: int
    dtype: str = "bfloat16"
    ac_mode: str = "none"
    ac_every: int = 2
    compile: bool = False
    loss_chunk_tokens: int = 0
    reshard_after_forward: bool = True
    visible_pair_fraction: float | None = None
    """Visible (query, key) pairs / S^2 per row; None = plain causal."""
    attention_length: float | None = None
    """Tokens of one attention call's blocks (documents shorter than S / cp shorten it); None = S / cp."""
    cp_ring_bytes: float | None = None
    """The ring's sends per micro-batch, measured by the dry run; None = estimated from the K/V sizes."""
    offload_bytes: float = 0.0
    """Host bytes per micro-batch (activation offload), each way over PCIe."""
    attention_kernel: str = "flash"
    """The kernel family the attention runs (`stage_attention_kernel`): "cudnn" is priced at cuDNN's rate."""
    float8: str = "off"
    """training.float8: the blocks' converted linear layers priced in float8 (training/planning/float8_cost.py)."""
    tiled_mlp: bool = False
    """model.mlp_chunk_tokens > 0: the feed-forward stays in the training dtype under float8."""
    bandwidth_bytes: float | None = None
    """HBM bytes of one micro-step's elementwise kernels, copies and casts as the trainer launches them eagerly,
    counted by the dry run's memory probe (training/planning/fake/counter.py); None = `elementwise_bytes_per_token`."""


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
    if w.bandwidth_bytes:  # counted: every cast, copy and FSDP2 copy the step launches is among them
        # Compiled, the attention and feed-forward regions are fused and the rest still runs eagerly
        # (parallelisms.parallelize.apply_compile): the eager count keeps the share the per-op formula leaves.
        kept = 1.0 if eager else (elementwise_bytes_per_token(m, False, w.dtype)
                                  / elementwise_bytes_per_token(m, True, w.dtype))
        parts["elementwise"] = w.bandwidth_bytes * kept / hbm * w.grad_accum
        parts["fsdp_copies"] = 0.0
    else:  # compiled (fused regions) or nothing counted: bytes per token of each op class
        per_token = elementwise_bytes_per_token(m, eager, w.dtype) * layers * (3 + elementwise_recompute)
        loss_bytes = m.vocab_size * 28  # the chunked loss runs eagerly, compiled or not (apply_compile)
        parts["elementwise"] = tokens / lay.tp * (per_token + loss_bytes) / hbm * w.grad_accum
        parts["fsdp_copies"] = fsdp_copy_bytes(w) / hbm * w.grad_accum
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
    Compiled (parallelisms.parallelize.apply_compile compiles the forward of attention and of feed-forward, not the
    block): RoPE, the layout copies and the SwiGLU gate are fused, each region reading its inputs and writing its
    outputs once; the two norms and the residual adds between the compiled regions still run eagerly. Measured on an
    H100 at 8K tokens (bench/bench_predictions.py's profile): compile took 6 of the eager step's 32 ms of
    elementwise and copy kernels away, not all of them."""
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
    m, lay = w.model, w.layout
    nvlink = acc.nvlink_bytes_per_s * _pick(acc.nvlink_busbw_fraction, where)
    ib = acc.ib_bytes_per_s * _pick(acc.ib_busbw_fraction, where)

    def seconds(nbytes: float, span: int) -> float:
        return nbytes / (nvlink if lay.intra_node(span) else ib)

    n = lay.dp_shard * lay.cp
    float8_params = (converted_params_per_block(m, w.tiled_mlp) * m.n_layers if w.float8 == "tensorwise" else 0.0)
    shard, replicate = fsdp_bytes_per_step(m, lay, w.dtype, w.grad_accum, w.reshard_after_forward, float8_params)
    fsdp = seconds(shard, n * lay.tp) + seconds(replicate, lay.dp_replicate * n * lay.tp)
    layers = m.n_layers / lay.pp
    # Prefetch hides a layer's gather under the previous layer's compute: per micro-step the first gather and the
    # last reduce-scatter wait, and whatever exceeds the compute waits too.
    edges = 2 * fsdp / max(layers, 1) if n > 1 else 0.0
    out = {"fsdp_exposed": edges + max(0.0, fsdp - edges - compute_s)}
    act_bytes = 4 if w.dtype == "float32" else 2
    tokens = w.local_batch_size * w.seq_len / lay.cp
    if lay.tp > 1:
        collectives = 8 + 4 * recomputed_block_fraction(w.ac_mode, w.ac_every)
        per_layer = collectives * tokens * m.dim * act_bytes * (lay.tp - 1) / lay.tp
        out["tp_exposed"] = seconds(per_layer * layers * w.grad_accum, lay.tp)
    if lay.cp > 1:
        ring = w.cp_ring_bytes
        if ring is None:
            kv = 2 * tokens * m.num_kv_heads * m.head_dim / lay.tp
            forwards = 1 + recomputed_block_fraction(w.ac_mode, w.ac_every)
            ring = layers * (lay.cp - 1) * (forwards * kv * act_bytes + kv * (act_bytes + 4))
        out["ring_exposed"] = max(0.0, seconds(ring * w.grad_accum, lay.cp * lay.tp) - attention_s)
    if w.offload_bytes:
        pcie = acc.pcie_bytes_per_s * _pick(acc.pcie_fraction, where)
        out["offload_exposed"] = max(0.0, 2 * w.offload_bytes * w.grad_accum / pcie - compute_s)
    return out


def document_pair_fraction(seq_len: int, mix=DOCUMENT_MIX) -> tuple[float, float]:
    """(visible pairs / S^2, pair-weighted block length) of rows packed from `mix` with document masking."""
    fraction, length_weighted = 0.0, 0.0
    for share, length in mix:
        doc = min(length or seq_len, seq_len)
        pairs = share * seq_len / doc * doc * (doc + 1) / 2 / seq_len ** 2
        fraction += pairs
        length_weighted += pairs * doc
    return fraction, length_weighted / fraction


PREDICTION_STATEMENT = ("predicted: calibrated step time (training/planning/step_model.py): GEMMs at cuBLAS's measured "
                        "rate, attention at its kernel's (cuDNN on H100/H200: FlashAttention-2's rate times cuDNN's "
                        "measured speed-up; FlashAttention-2 on A100 and for packed documents; a CP ring at the zigzag "
                        "ring's measured share of one call), "
                        "elementwise work at achieved HBM bandwidth, collectives at NCCL's bus bandwidth with FSDP "
                        "prefetch and the ring under attention; band = the sources' spread (docs/predictions.md)")


def accelerator_for(hw) -> AcceleratorSpec:
    """The recipe's accelerator with its link overrides (hardware.nvlink_gb_per_s, network_gb_per_s)."""
    import dataclasses

    from training.planning.accelerators import accelerator

    spec = accelerator(hw.accelerator)
    links = {"nvlink_bytes_per_s": hw.nvlink_gb_per_s * 1e9, "ib_bytes_per_s": hw.network_gb_per_s * 1e9}
    return dataclasses.replace(spec, **{k: v for k, v in links.items() if v > 0})


def workload_for(cfg, dims, gpus_per_node: int, cp_ring_bytes: float | None, offload_bytes: float,
                 bandwidth_bytes: float | None = None) -> Workload:
    """The Workload of one resolved recipe stage; document masking counts the visible pairs of DOCUMENT_MIX;
    `bandwidth_bytes`: the memory probe's count (Workload.bandwidth_bytes)."""
    from models.llama import recipe_model_config

    t, p = cfg.training, cfg.parallelism
    fraction = length = None
    if cfg.data.document_masking:
        fraction, doc_length = pairs_from_stores(cfg, t.seq_len) or document_pair_fraction(t.seq_len)
        length = min(doc_length, t.seq_len / dims.cp)
    layout = Layout(dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, gpus_per_node)
    mcfg = recipe_model_config(cfg)
    return Workload(mcfg, layout, t.seq_len, t.local_batch_size, t.grad_accum_steps(dims.dp),
                    t.dtype, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.every, t.compiles("cuda"),
                    t.loss_tile_tokens(mcfg.vocab_size), p.reshard_after_forward, fraction, length, cp_ring_bytes,
                    offload_bytes, stage_attention_kernel(cfg), t.float8, cfg.model.mlp_chunk_tokens > 0,
                    bandwidth_bytes)


def stage_attention_kernel(cfg) -> str:
    """The kernel family a stage's attention runs on the recipe's accelerator: float32 the memory-efficient kernel,
    packed documents the flash varlen calls; otherwise `parallelism.attention_kernel` resolved by the accelerator's compute capability (auto:
    cuDNN on H100/H200), which the trainer also hands to SDPA as its backend order when no CP context runs."""
    from training.planning.accelerators import kernel_on

    if cfg.training.dtype == "float32":
        return "efficient"  # flash and cuDNN are half precision only: the memory-efficient kernel
    if cfg.data.document_masking:
        return "flash"
    return kernel_on(cfg.hardware.accelerator, cfg.parallelism.attention_kernel)


def pairs_from_stores(cfg, seq_len: int) -> tuple[float, float] | None:
    """(visible pairs / S^2, pair-weighted block length) of the recipe's prepared stores (data.cache_dir/stores/,
    every shard's per-document lengths), sources weighted by `weight`; a document longer than a row is cut into
    rows. None when a source has no prepared store here (the dry run then uses DOCUMENT_MIX)."""
    import glob
    import os

    import numpy as np

    from data.prepare import _safe

    sources = cfg.data.sources
    if not sources or not cfg.data.cache_dir:
        return None
    total_weight = sum(src.weight for src in sources)
    fraction = weighted_length = 0.0
    for src in sources:
        files = glob.glob(os.path.join(cfg.data.cache_dir, "stores", f"{_safe(src.name)}-*", "shard-*.lengths"))
        lengths = np.concatenate([np.fromfile(f, dtype=np.uint32) for f in files]) if files else np.zeros(0)
        if lengths.sum() == 0:
            return None
        lengths = lengths.astype(np.float64)
        whole, rest = np.divmod(lengths, seq_len)  # a document fills `whole` rows and a last piece of `rest`
        pieces = np.concatenate([np.full(int(whole.sum()), float(seq_len)), rest[rest > 0]])
        pairs = pieces * (pieces + 1) / 2
        share = src.weight / total_weight / lengths.sum()  # per token of this source
        fraction += share * pairs.sum() * seq_len / seq_len ** 2
        weighted_length += share * (pairs * pieces).sum() * seq_len / seq_len ** 2
    return fraction, weighted_length / fraction
