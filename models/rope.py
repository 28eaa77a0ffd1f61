"""Rotary position embedding (RoPE) as Meta's Llama 3 uses it, computed from explicit positions.

Angles come from `position_ids` on every call, never from a precomputed table indexed by row, because under
document masking positions restart per document and under context parallelism a rank holds a zigzag shard of a
longer sequence. The rotation uses Meta's interleaved pair layout (features 2i and 2i+1 form one pair) and real
arithmetic only: complex tensors do not mix with DTensor / tensor parallelism.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_frequencies(head_dim: int, theta: float, scaling_factor: float | None = None,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_max_position: int = 8192) -> torch.Tensor:
    """Per-pair inverse frequencies theta^(-2i/head_dim), float32, shape (head_dim // 2,).

    With `scaling_factor` set, applies Llama 3.1's piecewise rescaling: wavelengths shorter than
    original_max_position / high_freq_factor keep their frequency, those longer than
    original_max_position / low_freq_factor are divided by the factor, and the band between is interpolated.
    The base is computed in float32 the way Meta's and HF's code do, so imported checkpoints see the same angles.
    Always computed on the CPU (also under a meta-device context); callers copy it where it lives.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    freqs = 1.0 / (theta ** exponents)
    if scaling_factor is None:
        return freqs
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"rope high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})")
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = original_max_position / high_freq_factor
    low_freq_wavelen = original_max_position / low_freq_factor
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies and turns position ids into (cos, sin) for `apply_rotary`.

    `inv_freq` is a non-persistent buffer: it is derived from the config, so checkpoints do not carry it and a
    context-length ramp can change it between stages with `reset`.
    """

    def __init__(self, head_dim: int, theta: float, scaling_factor: float | None = None,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, original_max_position: int = 8192):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.reset(theta, scaling_factor, low_freq_factor, high_freq_factor, original_max_position)

    def reset(self, theta: float, scaling_factor: float | None = None, low_freq_factor: float = 1.0,
              high_freq_factor: float = 4.0, original_max_position: int = 8192) -> None:
        """Recompute `inv_freq` in place on the buffer's current device (also after `to_empty`)."""
        freqs = rope_frequencies(self.head_dim, theta, scaling_factor, low_freq_factor, high_freq_factor,
                                 original_max_position)
        with torch.no_grad():
            self.inv_freq.copy_(freqs)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) integer positions -> cos, sin of shape (B, S, 1, head_dim // 2), float32 (1 broadcasts heads)."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = angles.unsqueeze(-2)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by the angles, pairs (2i, 2i+1) interleaved; math in float32, result in x's dtype."""
    pairs = x.to(torch.float32).reshape(*x.shape[:-1], -1, 2)  # not unflatten: dynamo cannot trace it under a mode
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
