"""Tensor parallelism with sequence parallelism and loss parallelism for the Llama blocks (Megatron-style plan).

Between blocks the residual stream is sharded on the sequence dim (SP): norms run on 1/tp of the tokens, and the
all-gather before attention / feed-forward and the reduce-scatter after them replace TP's all-reduces. Inside a block
wq/wk/wv and w1/w3 are column-wise (each rank holds whole heads / a slice of the hidden dim) and wo/w2 row-wise, so
attention sees its LOCAL heads as plain tensors (the model infers the head count from the projection size) and calls
SDPA with unexpanded local K/V; under context parallelism that call becomes the ring over the CP group.
A tied model keeps one parameter: embedding and output weight are the same Shard(0) DTensor.
With loss parallelism the output projection stays sharded on the vocabulary and the cross entropy is computed on the
shards (training/loss.py's `loss_context`), so the (tokens x vocab) logits are never gathered.

Works on a pipeline stage too: modules a stage does not hold (None) are skipped.
With float8 tensorwise (parallelisms/float8.py) the blocks' Float8Linear modules take torchao's float8 styles: the
same shardings, with the input cast to float8 before the all-gather and the output gradient before the
reduce-scatter; rowwise float8 keeps the plain styles (torchao's cast tensorwise).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from config import RecipeError


def check_tp_degree(n_heads: int, n_kv_heads: int, tp: int, where: str = "recipe") -> None:
    """Whole heads per rank: the column-wise split of wq/wk/wv must not cut a head."""
    if n_heads % tp:
        raise RecipeError(f"{where}: model n_heads {n_heads} is not divisible by parallelism.tp {tp}. "
                          f"Use a tp that divides {n_heads}.")
    if n_kv_heads % tp:
        raise RecipeError(f"{where}: model n_kv_heads {n_kv_heads} is not divisible by parallelism.tp {tp} "
                          f"(grouped-query attention shards K/V heads too). Use a tp that divides {n_kv_heads}.")


def _block_plan(block: nn.Module, float8=None) -> dict:
    """The block's plan; with `float8` (parallelisms/float8.Float8TpStyles) its Float8Linear modules get the float8
    styles, and a module's input is cast to float8 before its all-gather when all the linears it feeds are float8."""
    def styles(*linears: str) -> tuple:
        if float8 is None or not all(isinstance(block.get_submodule(n), float8.linear) for n in linears):
            return ColwiseParallel, RowwiseParallel, PrepareModuleInput
        return float8.colwise, float8.rowwise, float8.prepare_input

    colwise, rowwise, prepare = styles("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    mlp_colwise, mlp_rowwise, mlp_prepare = styles("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
    # Block inputs: h (B, S/tp, dim) sequence-sharded; cos/sin (B, S, 1, head_dim/2) plain tensors, left alone.
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        # Qwen3's per-head q/k norms see (B, S, local heads, head_dim): sharded on the head dim like a sequence,
        # with the weight replicated, so its gradient is summed over the TP ranks.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "ffn_norm": SequenceParallel(),
        "feed_forward": mlp_prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": mlp_colwise(),
        "feed_forward.w3": mlp_colwise(),
        "feed_forward.w2": mlp_rowwise(output_layouts=Shard(1)),
    }


def apply_tp(model: nn.Module, tp_mesh, loss_parallel_enabled: bool = True, float8=None) -> None:
    """Shards `model` (a full Llama or a pipeline stage of one) in place over the 1-D `tp_mesh`.

    Stage boundaries carry the sequence-sharded residual stream as plain tensors (B, S/tp, dim). With
    `loss_parallel_enabled` the last stage returns vocabulary-sharded DTensor logits: compute the loss inside
    `loss_context(True)`. `float8`: torchao's float8 styles for Float8Linear modules (parallelisms/float8.py).
    """
    top: dict = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel_enabled else Replicate(),
                                        use_local_output=not loss_parallel_enabled)
    if top:
        parallelize_module(model, tp_mesh, top)
        # Tied embeddings: the vocabulary-parallel embedding and the column-wise output both hold Shard(0) of the
        # (vocab x dim) matrix, so one sharded parameter serves both; the plans above each made their own copy.
        model.tie_weights()
    for block in model.layers.values():
        plan = _block_plan(block, float8)
        if block.attention.q_norm is None:  # plans name only modules that exist
            plan = {k: v for k, v in plan.items() if not k.endswith(("q_norm", "k_norm"))}
        parallelize_module(block, tp_mesh, plan)

