"""Warmup then linear / cosine / constant decay, as a LambdaLR so its position checkpoints with the optimizer."""
from __future__ import annotations

import math

import torch

from config.errors import Refusal


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, decay_type: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for the optimizer step with index `step` (0-based).

    Warmup starts at 1/(warmup+1) rather than 0 so the first step already moves the weights.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise Refusal(f"unknown decay_type {decay_type!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, decay_type: str,
                       min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, warmup_steps, total_steps, decay_type, min_lr_ratio))
