"""What a CP attention call reports and refuses: the byte counters a caller passes in, and the refusal of a call no
variant computes exactly (a leaf of the package)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from config.errors import Refusal
from models.tile_loops import active_sampler

UnsupportedAttentionError = Refusal
"""An attention call the CP variants cannot compute exactly (they refuse instead of computing something else)."""


@dataclass
class CommStats:
    """Counters a caller passes in; the CP attention variants add the bytes this rank sent to them."""
    calls: int = 0
    forward_bytes_sent: int = 0  # forward: K/V blocks (ring, all-gather); Q, K, V and the output (Ulysses)
    backward_bytes_sent: int = 0  # backward: K/V blocks and float32 dK/dV accumulators, or the gradients' all-to-alls

    def count_sent(self, nbytes: int, backward: bool) -> None:
        if backward:
            self.backward_bytes_sent += nbytes
        else:
            self.forward_bytes_sent += nbytes

    @property
    def bytes_sent(self) -> int:
        return self.forward_bytes_sent + self.backward_bytes_sent


def count_sent(stats: CommStats | None, nbytes: int, backward: bool = False) -> None:
    """Adds `nbytes` to `stats` when the caller passed counters, times the head groups the one now running stands
    for when a dry run samples them (models/tile_loops.py: 1 everywhere else)."""
    if stats is not None:
        sampler = active_sampler()
        stats.count_sent(nbytes * (sampler.weight if sampler is not None else 1), backward)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
