"""RMSNorm over tiles of tokens, saving only its input and one float32 scale per token for the backward.

The plain RMSNorm (models/llama.py) computes in float32 and autograd keeps what its ops need: the float32 copy of
the input, its square, the normalised float32 rows and the bf16 cast, then the backward makes as many float32
temporaries again. In a recomputed bf16 block at 512K tokens per rank that is ~136 KiB per token at the backward's
peak (bench/bench_layer_memory.py), the largest transient of the step. `tiled_rms_norm` keeps the input (which the
block holds anyway for its residual) and rsqrt(mean(x^2) + eps) per token (4 bytes), and does the float32 work
`tile_tokens` rows at a time in both directions. Exact: every row computes what the plain norm computes, in the same
dtypes; only the weight gradient's sum over tokens is accumulated per tile (in float32).

Under tensor parallelism's SequenceParallel plan the input is a DTensor sharded on the sequence and the weight is
replicated: the norm runs on the local rows and the weight's local gradient is a partial sum over this rank's rows.

Under torch.compile the tile loops are registered ops (`titan_models::tiled_rms_norm` and its backward): dynamo
sees one call each way, so a compiled block's graph does not unroll with the sequence length, and inductor does not
fuse the tiles back into whole-sequence float32 temporaries.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from models.tile_loops import tile_starts


def norm_tile(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
              rstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed rows, their float32 rstd) of a tile of rows, as the plain norm computes them; into `out` / `rstd`
    when given. Shared with the norm fused into the tiled SwiGLU (models/tiled_mlp.py)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps, out=rstd)
    return torch.mul((x32 * rstd).type_as(x), weight, out=out), rstd


def norm_backward_tile(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input's gradient, the float32 weight gradient summed over the tile) of a tile of rows."""
    normed = x.float() * rstd
    grad_w = (grad_out * normed.type_as(x)).float().sum(0)
    grad_normed = (grad_out * weight).type_as(x).float()  # the plain norm's cast back to x's dtype
    dot = (grad_normed * normed).mean(-1, keepdim=True)
    return (rstd * (grad_normed - normed * dot)).type_as(x), grad_w


def _forward_tiles(x: torch.Tensor, weight: torch.Tensor, eps: float, tile_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, float32 rstd per row) of 2-D x, `tile_tokens` rows at a time."""
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    rstd = torch.empty(x.size(0), 1, dtype=torch.float32, device=x.device)
    for start in tile_starts(x.size(0), tile_tokens, x):
        rows = slice(start, start + tile_tokens)
        norm_tile(x[rows], weight, eps, out[rows], rstd[rows])
    return out, rstd


@torch.library.custom_op("titan_models::tiled_rms_norm", mutates_args=())
def _tiled_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, tile_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_tiles(x, weight, eps, tile_tokens)


@_tiled_forward.register_fake
def _(x, weight, eps, tile_tokens):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.size(0), 1, dtype=torch.float32))


def _backward_tiles(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in tile_starts(x.size(0), tile_tokens, x):
        rows = slice(start, start + tile_tokens)
        grad_x[rows], tile_grad_w = norm_backward_tile(grad_out[rows], x[rows], weight, rstd[rows])
        grad_w += tile_grad_w
    return grad_x, grad_w.to(weight.dtype)


@torch.library.custom_op("titan_models::tiled_rms_norm_backward", mutates_args=())
def _tiled_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                    tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_tiles(grad_out, x, weight, rstd, tile_tokens)


@_tiled_backward.register_fake
def _(grad_out, x, weight, rstd, tile_tokens):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _, tile_tokens = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.tile_tokens = tile_tokens


def _backward(ctx, grad_out, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_w = _tiled_backward(grad_out.contiguous(), x, weight, rstd, ctx.tile_tokens)
    return grad_x, grad_w, None, None


_tiled_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerTiles(torch.autograd.Function):
    """The same tiles outside torch.compile, op by op: the dry run's memory probe (a dispatch mode over fake tensors)
    sees each tile's float32 temporaries, which a registered op's fake implementation hides from it."""

    @staticmethod
    def forward(ctx, x, weight, eps, tile_tokens):
        out, rstd = _forward_tiles(x, weight, eps, tile_tokens)
        ctx.save_for_backward(x, weight, rstd)
        ctx.tile_tokens = tile_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        return (*_backward_tiles(grad_out.contiguous(), x, weight, rstd, ctx.tile_tokens), None, None)


def tiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tile_tokens: int) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, `tile_tokens` rows of x at a time."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    if isinstance(x, DTensor):
        local = tiled_rms_norm(x.to_local(), weight.to_local(grad_placements=[Partial()])
                               if isinstance(weight, DTensor) else weight, eps, tile_tokens)
        return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if torch.compiler.is_compiling():
        return _tiled_forward(flat, weight, eps, tile_tokens)[0].view(shape)
    return _EagerTiles.apply(flat, weight, eps, tile_tokens).view(shape)
