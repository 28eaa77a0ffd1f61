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

`SdpaToContextParallel`, the TorchFunctionMode each `context_parallel` block opens, is here too: it is what `ACTIVE`
holds and what sends SDPA to the op (under compile) or to the eager path, so the op and its mode need each other and
live in one module below the façade (parallelisms/context_parallel.py), which imports it from here.

torch ships the same pattern for its own CP all-gather ops (torch.distributed.tensor.experimental._context_parallel);
this one is written for this package's exchanges and layouts.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from config.errors import Refusal
from parallelisms.cp.attention import ring_attention
from parallelisms.cp.counters import CommStats, UnsupportedAttentionError
from parallelisms.cp.groups import group_name
from parallelisms.cp.kernel_blocks import grad_out_layout, kernel_family
from parallelisms.cp.kernel_cudnn_thd import packed_kernel
from parallelisms.cp.layouts import RING
from parallelisms.cp.op_variants import PACKED, backward as variant_backward, forward as variant_forward
from parallelisms.cp.packed_documents import PackedDocuments, packed_attention
from parallelisms.cp.plan_pieces import DocumentShards

if TYPE_CHECKING:  # an annotation only: choice.py is a floor above all the op runs (test_cp_structure's depth)
    from parallelisms.cp.choice import CPAttention

LIBRARY = "titan_cp"


class ActiveRuns:
    """The `context_parallel` blocks now open, by CP group name (innermost last). Process-wide on purpose: on CUDA the
    backward op runs on autograd's device thread, where a context variable of the training thread is not seen. Only
    `SdpaToContextParallel.__enter__/__exit__` change it (activation checkpointing's recompute re-enters the same
    block, pushing it again)."""

    def __init__(self):
        self._by_group: dict[str, list] = {}
        self.through_op = 0
        """While > 0, eager SDPA calls under a `context_parallel` block go through the registered op as compiled ones
        do: the `op` activation checkpoint sets it for its forward and recompute (parallelisms/
        activation_checkpoint.py), whose policy saves the op's outputs whole. On the Python path it saves the
        attention kernels' outputs but runs every other op of the call again in the recompute, the ring's sends and
        receives among them. Fake tensors (the dry run) keep the Python path, whose exchanges the probe measures."""

    @contextlib.contextmanager
    def routed_through_op(self):
        self.through_op += 1
        try:
            yield
        finally:
            self.through_op -= 1

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

    def sole(self) -> SdpaToContextParallel | None:
        """The innermost open block when blocks of one CP group only are open (a training step's), else None."""
        if len(self._by_group) != 1:
            return None
        (stack,) = self._by_group.values()
        return stack[-1]

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
    return own_outputs("attention", [out, lse], _forward_fakes(q), (q, k, v))


def _forward_fakes(q: torch.Tensor) -> list[torch.Tensor]:
    """The forward's outputs as its fake implementation lays them out, on the meta device (no memory)."""
    return [torch.empty_like(q, device="meta"), torch.empty(q.shape[:-1], dtype=torch.float32, device="meta")]


def own_outputs(op: str, results: list, fakes: list, inputs: tuple) -> tuple:
    """Each result checked against what the fake implementation says (shape, dtype, device: inductor plans every
    buffer from the fake and trusts it, so a variant that returned, say, float32 where the fake says bf16 would be
    read wrongly without a word), then in the fake's memory layout, so the strides a graph was traced with are the
    real ones on every path, and in storage of its own: an op's outputs may not alias its inputs or each other (the
    all-to-all returns dQ, dK and dV as views of one buffer). A copy only where either is not so already."""
    device = inputs[0].device
    taken = {x.untyped_storage().data_ptr() for x in inputs}
    owned = []
    for i, (x, fake) in enumerate(zip(results, fakes)):
        if x.shape != fake.shape or x.dtype != fake.dtype or x.device != device:
            raise RuntimeError(
                f"torch.ops.{LIBRARY}.{op} output {i} is {tuple(x.shape)} {x.dtype} on {x.device}, but its fake "
                f"implementation says {tuple(fake.shape)} {fake.dtype} on {device}, which is what a compiled graph "
                "was built for: the variant's result is wrong (parallelisms/cp/op_variants.py)")
        if x.stride() != fake.stride() or x.untyped_storage().data_ptr() in taken:
            x = torch.empty_like(fake, device=device).copy_(x)
        taken.add(x.untyped_storage().data_ptr())
        owned.append(x)
    return tuple(owned)


@cp_attention.register_fake
def _(q, k, v, is_causal, scale, group_name, variant):
    out, lse = (torch.empty_like(fake, device=q.device) for fake in _forward_fakes(q))
    return out, lse


@torch.library.custom_op(f"{LIBRARY}::attention_backward", mutates_args=())
def cp_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, is_causal: bool, scale: float | None, group_name: str,
                          variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's own output and log-sum-exp: nothing is recomputed but the exchanges."""
    grads = variant_backward(ACTIVE.current(group_name), variant, dout, q, k, v, out, lse, is_causal, scale)
    fakes = [torch.empty_like(x, device="meta") for x in (q, k, v)]
    return own_outputs("attention_backward", list(grads), fakes, (dout, q, k, v, out, lse))


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
    dq, dk, dv = torch.ops.titan_cp.attention_backward(grad_out_layout(dout), q, k, v, out, lse, *ctx.constants)
    return dq, dk, dv, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)
ATTENTION_OP = torch.ops.titan_cp.attention.default
ATTENTION_BACKWARD_OP = torch.ops.titan_cp.attention_backward.default


class SdpaToContextParallel(TorchFunctionMode):
    """Sends `F.scaled_dot_product_attention` to the CP variant (the ring, or `variant`: all-gather, Ulysses,
    hybrid, auto) after checking the call is one it computes exactly; every other torch call passes through."""

    def __init__(self, group: dist.ProcessGroup, load_balancer: str, local_lengths: set[int],
                 documents: DocumentShards | None, stats: CommStats | None, variant: CPAttention | None = None,
                 head_groups: int = 0, kernel: str = "auto", packed: PackedDocuments | None = None):
        super().__init__()
        self.head_groups, self.kernel = head_groups, kernel
        self.packed = packed  # CP 1 with documents: one packed-sequence call per layer (cp/packed_documents.py)
        self.group, self.load_balancer = group, load_balancer
        self.local_lengths, self.documents, self.stats = local_lengths, documents, stats
        self.variant = variant  # None: the ring
        # Run constants of the registered op (cp/op.py), the only attributes a compiled graph reads (and guards on):
        self.group_name = group_name(group)
        self.op_variant = PACKED if packed is not None else (variant.cp_impl if variant is not None else RING)

    def __enter__(self):
        ACTIVE.push(self.group_name, self)  # where the op, traced without this block's state, finds it at run time
        return super().__enter__()

    def __exit__(self, *exc):
        ACTIVE.pop(self.group_name, self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if torch.compiler.is_compiling():
                return self._route_op(*args, **kwargs)
            if ACTIVE.through_op and not isinstance(args[0] if args else kwargs.get("query"), FakeTensor):
                return self._route_op(*args, **kwargs)
            return self._route(*args, **kwargs)
        return func(*args, **kwargs)

    def _route_op(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        """Under torch.compile: one registered op (cp/op.py) whose arguments are run constants, so the block stays
        one graph and a new batch's plans need no recompile. The op runs the same kernels as `_route`."""
        self._check(query, key, attn_mask, dropout_p, enable_gqa)
        return ATTENTION_OP(query, key, value, is_causal, scale, self.group_name, self.op_variant)[0]

    def _route(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        self._check(query, key, attn_mask, dropout_p, enable_gqa)
        if self.packed is not None:
            if self.stats is not None:
                self.stats.calls += 1  # one CP attention call, nothing sent
            return packed_attention(query, key, value, self.packed, is_causal=is_causal, scale=scale,
                                    kernel=kernel_family(self.kernel, query),
                                    packed=packed_kernel(self.kernel, query))
        if self.variant is not None:
            return self.variant(query, key, value, is_causal=is_causal, scale=scale)
        return ring_attention(query, key, value, self.group, is_causal=is_causal, scale=scale,
                              load_balancer=self.load_balancer, stats=self.stats, head_groups=self.head_groups,
                              kernel=self.kernel, _documents=self.documents)

    def _check(self, query, key, attn_mask, dropout_p, enable_gqa) -> None:
        """The SDPA calls CP computes exactly; anything else raises instead of computing something else."""
        if attn_mask is not None:
            raise UnsupportedAttentionError(
                "scaled_dot_product_attention under context_parallel: an explicit attn_mask cannot be split over the "
                "ring; use is_causal=True, and pass document_ids= to context_parallel for packed documents")
        if dropout_p != 0.0:
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention under context_parallel: dropout_p={dropout_p} is not supported "
                "(the ring would need the same dropout pattern on every rank); use dropout_p=0.0")
        if query.dim() == 4 and key.dim() == 4 and query.size(1) != key.size(1) and not enable_gqa:
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention: {query.size(1)} query heads vs {key.size(1)} key/value heads "
                "needs enable_gqa=True (as without context parallelism)")
        if self.local_lengths and query.size(-2) not in self.local_lengths:
            raise UnsupportedAttentionError(
                f"scaled_dot_product_attention under context_parallel got a sequence of {query.size(-2)} tokens, but "
                f"the sharded buffers hold {sorted(self.local_lengths)} per rank: was the input sharded by "
                "context_parallel's buffers?")
