"""Rotary position embedding (RoPE) as Meta's Llama 3 and Qwen use it, computed from explicit positions.

RoPE types (Hugging Face's `rope_type` names and semantics, checked against transformers' own tables in the tests):
default (theta only), llama3 (Llama 3.1's piecewise wavelength rescaling) and yarn (NTK-by-parts interpolation plus
an attention factor that scales cos and sin).

Angles come from `position_ids` on every call, never from a precomputed table indexed by row, because under
document masking positions restart per document and under context parallelism a rank holds a zigzag shard of a
longer sequence. The rotation uses Meta's interleaved pair layout (features 2i and 2i+1 form one pair) and real
arithmetic only: complex tensors do not mix with DTensor / tensor parallelism.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from config.rope import DEFAULT_ROPE_TYPE, ROPE_TYPES
from models.tile_loops import tile_starts


def rope_frequencies(head_dim: int, theta: float, scaling_factor: float | None = None,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_max_position: int = 8192, *, rope_type: str | None = None,
                     beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """Per-pair inverse frequencies theta^(-2i/head_dim), float32, shape (head_dim // 2,).

    `rope_type` None means llama3 when `scaling_factor` is set, else default.
    llama3: wavelengths shorter than original_max_position / high_freq_factor keep their frequency, those longer than
    original_max_position / low_freq_factor are divided by the factor, and the band between is interpolated.
    yarn: pairs below the correction range (fewer than beta_slow rotations over original_max_position) are
    divided by the factor, pairs above it (more than beta_fast rotations) kept, a linear ramp in between.
    The base is computed in float32 the way Meta's and HF's code do, so imported checkpoints see the same angles.
    Always computed on the CPU (also under a meta-device context); callers copy it where it lives.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    rope_type = rope_type or (DEFAULT_ROPE_TYPE if scaling_factor is None else "llama3")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not one of {ROPE_TYPES}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    freqs = 1.0 / (theta ** exponents)
    if rope_type == DEFAULT_ROPE_TYPE:
        return freqs
    if scaling_factor is None:
        raise ValueError(f"rope_type {rope_type!r} needs a scaling factor")
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling_factor, original_max_position, beta_fast, beta_slow,
                                 truncate)
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"rope high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})")
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = original_max_position / high_freq_factor
    low_freq_wavelen = original_max_position / low_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def _yarn_frequencies(head_dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float,
                      beta_slow: float, truncate: bool) -> torch.Tensor:
    """YaRN's NTK-by-parts blend of the original (extrapolated) and factor-divided (interpolated) frequencies."""
    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over the context
        return head_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by the factor)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_scaling(rope_type: str | None, scaling_factor: float | None,
                           attention_factor: float | None = None) -> float:
    """The factor cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 unless given; 1 for the other types."""
    if rope_type != "yarn":
        return 1.0
    if attention_factor is not None:
        return float(attention_factor)
    return 1.0 if scaling_factor is None or scaling_factor <= 1 else 0.1 * math.log(scaling_factor) + 1.0


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies and turns position ids into (cos, sin) for `apply_rotary`.

    `inv_freq` is a non-persistent buffer: it is derived from the config, so checkpoints do not carry it and a
    context-length ramp can change it between stages with `reset`.
    """

    def __init__(self, head_dim: int, theta: float, scaling_factor: float | None = None,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, original_max_position: int = 8192,
                 **yarn):
        super().__init__()
        self.head_dim = head_dim
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.reset(theta, scaling_factor, low_freq_factor, high_freq_factor, original_max_position, **yarn)

    def reset(self, theta: float, scaling_factor: float | None = None, low_freq_factor: float = 1.0,
              high_freq_factor: float = 4.0, original_max_position: int = 8192, *, rope_type: str | None = None,
              beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
              attention_factor: float | None = None) -> None:
        """Recompute `inv_freq` in place on the buffer's current device (also after `to_empty`), and the factor
        cos/sin are scaled by (YaRN's attention factor; 1 otherwise)."""
        freqs = rope_frequencies(self.head_dim, theta, scaling_factor, low_freq_factor, high_freq_factor,
                                 original_max_position, rope_type=rope_type, beta_fast=beta_fast,
                                 beta_slow=beta_slow, truncate=truncate)
        self.attention_scaling = rope_attention_scaling(rope_type, scaling_factor, attention_factor)
        with torch.no_grad():
            self.inv_freq.copy_(freqs)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) integer positions -> cos, sin of shape (B, S, 1, head_dim // 2), float32 (1 broadcasts heads)."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = angles.unsqueeze(-2)
        if self.attention_scaling != 1.0:
            return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return angles.cos(), angles.sin()


ROTARY_TILE_ELEMENTS = 1 << 24
"""`apply_rotary`'s float32 work spans at most this many elements of x at a time (64 MiB of float32 temporaries)."""


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.to(torch.float32).reshape(*x.shape[:-1], -1, 2)  # not unflatten: dynamo cannot trace it under a mode
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


def _rotate_tile(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: torch.Tensor,
                 backward: bool) -> torch.Tensor:
    """`_rotate`'s numbers, bit for bit, in fewer kernels (no per-lane products, no stack): pairs * cos + the swapped
    pairs * sin * (-1, 1), i.e. (e c + (-(o s)), o c + e s) = (e c - o s, e s + o c), exact since a product with +-1
    is exact and IEEE's a + (-b) = a - b and a + b = b + a. The backward rotates by the opposite angle, the same with
    value=-1: (g_e c + g_o s, g_o c - g_e s). `sign` is (-1, 1). Real CPU tensors take `_rotate_tile_cpu`."""
    pairs = x.to(torch.float32)
    if _cpu_eager(pairs):
        return _rotate_tile_cpu(pairs, cos, sin, -sign if backward else sign).to(x.dtype)
    pairs = pairs.reshape(*pairs.shape[:-1], -1, 2)  # not unflatten: dynamo cannot trace it under a mode
    swapped = pairs.flip(-1) * sin.unsqueeze(-1)
    out = (pairs * cos.unsqueeze(-1)).addcmul_(swapped, sign, value=-1 if backward else 1)
    return out.flatten(-2).to(x.dtype)


def _cpu_eager(x: torch.Tensor) -> bool:
    """A plain CPU tensor outside compile whose float32 pairs can be read as int64 (`_swap_pairs`). Fake tensors
    (the dry run, which models the GPU's kernels) and compiled graphs keep `_rotate_tile`'s ops."""
    return (type(x) is torch.Tensor and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1]))


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """float32 x with the two floats of each pair (2i, 2i+1) swapped: each pair read as one int64 and rotated by 32
    bits (the same on either byte order). Moves bits only, so every value is exactly the other lane's."""
    v = x.view(torch.int64)
    low = torch.bitwise_right_shift(v, 32).bitwise_and_(0xFFFFFFFF)
    return torch.bitwise_left_shift(v, 32).bitwise_or_(low).view(torch.float32)


def _rotate_tile_cpu(pairs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """`_rotate_tile` on the CPU, the same float32 values bit for bit, ~3x faster at the test models' shapes (2.3 ->
    0.7 ms for a (12, 256, 4, 16) tile, one thread) and ~2x at an 8B model's: torch's CPU kernels ran the pair
    layout's broadcasts over a last dimension of 2 (cos as (..., 1, D/2, 1) against (..., H, D/2, 2), and the flip
    of that dimension) one pair at a time, RoPE ~17% of a small model's step. Here cos and sin * sign are laid out
    per lane once, (B, S, 1, D), so every product broadcasts over heads only, and the swap is `_swap_pairs`: pairs
    * cos + swapped * (sin * sign), each product rounded once and added, as `_rotate_tile` rounds them."""
    lanes_cos = cos.repeat_interleave(2, dim=-1)
    lanes_sin = (sin.unsqueeze(-1) * sign).flatten(-2)
    return (pairs * lanes_cos).add_(_swap_pairs(pairs).mul_(lanes_sin))


class _TiledRotary(torch.autograd.Function):
    """The rotation over tiles of tokens, saving only cos and sin (and the 2-element sign): the rotation is linear, so
    its backward is the rotation by the opposite angle and needs nothing of x. Autograd through `_rotate` would keep
    the float32 copy of x and make float32 products of the whole shard (~48 KiB per token for an 8B model's q and k:
    the largest transient at 512K tokens per rank once the ring runs in head groups, docs/frontier.md). Exact: every
    element is the same float32 value as autograd's forward and backward of `_rotate` (`_rotate_tile`). One tile (the
    whole shard fits `ROTARY_TILE_ELEMENTS`) is returned as computed, without a copy into a preallocated output."""

    @staticmethod
    def forward(ctx, x, cos, sin, tile_tokens: int):
        sign = torch.arange(-1.0, 2.0, 2.0, device=x.device)  # (-1, 1): one kernel, no host-to-device copy
        ctx.save_for_backward(cos, sin, sign)
        ctx.tile_tokens = tile_tokens
        return _tiled(x, cos, sin, sign, tile_tokens, backward=False)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin, sign = ctx.saved_tensors
        return _tiled(grad_out, cos, sin, sign, ctx.tile_tokens, backward=True), None, None, None


def _tiled(x, cos, sin, sign, tile_tokens: int, backward: bool) -> torch.Tensor:
    if tile_tokens >= x.size(1):
        return _rotate_tile(x, cos, sin, sign, backward)
    out = torch.empty_like(x)
    for start in tile_starts(x.size(1), tile_tokens, x):
        rows = slice(start, start + tile_tokens)
        out[:, rows] = _rotate_tile(x[:, rows], cos[:, rows], sin[:, rows], sign, backward)
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 tile_elements: int = ROTARY_TILE_ELEMENTS) -> torch.Tensor:
    """Rotate (B, S, H, D) by the angles (B, S, 1, D // 2), pairs (2i, 2i+1) interleaved; math in float32, result in
    x's dtype, `tile_elements` of x at a time."""
    if isinstance(x, DTensor) or cos.size(1) != x.size(1):  # a DTensor's slices cannot be written in place
        return _rotate(x, cos, sin)
    if torch.compiler.is_compiling():  # one tile: inductor fuses the rotation into one kernel, which holds no
        # float32 copy of x, and dynamo would unroll the tile loop into a graph that grows with the sequence
        return _TiledRotary.apply(x, cos, sin, x.size(1))
    per_token = max(1, x.numel() // max(1, x.size(1)))
    return _TiledRotary.apply(x, cos, sin, max(1, tile_elements // per_token))


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    tile_elements: int = ROTARY_TILE_ELEMENTS) -> torch.Tensor:
    """The gradient of `apply_rotary`'s input from its output's gradient: the rotation by the opposite angle, the
    same float32 values as autograd's backward of `apply_rotary` (`_TiledRotary.backward`). For code that runs the
    backward itself where autograd records nothing: the grouped attention sublayer's backward, which also runs as the
    body of a registered op (parallelisms/sublayer_groups.py)."""
    sign = torch.arange(-1.0, 2.0, 2.0, device=grad.device)
    if cos.size(1) != grad.size(1) or torch.compiler.is_compiling():
        return _tiled(grad, cos, sin, sign, grad.size(1), backward=True)
    per_token = max(1, grad.numel() // max(1, grad.size(1)))
    return _tiled(grad, cos, sin, sign, max(1, tile_elements // per_token), backward=True)
