"""A stated roofline for one optimizer step on GPUs: compute at the data-sheet peak, collectives at link bandwidth.

The dry run prints what this gives next to the measured memory. It is a bound, not a benchmark: two step times are
given, "overlap" (every byte moves while the GPU computes: step = max(compute, NVLink time, InfiniBand time)) and
"serial" (nothing overlaps: their sum). Real runs land between the two, minus kernel efficiency (real matmuls and
flash attention reach ~60-75% of peak).

Which link a collective uses follows the mesh order (outer to inner: pp, dp_replicate, dp_shard, cp, tp): a group
whose ranks span at most `gpus_per_node` consecutive ranks stays on NVLink, otherwise its ring crosses InfiniBand,
which then bounds it.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.llama import LlamaConfig


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float
    """Dense bf16 tensor-core FLOP/s (no sparsity); fp32 matmuls are counted at half that (TF32)."""
    nvlink_bytes_per_s: float
    """Per GPU, one direction."""
    ib_bytes_per_s: float
    """Per GPU, one direction (one NIC per GPU)."""


# Published figures: H100 SXM5 data sheet 989 TFLOP/s dense bf16; NVLink 4 = 900 GB/s per GPU both directions;
# InfiniBand NDR ConnectX-7 = 400 Gb/s per GPU.
H100_SXM = Accelerator("H100 SXM", bf16_flops=989e12, nvlink_bytes_per_s=450e9, ib_bytes_per_s=50e9)
ROOFLINE_STATEMENT = ("roofline: the accelerator's data-sheet dense bf16 peak (fp32 at half), NVLink and network at "
                      "their link rates (H100 SXM: 989 TFLOP/s, 450 and 50 GB/s per GPU per direction); 'overlap' = "
                      "max(compute, comm), 'serial' = sum")


@dataclass(frozen=True)
class Layout:
    """The parallel degrees and how many GPUs share a node."""
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def intra_node(self, span: int) -> bool:
        """Whether a group spanning `span` consecutive ranks fits in one node."""
        return span <= self.gpus_per_node


@dataclass
class StepCost:
    model_flops: float = 0.0
    """Per rank: the model's training FLOPs (causal attention counted as half), without recomputation."""
    hardware_flops: float = 0.0
    """Per rank: model FLOPs plus activation-checkpoint recomputation."""
    nvlink_bytes: float = 0.0
    ib_bytes: float = 0.0
    compute_dtype_factor: float = 1.0
    """1 for bf16; 2 for fp32 (TF32 runs at half the bf16 rate)."""

    def add_comm(self, nbytes: float, intra_node: bool) -> None:
        if intra_node:
            self.nvlink_bytes += nbytes
        else:
            self.ib_bytes += nbytes

    def times(self, acc: Accelerator) -> dict:
        compute = self.hardware_flops * self.compute_dtype_factor / acc.bf16_flops
        nvlink = self.nvlink_bytes / acc.nvlink_bytes_per_s
        ib = self.ib_bytes / acc.ib_bytes_per_s
        overlap = max(compute, nvlink, ib)
        serial = compute + nvlink + ib
        return {"compute_s": compute, "nvlink_s": nvlink, "ib_s": ib, "overlap_s": overlap, "serial_s": serial,
                "mfu_overlap": self.model_flops / (overlap * acc.bf16_flops) if overlap else 0.0,
                "mfu_serial": self.model_flops / (serial * acc.bf16_flops) if serial else 0.0}


def forward_flops_per_token(m: LlamaConfig, seq_len: int) -> tuple[float, float]:
    """(block forward FLOPs, output-projection forward FLOPs) per token; causal attention scores count half."""
    attn_proj = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads)
    block_matmuls = attn_proj + 3 * m.dim * m.ffn_hidden_dim
    attention = 2 * m.n_heads * m.head_dim * seq_len  # QK^T and PV: 2 x 2 x H x D x S, halved by causality
    return m.n_layers * (2.0 * block_matmuls + attention), 2.0 * m.dim * m.vocab_size


def recomputed_block_fraction(ac_mode: str, every: int) -> float:
    """Share of block forwards that activation checkpointing runs twice (op-level AC recomputes no matmul)."""
    return {"full": 1.0, "selective": 1.0 / max(1, every)}.get(ac_mode, 0.0)


def step_cost(m: LlamaConfig, layout: Layout, *, seq_len: int, local_batch_size: int, grad_accum: int,
              dtype: str, ac_mode: str, ac_every: int, reshard_after_forward: bool,
              cp_ring_bytes: float | None) -> StepCost:
    """Per-rank FLOPs and bytes of one optimizer step. `cp_ring_bytes`: the ring's measured sends per rank per
    micro-batch (None = estimate from the K/V sizes)."""
    cost = StepCost(compute_dtype_factor=2.0 if dtype == "float32" else 1.0)
    lay = layout
    rows = local_batch_size * grad_accum  # rows of one DP rank per step
    tokens_per_rank = rows * seq_len / (lay.cp * lay.tp * lay.pp)  # work split of one DP rank's rows
    block_fwd, output_fwd = forward_flops_per_token(m, seq_len)
    cost.model_flops = 3.0 * (block_fwd + output_fwd) * tokens_per_rank
    cost.hardware_flops = cost.model_flops + block_fwd * tokens_per_rank * recomputed_block_fraction(ac_mode, ac_every)

    act_bytes = 4 if dtype == "float32" else 2
    local_tokens = local_batch_size * seq_len // lay.cp  # per micro-batch, before SP splits it over tp
    layers_per_rank = m.n_layers / lay.pp
    # FSDP over dp_shard x cp (stride tp), replicated over dp_replicate (HSDP).
    n = lay.dp_shard * lay.cp
    shard_bytes, replicate_bytes = fsdp_bytes_per_step(m, lay, dtype, grad_accum, reshard_after_forward)
    cost.add_comm(shard_bytes, lay.intra_node(n * lay.tp))
    cost.add_comm(replicate_bytes, lay.intra_node(lay.dp_replicate * n * lay.tp))
    # TP with sequence parallelism: 2 all-gathers + 2 reduce-scatters of the activations per block forward, the
    # same in backward, and again for a recomputed forward.
    if lay.tp > 1:
        collectives = 8 + 4 * recomputed_block_fraction(ac_mode, ac_every)
        per_layer = collectives * local_tokens * m.dim * act_bytes * (lay.tp - 1) / lay.tp
        cost.add_comm(per_layer * layers_per_rank * grad_accum, lay.intra_node(lay.tp))
    # CP ring: measured sends when available; else K/V blocks (cp - 1 hops) forward, and backward K/V plus float32
    # dK/dV accumulators.
    if lay.cp > 1:
        if cp_ring_bytes is None:
            kv = 2 * local_tokens * m.num_kv_heads * m.head_dim // lay.tp
            forwards = 1 + recomputed_block_fraction(ac_mode, ac_every)
            cp_ring_bytes = layers_per_rank * (lay.cp - 1) * (forwards * kv * act_bytes + kv * (act_bytes + 4))
        cost.add_comm(cp_ring_bytes * grad_accum, lay.intra_node(lay.cp * lay.tp))
    # PP: one activation (and its gradient) per micro-batch crosses each stage boundary.
    if lay.pp > 1:
        boundary = 2 * local_tokens * m.dim * act_bytes / lay.tp
        cost.add_comm(boundary * grad_accum, lay.intra_node(lay.world))
    return cost


def fsdp_bytes_per_step(m: LlamaConfig, layout: Layout, dtype: str, grad_accum: int,
                        reshard_after_forward: bool, float8_params: float = 0.0) -> tuple[float, float]:
    """Bytes one rank sends for FSDP in one step: (within its dp_shard x cp group, across dp_replicate replicas).
    Per micro-batch: an all-gather of the parameters in the compute dtype for forward (and again for backward when
    resharded after forward) and a float32 reduce-scatter of the gradients; HSDP all-reduces the float32 shards.
    `float8_params` (of the whole model) are all-gathered in float8, 1 byte each (tensorwise float8 training)."""
    lay = layout
    n, r = lay.dp_shard * lay.cp, lay.dp_replicate
    params = parameter_count(m) / (lay.pp * lay.tp)
    param_bytes = 4 if dtype == "float32" else 2
    gathered = params * param_bytes - float8_params / (lay.pp * lay.tp) * (param_bytes - 1)
    shard = (n - 1) / n * ((2 if reshard_after_forward else 1) * gathered + params * 4) * grad_accum
    replicate = 2 * params / n * 4 * (r - 1) / r
    return shard, replicate


def parameter_count(m: LlamaConfig) -> float:
    """Every parameter, embeddings and output included (once when tied); q/k/v biases and q/k norms too."""
    block = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads) + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim
    block += (m.n_heads + 2 * m.num_kv_heads) * m.head_dim * m.qkv_bias + 2 * m.head_dim * m.qk_norm
    return m.n_layers * block + (1 if m.tie_embeddings else 2) * m.dim * m.vocab_size + m.dim
