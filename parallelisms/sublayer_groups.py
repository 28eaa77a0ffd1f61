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
norms (the launch check refuses a recipe that asks for groups with those: `refusal`), or inside a compiled graph
(the backward's per-group autograd is eager: with groups, parallelize.apply_compile compiles the feed-forward only
and leaves the sublayer eager).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.rope import apply_rotary
from models.tile_loops import tile_starts
from parallelisms.cp.kernel_blocks import grad_out_layout
from parallelisms.cp.layouts import ALLGATHER, RING, ULYSSES
from parallelisms.cp.op import ACTIVE
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
    """The hook an Attention module calls first: the grouped sublayer's output, or None where it does not apply."""

    def __init__(self, groups: int):
        self.groups = groups
        self.calls = 0  # sublayers run in groups (the tests read it)

    def __call__(self, attention: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.groups <= 1 or torch.compiler.is_compiling():
            return None
        run = ACTIVE.sole()
        if run is None:
            return None
        variant = _variant(run)
        if variant not in GROUPED_VARIANTS or not _plain(attention, x):
            return None
        n_kv = attention.wk.weight.size(0) // attention.head_dim
        n_q = attention.wq.weight.size(0) // attention.head_dim
        if n_kv % self.groups or (variant == ULYSSES and (n_q // self.groups) % dist.get_world_size(run.group)):
            return None
        self.calls += 1
        return _GroupedSublayer.apply(x, attention.wq.weight, attention.wk.weight, attention.wv.weight,
                                      attention.wo.weight, cos, sin, _Plan(run, attention.head_dim, n_kv, self.groups))


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


class _GroupedSublayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, cos, sin, plan: _Plan):
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
        ctx.save_for_backward(x, wq, wk, wv, wo, cos, sin, out, lse)
        ctx.plan = plan
        return F.linear(out.view(bsz, seqlen, -1), wo)

    @staticmethod
    def backward(ctx, dy):
        x, wq, wk, wv, wo, cos, sin, out, lse = ctx.saved_tensors
        plan = ctx.plan
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
            with torch.enable_grad():  # RoPE's backward through autograd, on this group's q and k only
                q_in, k_in = (F.linear(x, w).view(bsz, seqlen, -1, d).detach().requires_grad_()
                              for w in (wq[q_rows], wk[kv_rows]))
                q, k = apply_rotary(q_in, cos, sin), apply_rotary(k_in, cos, sin)
            v = F.linear(x, wv[kv_rows]).view(bsz, seqlen, -1, d)
            g_out = torch.empty_like(q).copy_(out[:, :, q_heads]).transpose(1, 2)  # the forward's layout: q's
            dq, dk, dv = attention_backward(plan.run, plan.run.op_variant, grad_out_layout(d_out),
                                            q.detach().transpose(1, 2), k.detach().transpose(1, 2),
                                            v.transpose(1, 2), g_out, lse[:, q_heads].contiguous(), True,
                                            plan.scale)
            del d_out, g_out
            dq_in, dk_in = torch.autograd.grad((q, k), (q_in, k_in), (dq.transpose(1, 2), dk.transpose(1, 2)))
            del q, k, v, dq, dk, q_in, k_in
            for grad, rows, weight, dweight in ((dq_in, q_rows, wq, dwq), (dk_in, kv_rows, wk, dwk),
                                                (dv.transpose(1, 2), kv_rows, wv, dwv)):
                flat = grad.reshape(bsz * seqlen, -1)
                dx_flat.addmm_(flat, weight[rows])
                dweight[rows] = flat.t().mm(x_flat)
            del dq_in, dk_in, dv, flat, grad
        return dx, dwq, dwk, dwv, dwo, None, None, None
