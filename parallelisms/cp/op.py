"""Context-parallel attention as one registered op pair, so `torch.compile` keeps a whole transformer block in one
graph: `torch.ops.titan_cp.attention` (-> out, float32 lse) and `torch.ops.titan_cp.attention_backward` (-> dq, dk,
dv), tied by `register_autograd`, each with a fake implementation for tracing.

Why an op and not the Python exchanges: dynamo would trace the ring's point-to-point loop, break inside it and guard
on its Python counters and per-batch plans, recompiling every step. The op's arguments are tensors and run constants
only (is_causal, scale, the CP group's name, the variant: ring, allgather, ulysses, hybrid, auto, packed); the
per-batch state (document shards and plans, PackedDocuments, the counters, hybrid's sub-groups) is read when the op
runs, from the `context_parallel` block now open on that group (`ACTIVE`), so a graph never guards on it and a new
document plan every step reuses it. The variants' forward and backward bodies are in op_variants.py; the kernels
behind them are the eager path's (kernel_blocks, kernel_varlen, kernel_cudnn_thd, packed_documents).

torch ships the same pattern for its own CP all-gather ops (torch.distributed.tensor.experimental._context_parallel);
this one is written for this package's exchanges and layouts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from config.errors import Refusal
from parallelisms.cp.op_variants import backward as variant_backward, forward as variant_forward

if TYPE_CHECKING:
    from parallelisms.context_parallel import SdpaToContextParallel

LIBRARY = "titan_cp"


class ActiveRuns:
    """The `context_parallel` blocks now open, by CP group name (innermost last). Process-wide on purpose: on CUDA the
    backward op runs on autograd's device thread, where a context variable of the training thread is not seen. Only
    `SdpaToContextParallel.__enter__/__exit__` change it (activation checkpointing's recompute re-enters the same
    block, pushing it again)."""

    def __init__(self):
        self._by_group: dict[str, list] = {}

    def push(self, group_name: str, run: SdpaToContextParallel) -> None:
        self._by_group.setdefault(group_name, []).append(run)

    def pop(self, group_name: str, run: SdpaToContextParallel) -> None:
        stack = self._by_group.get(group_name, [])
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is run:
                del stack[i]
                break
        if not stack:
            self._by_group.pop(group_name, None)

    def current(self, group_name: str) -> SdpaToContextParallel:
        stack = self._by_group.get(group_name)
        if not stack:
            raise Refusal(f"torch.ops.{LIBRARY}.attention ran outside a context_parallel block on group "
                          f"{group_name!r} (parallelisms/cp/op.py): it reads that block's layout and plans; call the "
                          "model, forward and backward, inside `context_parallel(...)`")
        return stack[-1]


ACTIVE = ActiveRuns()


@torch.library.custom_op(f"{LIBRARY}::attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                 group_name: str, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out like q, float32 log-sum-exp (B, Hq, S_local)) of this rank's queries against the whole sequence."""
    out, lse = variant_forward(ACTIVE.current(group_name), variant, q, k, v, is_causal, scale)
    lse = lse.contiguous()
    return _own_outputs([out, lse], [q, lse], (q, k, v))


def _own_outputs(results: list, likes: list, inputs: tuple) -> tuple:
    """Each result in `torch.empty_like(like)`'s memory layout, so the fake implementation's strides are the real ones
    on every path, and in storage of its own: an op's outputs may not alias its inputs or each other (the all-to-all
    returns dQ, dK and dV as views of one buffer). A copy only where either is not so already."""
    taken = {x.untyped_storage().data_ptr() for x in inputs}
    owned = []
    for x, like in zip(results, likes):
        if x.stride() != torch.empty_like(like, device="meta").stride() or x.untyped_storage().data_ptr() in taken:
            x = torch.empty_like(like).copy_(x)
        taken.add(x.untyped_storage().data_ptr())
        owned.append(x)
    return tuple(owned)


@cp_attention.register_fake
def _(q, k, v, is_causal, scale, group_name, variant):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{LIBRARY}::attention_backward", mutates_args=())
def cp_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, is_causal: bool, scale: float | None, group_name: str,
                          variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's own output and log-sum-exp: nothing is recomputed but the exchanges."""
    grads = variant_backward(ACTIVE.current(group_name), variant, dout, q, k, v, out, lse, is_causal, scale)
    return _own_outputs(list(grads), [q, k, v], (dout, q, k, v, out, lse))


@cp_attention_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, group_name, variant):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, group_name, variant = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.constants = (is_causal, scale, group_name, variant)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_cp.attention_backward(dout.contiguous(), q, k, v, out, lse, *ctx.constants)
    return dq, dk, dv, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)
ATTENTION_OP = torch.ops.titan_cp.attention.default
ATTENTION_BACKWARD_OP = torch.ops.titan_cp.attention_backward.default
