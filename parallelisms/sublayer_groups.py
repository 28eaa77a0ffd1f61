"""The whole attention sublayer in head groups (`parallelism.attention_sublayer_groups`): project, rotate and attend one
group of K/V heads (with the query heads that read them) at a time, so that the queries, keys and values, their
rotations, the attention output's gradient and dQ/dK/dV exist for one group only, not for every head at once.

Why: at 1M tokens per rank (Llama 3 8B, 32 query heads of 128) those tensors are ~30 KiB per token at the attention
backward, the step's peak (docs/frontier.md): q and k rotated 10, dQ/dK/dV 12, the output's gradient 8. The CP op's
own head groups (parallelisms/cp/autograd.py) cover only what lives inside one attention call. UPipe (arXiv
2602.21196) makes the same cut; this is our own code on our CP op.

One autograd function per sublayer, x (the attention norm's output) -> wo(attention(rope(wq x), rope(wk x), wv x)):
- forward: per group, q/k/v from the row slices of wq/wk/wv, RoPE, the CP attention's forward (its out and float32
  log-sum-exp written into whole buffers: the output projection and its weight gradient read every head), then one
  output projection over all heads, as the unsplit sublayer computes it;
- backward: the weight gradient of wo from the saved output; per group the output's gradient through wo's column
  slice, q/k/v projected and rotated again from the saved x (GEMMs: cheap beside attention at long context), the CP
  attention's backward from the saved out and lse (no attention forward again), then RoPE's and the projections'
  backward; x's gradient accumulated over the groups.
It saves x, out and lse: what the unsplit sublayer saves, less q, k and v. The numbers equal the unsplit sublayer's
but for the rounding of per-group GEMMs and the accumulation of x's gradient over groups (tests/parallelisms/
test_sublayer_groups.py). The attention itself runs the CP op's forward and backward bodies (cp/op_variants.py) on
the open `context_parallel` block, as the op does; fake tensors (the dry run) run them too, so its probe measures
the exchanges and walks three groups as it walks tiles (models/tile_loops.py).

Where it does not apply, the model's own forward runs (the hook answers None): no open `context_parallel` block
(a model called outside the trainer's step, which opens a one-rank block at CP 1 for it: training/step.py), a
variant that picks its exchange from the first call's heads (hybrid, auto), Ulysses where a group's query heads do
not split over the CP ranks, tensor parallelism (DTensor weights), float8 or biased projections, per-head q/k
norms (the launch check refuses a recipe that asks for groups with those: `refusal`).

Under `torch.compile` the sublayer is one registered op pair (`torch.ops.titan_cp.grouped_sublayer` and its
backward) over the same forward and backward bodies, so a whole block stays one graph with the group loop inside the
op (parallelize.apply_compile); its arguments are tensors and the group count and head size, and it reads the open
block when it runs, as the CP op does. RoPE's backward is the rotation by the opposite angle (models/rope.py
`rotary_backward`), so the backward records no autograd graph and runs the same as an op body.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from config.errors import Refusal
from models.rope import apply_rotary, rotary_backward
from models.tile_loops import tile_starts
from parallelisms.cp.kernel_blocks import grad_out_layout
from parallelisms.cp.layouts import ALLGATHER, RING, ULYSSES
from parallelisms.cp.op import ACTIVE, LIBRARY, own_outputs
from parallelisms.cp.op_variants import PACKED, backward as attention_backward, forward as attention_forward

GROUPED_VARIANTS = (RING, ALLGATHER, PACKED, ULYSSES)
"""The CP variants a group of heads runs as a smaller call of the same exchange: the ring and the all-gather keep
every head on every rank; Ulysses scatters each group's query heads over the CP ranks, so a group's query heads must
split over them (`refusal`). Hybrid and auto choose their exchange from the head counts of the first call, which a
group would change."""


def refusal(cfg, n_heads: int, n_kv_heads: int, biased_or_normed: bool) -> str | None:
    """Why a recipe's `parallelism.attention_sublayer_groups` (> 1) would not run grouped, as the fix to make; None
    when it will. Checked before any rank starts (training/launch_checks/preflight.py): a setting that silently did
    nothing would leave the dry run's plan wrong."""
    p, groups = cfg.parallelism, cfg.parallelism.attention_sublayer_groups
    if n_kv_heads % groups:
        divisors = [g for g in range(2, n_kv_heads + 1) if n_kv_heads % g == 0]
        return f"it must divide the model's {n_kv_heads} K/V heads: use one of {divisors} (or 0 = off)."
    if p.cp > 1 and p.cp_impl not in ("ring", "allgather", "ulysses"):
        return (f"cp_impl = \"{p.cp_impl}\" picks its exchange from the heads of the first call; the grouped "
                f"sublayer runs on the ring, allgather or ulysses: set parallelism.cp_impl = \"ring\".")
    if p.cp > 1 and p.cp_impl == "ulysses" and (n_heads // groups) % p.cp:
        fits = [g for g in range(2, n_kv_heads + 1) if n_kv_heads % g == 0 and (n_heads // g) % p.cp == 0]
        return (f"under cp_impl = \"ulysses\" each group's {n_heads // groups} query heads must split over cp {p.cp}: "
                f"use one of {fits or 'none'} (or cp_impl = \"ring\").")
    if p.tp > 1 or cfg.training.float8 != "off" or biased_or_normed:
        return ("it needs plain, unbiased projections without per-head q/k norms, no tensor parallelism and no "
                "float8: set parallelism.tp = 1 and training.float8 = \"off\", or attention_sublayer_groups = 0.")
    if cfg.activation_checkpoint.mode == "op":
        return ("activation_checkpoint.mode = \"op\" would run its attention again in the recompute (the grouped "
                "sublayer keeps its own output and log-sum-exp): use mode = \"full\".")
    return None


def install(model: nn.Module, groups: int) -> int:
    """Makes every attention module of `model` run its sublayer in `groups` K/V head groups where it may (module
    docstring); returns how many modules took it. `groups` must divide the K/V heads (the recipe check says so)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "sublayer_hook") and hasattr(module, "wq"):
            module.sublayer_hook = SublayerGroups(groups)
            count += 1
    return count


class SublayerGroups:
    """The hook an Attention module calls first: the grouped sublayer's output, or None where it does not apply.

    Eager (and on the dry run's fake tensors): `_GroupedSublayer`, an autograd function over the bodies below, so the
    dry run's probe sees every group's tensors. Inside a compiled block: the registered op pair
    `torch.ops.titan_cp.grouped_sublayer` / `grouped_sublayer_backward` over the same bodies, one node of the block's
    graph (the group loop runs inside it: no graph per group, no graph break), whose run constants are the group
    count and head size only; the open `context_parallel` block is read when the op runs, as the CP op reads it
    (cp/op.py)."""

    def __init__(self, groups: int):
        self.groups = groups
        self.calls = 0  # sublayers run in groups (the tests read it)

    def __call__(self, attention: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.groups <= 1 or not _plain(attention, x):
            return None
        weights = (attention.wq.weight, attention.wk.weight, attention.wv.weight, attention.wo.weight)
        if attention.wk.weight.size(0) // attention.head_dim % self.groups:
            return None
        if torch.compiler.is_compiling():
            self.calls += 1
            return GROUPED_SUBLAYER_OP(x, *weights, cos, sin, self.groups, attention.head_dim)[0]
        plan = _open_plan(attention.head_dim, attention.wq.weight.size(0), attention.wk.weight.size(0), self.groups)
        if plan is None:
            return None
        self.calls += 1
        return _GroupedSublayer.apply(x, *weights, cos, sin, plan)


def _open_plan(head_dim: int, q_rows: int, kv_rows: int, groups: int) -> _Plan | None:
    """The plan of one call on the open `context_parallel` block, or None where the grouped sublayer does not apply
    there (no block, a variant that picks its exchange per call, Ulysses with a group's query heads not splitting
    over the ranks)."""
    run = ACTIVE.sole()
    if run is None:
        return None
    variant = _variant(run)
    n_q, n_kv = q_rows // head_dim, kv_rows // head_dim
    if variant not in GROUPED_VARIANTS or n_kv % groups:
        return None
    if variant == ULYSSES and (n_q // groups) % dist.get_world_size(run.group):
        return None
    return _Plan(run, head_dim, n_kv, groups)


def _variant(run) -> str:
    return run.op_variant if run.op_variant in (RING, PACKED) else run.variant.cp_impl


def _plain(attention: nn.Module, x: torch.Tensor) -> bool:
    linears = (attention.wq, attention.wk, attention.wv, attention.wo)
    return (attention.q_norm is None and all(type(m) is nn.Linear and m.bias is None for m in linears)
            and not any(isinstance(t, DTensor) for t in (x, *(m.weight for m in linears))))


class _Plan:
    """One call's constants: the open CP block, the head sizes and each group's query and K/V head slices."""

    def __init__(self, run, head_dim: int, n_kv: int, groups: int):
        self.run, self.head_dim, self.groups = run, head_dim, groups
        self.kv_per = n_kv // groups
        self.scale = head_dim ** -0.5

    def slices(self, n_q: int, g: int) -> tuple[slice, slice]:
        q_per = n_q // self.groups
        return slice(g * q_per, (g + 1) * q_per), slice(g * self.kv_per, (g + 1) * self.kv_per)

    def rows(self, heads: slice) -> slice:
        """The projection weight's rows of these heads."""
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def project(self, x, wq_rows, wk_rows, wv_rows, cos, sin):
        """A group's rotated queries and keys and its values from its rows of wq, wk and wv: (B, H_group, S, D) views
        of (B, S, H, D) memory, as the model's own sublayer lays them out."""
        bsz, seqlen, _ = x.shape
        q, k, v = (F.linear(x, w).view(bsz, seqlen, -1, self.head_dim) for w in (wq_rows, wk_rows, wv_rows))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _forward_body(plan: _Plan, x, wq, wk, wv, wo, cos, sin):
    """(the sublayer's output, the attention output (B, S, H, D), its float32 log-sum-exp (B, H, S))."""
    bsz, seqlen, _ = x.shape
    n_q = wq.size(0) // plan.head_dim
    variant = plan.run.op_variant
    out = x.new_empty(bsz, seqlen, n_q, plan.head_dim)  # (B, S, H, D): the output projection's input layout
    lse = torch.empty(bsz, n_q, seqlen, dtype=torch.float32, device=x.device)
    for g in tile_starts(plan.groups, 1, x):  # every group; a dry run's fake tensors: three
        q_heads, kv_heads = plan.slices(n_q, g)
        q_rows, kv_rows = plan.rows(q_heads), plan.rows(kv_heads)
        q, k, v = plan.project(x, wq[q_rows], wk[kv_rows], wv[kv_rows], cos, sin)
        g_out, g_lse = attention_forward(plan.run, variant, q, k, v, True, plan.scale)
        out[:, :, q_heads] = g_out.transpose(1, 2)
        lse[:, q_heads] = g_lse
        del q, k, v, g_out, g_lse
    return F.linear(out.view(bsz, seqlen, -1), wo), out, lse


def _backward_body(plan: _Plan, dy, x, wq, wk, wv, wo, cos, sin, out, lse):
    """(dx, dwq, dwk, dwv, dwo), every op run directly (no autograd graph: it is also a registered op's body)."""
    bsz, seqlen, dim = x.shape
    n_q, d = wq.size(0) // plan.head_dim, plan.head_dim
    x_flat, dy_flat = x.reshape(-1, dim), dy.reshape(-1, dim)
    dwo = dy_flat.t().mm(out.view(bsz * seqlen, -1))
    dx = torch.zeros_like(x)  # accumulated in place over the groups: no whole-width temporary per projection
    dx_flat = dx.view(-1, dim)
    dwq, dwk, dwv = (torch.empty_like(w) for w in (wq, wk, wv))  # every row written once, by its group
    for g in tile_starts(plan.groups, 1, x):
        q_heads, kv_heads = plan.slices(n_q, g)
        q_rows, kv_rows = plan.rows(q_heads), plan.rows(kv_heads)
        d_out = F.linear(dy, wo[:, q_rows].t()).view(bsz, seqlen, -1, d).transpose(1, 2)
        q, k, v = plan.project(x, wq[q_rows], wk[kv_rows], wv[kv_rows], cos, sin)
        g_out = torch.empty_like(q.transpose(1, 2)).copy_(out[:, :, q_heads]).transpose(1, 2)  # q's layout
        dq, dk, dv = attention_backward(plan.run, plan.run.op_variant, grad_out_layout(d_out), q, k, v, g_out,
                                        lse[:, q_heads].contiguous(), True, plan.scale)
        del d_out, g_out, q, k, v
        dq_in, dk_in = rotary_backward(dq.transpose(1, 2), cos, sin), rotary_backward(dk.transpose(1, 2), cos, sin)
        del dq, dk
        for grad, rows, weight, dweight in ((dq_in, q_rows, wq, dwq), (dk_in, kv_rows, wk, dwk),
                                            (dv.transpose(1, 2), kv_rows, wv, dwv)):
            flat = grad.reshape(bsz * seqlen, -1)
            dx_flat.addmm_(flat, weight[rows])
            dweight[rows] = flat.t().mm(x_flat)
        del dq_in, dk_in, dv, flat, grad
    return dx, dwq, dwk, dwv, dwo


class _GroupedSublayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, cos, sin, plan: _Plan):
        y, out, lse = _forward_body(plan, x, wq, wk, wv, wo, cos, sin)
        ctx.save_for_backward(x, wq, wk, wv, wo, cos, sin, out, lse)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        return *_backward_body(ctx.plan, dy, *ctx.saved_tensors), None, None, None


def _plan_or_refuse(op: str, x, wq, wk, groups: int, head_dim: int) -> _Plan:
    plan = _open_plan(head_dim, wq.size(0), wk.size(0), groups)
    if plan is None:
        raise Refusal(f"torch.ops.{LIBRARY}.{op} ran where the grouped attention sublayer does not apply (no "
                      "context_parallel block open, or its cp_impl picks the exchange per call, or Ulysses' groups do "
                      "not split over the ranks): run the compiled model inside the trainer's step, or set "
                      "parallelism.attention_sublayer_groups = 0")
    return plan


@torch.library.custom_op(f"{LIBRARY}::grouped_sublayer", mutates_args=())
def grouped_sublayer(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, groups: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the sublayer's output, attention output (B, S, H, D), float32 log-sum-exp (B, H, S)): `_forward_body` on the
    open `context_parallel` block."""
    plan = _plan_or_refuse("grouped_sublayer", x, wq, wk, groups, head_dim)
    results = _forward_body(plan, x, wq, wk, wv, wo, cos, sin)
    return own_outputs("grouped_sublayer", list(results), list(_forward_fakes(x, wq, wo, head_dim, "meta")),
                       (x, wq, wk, wv, wo, cos, sin))


def _forward_fakes(x, wq, wo, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's outputs as its fake implementation lays them out: y (B, S, dim), out (B, S, H, D) in x's dtype,
    lse (B, H, S) float32, all contiguous."""
    bsz, seqlen, _ = x.shape
    n_q = wq.size(0) // head_dim
    return (x.new_empty(bsz, seqlen, wo.size(0), device=device),
            x.new_empty(bsz, seqlen, n_q, head_dim, device=device),
            x.new_empty(bsz, n_q, seqlen, dtype=torch.float32, device=device))


@grouped_sublayer.register_fake
def _(x, wq, wk, wv, wo, cos, sin, groups, head_dim):
    return _forward_fakes(x, wq, wo, head_dim, x.device)


@torch.library.custom_op(f"{LIBRARY}::grouped_sublayer_backward", mutates_args=())
def grouped_sublayer_backward(dy: torch.Tensor, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                              wv: torch.Tensor, wo: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, groups: int,
                              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """(dx, dwq, dwk, dwv, dwo): `_backward_body` from the forward's own output and log-sum-exp."""
    plan = _plan_or_refuse("grouped_sublayer_backward", x, wq, wk, groups, head_dim)
    grads = _backward_body(plan, dy, x, wq, wk, wv, wo, cos, sin, out, lse)
    return own_outputs("grouped_sublayer_backward", list(grads),
                       [torch.empty_like(t, device="meta") for t in (x, wq, wk, wv, wo)],
                       (dy, x, wq, wk, wv, wo, cos, sin, out, lse))


@grouped_sublayer_backward.register_fake
def _(dy, x, wq, wk, wv, wo, cos, sin, out, lse, groups, head_dim):
    return tuple(torch.empty_like(t) for t in (x, wq, wk, wv, wo))


def _setup_context(ctx, inputs, output):
    x, wq, wk, wv, wo, cos, sin, groups, head_dim = inputs
    _, out, lse = output
    ctx.save_for_backward(x, wq, wk, wv, wo, cos, sin, out, lse)
    ctx.constants = (groups, head_dim)


def _backward(ctx, dy, d_out, d_lse):
    """The op's out and lse are the backward's saved state, not results the model reads: their gradients are
    None."""
    grads = GROUPED_SUBLAYER_BACKWARD_OP(dy.contiguous(), *ctx.saved_tensors, *ctx.constants)
    return *grads, None, None, None, None


grouped_sublayer.register_autograd(_backward, setup_context=_setup_context)
GROUPED_SUBLAYER_OP = torch.ops.titan_cp.grouped_sublayer.default
GROUPED_SUBLAYER_BACKWARD_OP = torch.ops.titan_cp.grouped_sublayer_backward.default
