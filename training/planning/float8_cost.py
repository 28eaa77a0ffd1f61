"""What float8 linear layers (training.float8, parallelisms/float8.py) change in a step's predicted time.

- **GEMMs.** The blocks' converted linear layers run their three GEMMs in float8 at the dense FP8 tensor-core rate
  (`AcceleratorSpec.fp8_flops`: H100/H200 1,979 TFLOP/s, twice bf16) times bf16's achieved fraction; the embedding
  and output projection stay in the training dtype. A100 has no FP8 tensor cores (`float8_problem` refuses it).
- **Scaling and casting** (torchao's dynamic scales): every GEMM operand is cast to float8 after a max-abs pass over
  it. Per token of a converted linear with K inputs and N outputs, in bf16 activations:
  - tensorwise: the input's max-abs and cast in forward (read 2K twice, write K), the output gradient's in backward
    (the same over N), and the two float8 operands of the weight-gradient GEMM transposed (read and write 1 byte
    each): 7 (K + N) bytes;
  - rowwise: each operand is cast along both of its axes (the weight gradient reduces over tokens), so the
    activation-side casts happen twice: 10 (K + N) bytes.
  Each weight is cast twice per micro-step (forward, and transposed for the input gradient): read its stored
  dtype, write 1 byte. An eager step counts these bytes itself (the memory probe runs torchao's casts on fake
  tensors); a compiled step adds them to its formula.
- **FSDP2 all-gathers** with tensorwise scaling move the converted weights in float8, 1 byte each
  (workload.fsdp_bytes_per_step).
"""
from __future__ import annotations

from models.llama import LlamaConfig
from parallelisms.float8 import converts_linear
CAST_BYTES_PER_FEATURE = {"tensorwise": 7.0, "rowwise": 10.0}
"""Activation-side scaling and casting bytes per token per input or output feature of a converted linear (above)."""


def block_linears(m: LlamaConfig) -> list[tuple[int, int, bool]]:
    """(in features, out features, in the feed-forward) of one block's linear layers."""
    q, kv, d, f = m.n_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.dim, m.ffn_hidden_dim
    return [(d, q, False), (d, kv, False), (d, kv, False), (q, d, False), (d, f, True), (d, f, True), (f, d, True)]


def converted_linears(m: LlamaConfig, tiled_mlp: bool) -> list[tuple[int, int]]:
    """(K, N) of one block's linear layers that training.float8 converts: dims multiples of 16, and not the
    feed-forward's when model.mlp_chunk_tokens tiles it (its weights are multiplied directly, never the modules)."""
    return [(k, n) for k, n, mlp in block_linears(m) if converts_linear(k, n, mlp, tiled_mlp)]


def converted_gemm_share(m: LlamaConfig, tiled_mlp: bool) -> float:
    """Share of one block's linear-layer FLOPs that run in float8."""
    total = sum(k * n for k, n, _ in block_linears(m))
    return sum(k * n for k, n in converted_linears(m, tiled_mlp)) / total


def converted_params_per_block(m: LlamaConfig, tiled_mlp: bool) -> float:
    return float(sum(k * n for k, n in converted_linears(m, tiled_mlp)))


def cast_bytes(m: LlamaConfig, recipe: str, tiled_mlp: bool, tokens: float, forwards: float,
               weight_bytes: int) -> float:
    """HBM bytes of float8 scaling and casting in one block's micro-step: `tokens` per rank, `forwards` forward
    passes (1 + recomputation; the forward's input cast, 5 bytes per input feature, runs again), weights stored at
    `weight_bytes` each."""
    linears = converted_linears(m, tiled_mlp)
    inputs, outputs = sum(k for k, _ in linears), sum(n for _, n in linears)
    per_feature = CAST_BYTES_PER_FEATURE[recipe]
    activation = tokens * (per_feature * (inputs + outputs) + 5.0 * inputs * (forwards - 1.0))
    weights = sum(k * n for k, n in linears) * 2 * (weight_bytes + 1)
    return activation + weights


def float8_problem(recipe: str, accelerator: str, fp8_flops: float) -> str | None:
    """Why `recipe` cannot run on `accelerator`, or None."""
    if recipe != "off" and fp8_flops <= 0:
        return (f"training.float8 = \"{recipe}\" needs FP8 tensor cores (CUDA's _scaled_mm: compute capability 8.9+, "
                f"H100/H200/L40S/B200) and hardware.accelerator = \"{accelerator}\" has none. Set training.float8 = "
                "\"off\" or plan for an H100/H200")
    return None


def float8_statement(recipe: str, m: LlamaConfig, tiled_mlp: bool) -> str:
    """The dry run's header line for a float8 recipe: what runs in float8 and how it is priced."""
    converted = len(converted_linears(m, tiled_mlp))
    kept = "; the feed-forward stays in the training dtype (model.mlp_chunk_tokens tiles it)" if tiled_mlp else ""
    gather = ", FSDP2 all-gathers them in float8 (1 byte per weight)" if recipe == "tensorwise" else ""
    return (f"float8: {recipe} (training.float8): {converted} of each block's 7 linear layers, "
            f"{converted_gemm_share(m, tiled_mlp):.0%} of its GEMM FLOPs, at the FP8 tensor-core rate plus torchao's "
            f"scaling casts{gather}; embedding and output in the training dtype{kept} "
            "(training/planning/float8_cost.py)")
