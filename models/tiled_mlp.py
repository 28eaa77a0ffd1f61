"""SwiGLU computed over tiles of tokens, each tile's intermediates recomputed in the backward.

The feed-forward's (tokens x ffn_dim) intermediates (gate, up, their product: 3.5x the hidden size each for Llama 3)
are the largest tensors of a block after attention has gone flash. `tiled_swiglu` keeps only the block input for the
backward and never holds more than one tile of intermediates: the forward computes tile by tile without saving
anything, the backward recomputes one tile, takes its gradients and moves on. Exact: every tile computes the same
rows as the untiled matmuls; weight gradients are accumulated over tiles in float32.

Tensor parallelism (column-wise w1/w3, row-wise w2 with a sequence-sharded output) is handled on local shards: the
caller passes the gathered input and the local weights, and turns the partial output into its sequence shard.

Under torch.compile the tile loops are registered ops (`titan_models::tiled_swiglu` and its backward): one call
each way in the graph, whatever the sequence length, and the tiles stay tiles (inductor cannot fuse them back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from models.autocast import to_autocast_dtype
from models.tile_loops import tile_starts


def _tile_forward(x, w1, w3, w2):
    gate, up = x @ w1.t(), x @ w3.t()
    return (F.silu(gate) * up) @ w2.t()


def _forward_tiles(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   tile_tokens: int) -> torch.Tensor:
    out = x.new_empty(x.size(0), w2.size(0))
    for start in tile_starts(x.size(0), tile_tokens, x):
        out[start:start + tile_tokens] = _tile_forward(x[start:start + tile_tokens], w1, w3, w2)
    return out


@torch.library.custom_op("titan_models::tiled_swiglu", mutates_args=())
def _tiled_forward(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   tile_tokens: int) -> torch.Tensor:
    return _forward_tiles(x, w1, w3, w2, tile_tokens)


@_tiled_forward.register_fake
def _(x, w1, w3, w2, tile_tokens):
    return x.new_empty(x.size(0), w2.size(0))


def _backward_tiles(grad_out: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_x = torch.empty_like(x)
    grad_w1, grad_w3, grad_w2 = (torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (w1, w3, w2))
    for start in tile_starts(x.size(0), tile_tokens, x):
        rows = slice(start, start + tile_tokens)
        xt, dout = x[rows], grad_out[rows]
        gate, up = (xt @ w1.t()).float(), (xt @ w3.t()).float()
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        grad_w2 += (dout.t() @ (act * up).to(x.dtype)).float()
        grad_h = (dout @ w2).float()
        grad_up = (grad_h * act).to(x.dtype)
        grad_gate = (grad_h * up * sig * (1 + gate * (1 - sig))).to(x.dtype)  # silu'(g) = s (1 + g (1 - s))
        del gate, up, sig, act, grad_h
        torch.mm(grad_gate, w1, out=grad_x[rows]).addmm_(grad_up, w3)
        grad_w1 += (grad_gate.t() @ xt).float()
        grad_w3 += (grad_up.t() @ xt).float()
    return grad_x, grad_w1.to(w1.dtype), grad_w3.to(w3.dtype), grad_w2.to(w2.dtype)


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


class _EagerTiles(torch.autograd.Function):
    """The same tiles outside torch.compile, op by op: the dry run's memory probe (a dispatch mode over fake tensors)
    sees each tile's intermediates, which a registered op's fake implementation hides from it."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, tile_tokens):
        ctx.save_for_backward(x, w1, w3, w2)
        ctx.tile_tokens = tile_tokens
        return _forward_tiles(x, w1, w3, w2, tile_tokens)

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward_tiles(grad_out.contiguous(), *ctx.saved_tensors, ctx.tile_tokens), None)


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
    tiles = _tiled_forward if torch.compiler.is_compiling() else _EagerTiles.apply
    out = tiles(x.reshape(-1, shape[-1]), w1, w3, w2, tile_tokens).view(*shape[:-1], -1)
    if mesh is not None:  # each rank holds a partial sum over its slice of the hidden dim: reduce-scatter tokens
        out = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
    return out
