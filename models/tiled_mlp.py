"""SwiGLU computed over tiles of tokens, each tile's intermediates recomputed in the backward.

The feed-forward's (tokens x ffn_dim) intermediates (gate, up, their product: 3.5x the hidden size each for Llama 3)
are the largest tensors of a block after attention has gone flash. `tiled_swiglu` keeps only the block input for the
backward and never holds more than one tile of intermediates: the forward computes tile by tile without saving
anything, the backward recomputes one tile, takes its gradients and moves on. Exact: every tile computes the same
rows as the untiled matmuls; weight gradients are accumulated over tiles in float32.

Tensor parallelism (column-wise w1/w3, row-wise w2 with a sequence-sharded output) is handled on local shards: the
caller passes the gathered input and the local weights, and turns the partial output into its sequence shard.

With the norm before it tiled too and no tensor parallelism, a block calls `tiled_norm_swiglu`: each tile
normalises its own rows (models/tiled_norm.py's per-tile math), so the norm's (tokens x dim) output, which the
SwiGLU's backward would otherwise keep, never exists whole; the backward recomputes a tile's normed rows and runs the
norm's backward on the tile's input gradient.

Under torch.compile the tile loops are registered ops (`titan_models::tiled_swiglu`, `tiled_norm_swiglu` and their
backwards): one call each way in the graph, whatever the sequence length, and the tiles stay tiles (inductor cannot
fuse them back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from models.autocast import to_autocast_dtype
from models.tile_loops import tile_starts
from models.tiled_norm import norm_tile, norm_backward_tile


def _tile_forward(x, w1, w3, w2):
    gate, up = x @ w1.t(), x @ w3.t()
    return (F.silu(gate) * up) @ w2.t()


def _forward_tiles(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   tile_tokens: int, norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """With `norm_weight`: x is the norm's input, each tile normalised first (the norm fused in: its output is
    never whole)."""
    out = x.new_empty(x.size(0), w2.size(0))
    for start in tile_starts(x.size(0), tile_tokens, x):
        xt = x[start:start + tile_tokens]
        if norm_weight is not None:
            xt = norm_tile(xt, norm_weight, eps)[0]
        out[start:start + tile_tokens] = _tile_forward(xt, w1, w3, w2)
    return out


@torch.library.custom_op("titan_models::tiled_swiglu", mutates_args=())
def _tiled_forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   tile_tokens: int) -> torch.Tensor:
    return _forward_tiles(x, w1, w3, w2, tile_tokens)


@_tiled_forward.register_fake
def _(x, w1, w3, w2, tile_tokens):
    return x.new_empty(x.size(0), w2.size(0))


def _backward_tiles(grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     tile_tokens: int, norm_weight: torch.Tensor | None = None, eps: float = 0.0
                     ) -> tuple[torch.Tensor, ...]:
    """(grad x, grad w1, grad w3, grad w2), and grad norm_weight last with the norm fused in: each tile's normed
    rows recomputed, the SwiGLU's gradient for them taken as the unfused pair hands it to the norm (in x's dtype),
    then the norm's backward on the tile."""
    grad_x = torch.empty_like(x)
    grad_w1, grad_w3, grad_w2 = (torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (w1, w3, w2))
    grad_norm = (torch.zeros(norm_weight.shape, dtype=torch.float32, device=x.device)
                 if norm_weight is not None else None)
    for start in tile_starts(x.size(0), tile_tokens, x):
        rows = slice(start, start + tile_tokens)
        xt, dout = x[rows], grad_out[rows]
        if norm_weight is not None:
            xt, rstd = norm_tile(xt, norm_weight, eps)
        gate, up = (xt @ w1.t()).float(), (xt @ w3.t()).float()
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        grad_w2 += (dout.t() @ (act * up).to(xt.dtype)).float()
        grad_h = (dout @ w2).float()
        grad_up = (grad_h * act).to(xt.dtype)
        grad_gate = (grad_h * up * sig * (1 + gate * (1 - sig))).to(xt.dtype)  # silu'(g) = s (1 + g (1 - s))
        del gate, up, sig, act, grad_h
        grad_xt = grad_x[rows] if norm_weight is None else torch.empty_like(xt)
        torch.mm(grad_gate, w1, out=grad_xt).addmm_(grad_up, w3)
        grad_w1 += (grad_gate.t() @ xt).float()
        grad_w3 += (grad_up.t() @ xt).float()
        if norm_weight is not None:
            grad_x[rows], tile_grad_norm = norm_backward_tile(grad_xt, x[rows], norm_weight, rstd)
            grad_norm += tile_grad_norm
    grads = (grad_x, grad_w1.to(w1.dtype), grad_w3.to(w3.dtype), grad_w2.to(w2.dtype))
    return grads if norm_weight is None else (*grads, grad_norm.to(norm_weight.dtype))


@torch.library.custom_op("titan_models::tiled_swiglu_backward", mutates_args=())
def _tiled_backward(grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_tiles(grad_out, x, w1, w3, w2, tile_tokens)


@_tiled_backward.register_fake
def _(grad_out, x, w1, w3, w2, tile_tokens):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, w1, w3, w2, tile_tokens = inputs
    ctx.save_for_backward(x, w1, w3, w2)
    ctx.tile_tokens = tile_tokens


def _backward(ctx, grad_out):
    return (*_tiled_backward(grad_out.contiguous(), *ctx.saved_tensors, ctx.tile_tokens), None)


_tiled_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("titan_models::tiled_norm_swiglu", mutates_args=())
def _normed_forward(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w1: torch.Tensor, w3: torch.Tensor,
                    w2: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    return _forward_tiles(x, w1, w3, w2, tile_tokens, norm_weight, eps)


@_normed_forward.register_fake
def _(x, norm_weight, eps, w1, w3, w2, tile_tokens):
    return x.new_empty(x.size(0), w2.size(0))


@torch.library.custom_op("titan_models::tiled_norm_swiglu_backward", mutates_args=())
def _normed_backward(grad_out: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, tile_tokens: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_tiles(grad_out, x, w1, w3, w2, tile_tokens, norm_weight, eps)


@_normed_backward.register_fake
def _(grad_out, x, norm_weight, eps, w1, w3, w2, tile_tokens):
    return (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2),
            torch.empty_like(norm_weight))


def _normed_setup_context(ctx, inputs, output):
    x, norm_weight, eps, w1, w3, w2, tile_tokens = inputs
    ctx.save_for_backward(x, norm_weight, w1, w3, w2)
    ctx.eps, ctx.tile_tokens = eps, tile_tokens


def _normed_backward_autograd(ctx, grad_out):
    x, norm_weight, w1, w3, w2 = ctx.saved_tensors
    grad_x, grad_w1, grad_w3, grad_w2, grad_norm = _normed_backward(grad_out.contiguous(), x, norm_weight, ctx.eps,
                                                                    w1, w3, w2, ctx.tile_tokens)
    return grad_x, grad_norm, None, grad_w1, grad_w3, grad_w2, None


_normed_forward.register_autograd(_normed_backward_autograd, setup_context=_normed_setup_context)


class _EagerTiles(torch.autograd.Function):
    """The same tiles outside torch.compile, op by op: the dry run's memory probe (a dispatch mode over fake tensors)
    sees each tile's intermediates, which a registered op's fake implementation hides from it. `norm_weight` None:
    the plain tiled SwiGLU."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, tile_tokens, norm_weight, eps):
        ctx.save_for_backward(x, w1, w3, w2, norm_weight)
        ctx.tile_tokens, ctx.eps = tile_tokens, eps
        return _forward_tiles(x, w1, w3, w2, tile_tokens, norm_weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w3, w2, norm_weight = ctx.saved_tensors
        grad_x, grad_w1, grad_w3, grad_w2, *grad_norm = _backward_tiles(grad_out.contiguous(), x, w1, w3, w2,
                                                                        ctx.tile_tokens, norm_weight, ctx.eps)
        return grad_x, grad_w1, grad_w3, grad_w2, None, (grad_norm[0] if grad_norm else None), None


def tiled_norm_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """w2(silu(w1 n) * w3 n) with n = RMSNorm(x) (models/tiled_norm.py's rows), both over tiles of `tile_tokens`
    tokens: the norm's (tokens x dim) output, which the unfused pair keeps for the SwiGLU's backward, never exists
    whole (8 GiB at 1M tokens per rank of an 8B model; docs/frontier.md). Plain tensors only (no tensor
    parallelism: there the norm runs on sequence shards before the gather). The same numbers as the norm and the
    tiled SwiGLU one after the other, bit for bit when the tiles are the same."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    if any(isinstance(t, DTensor) for t in (x, norm_weight, w1, w3, w2)):
        raise ValueError("tiled_norm_swiglu takes plain tensors: under tensor parallelism call the norm and "
                         "tiled_swiglu one after the other")
    x, norm_weight, w1, w3, w2 = to_autocast_dtype(x, norm_weight, w1, w3, w2)  # its backward ignores autocast
    shape, flat = x.shape, x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        out = _normed_forward(flat, norm_weight, eps, w1, w3, w2, tile_tokens)
    else:
        out = _EagerTiles.apply(flat, w1, w3, w2, tile_tokens, norm_weight, eps)
    return out.view(*shape[:-1], -1)


def tiled_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                 tile_tokens: int) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x) over tiles of `tile_tokens` tokens. x (..., D); weights as nn.Linear holds them, plain
    or (tensor parallelism) DTensors sharded column-wise (w1, w3: Shard(0)) and row-wise (w2: Shard(1)), with x then
    a DTensor on the same mesh. Returns a plain tensor: the output itself, or under TP this rank's sequence shard
    (Shard(1), what the row-wise w2 of the TP plan returns)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    mesh = w1.device_mesh if isinstance(w1, DTensor) else None
    if mesh is not None:
        if not isinstance(x, DTensor):
            raise ValueError("tiled_swiglu under tensor parallelism needs its input as a DTensor on the TP mesh")
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        w1, w3, w2 = w1.to_local(), w3.to_local(), w2.to_local()
    x, w1, w3, w2 = to_autocast_dtype(x, w1, w3, w2)  # its backward ignores autocast
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if torch.compiler.is_compiling():
        out = _tiled_forward(flat, w1, w3, w2, tile_tokens)
    else:
        out = _EagerTiles.apply(flat, w1, w3, w2, tile_tokens, None, 0.0)
    out = out.view(*shape[:-1], -1)
    if mesh is not None:  # each rank holds a partial sum over its slice of the hidden dim: reduce-scatter tokens
        out = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
    return out
