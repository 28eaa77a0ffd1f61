"""The layout and implementation names, as constants (unpacked from the schema's aliases, their one spelling), and the fixed layouts'
positions.

- ZIGZAG:     2P chunks; rank r holds chunks r and 2P-1-r (head and tail), so causal work is equal on every rank.
- STRIPED:    token t lives on rank t % P.
- CONTIGUOUS: P chunks; rank r holds chunk r (causal work grows with r; kept for comparison).
- DOCUMENTS:  per row, from the row's document ids (plan_layout.py); its positions depend on the row, so they come
              from plan_sharding.local_positions with the ids, not from `fixed_positions`.
A leaf (no import inside the package), so every floor can name a layout.
"""
from __future__ import annotations

import torch

from config import RecipeError, choices
from config.schema import (ALLGATHER, AUTO, CONTIGUOUS, DOCUMENTS, HYBRID, RING, STRIPED, ULYSSES,  # noqa: F401
                           ZIGZAG, LoadBalancer)

LOAD_BALANCERS = choices(LoadBalancer)
DENSE = "dense"  # the layout kind of every fixed layout: blocks of whole ranks (the dispatch key's other value)


def layout_kind(load_balancer: str) -> str:
    """DOCUMENTS or DENSE: the layout half of the CP dispatch key (choice.py)."""
    return DOCUMENTS if load_balancer == DOCUMENTS else DENSE


def check_load_balancer(load_balancer: str) -> None:
    if load_balancer not in LOAD_BALANCERS:
        raise RecipeError(f"parallelism.cp_load_balancer: unknown load balancer {load_balancer!r}; "
                          f"use one of {', '.join(LOAD_BALANCERS)}")


def sequence_divisor(cp_size: int, load_balancer: str) -> int:
    """The number a sequence length must be divisible by: zigzag (and documents, which is zigzag for a row of one
    document) cut it into 2*cp chunks, the others into cp."""
    check_load_balancer(load_balancer)
    return 2 * cp_size if load_balancer in (ZIGZAG, DOCUMENTS) else cp_size


def check_sequence_length(seq_len: int, cp_size: int, load_balancer: str) -> None:
    """Raises a RecipeError naming the length, the degree and the nearest valid length."""
    if cp_size < 1:
        raise RecipeError(f"parallelism.cp: context-parallel degree must be >= 1, got {cp_size}")
    divisor = sequence_divisor(cp_size, load_balancer)
    if seq_len % divisor == 0 and seq_len > 0:
        return
    lower = (seq_len // divisor) * divisor
    upper = lower + divisor
    nearest = upper if lower == 0 or seq_len - lower > upper - seq_len else lower
    rule = f"2*cp = {divisor}" if divisor == 2 * cp_size else f"cp = {divisor}"
    raise RecipeError(f"training.seq_len: sequence length {seq_len} is not divisible by {rule} "
                      f"(cp degree {cp_size}, load balancer {load_balancer!r}); nearest valid length: {nearest}")


def missing_document_ids(seq_len: int, got) -> ValueError:
    return ValueError(f"load balancer 'documents' needs the full (batch, {seq_len}) document_ids, got {got}")


def fixed_positions(seq_len: int, cp_rank: int, cp_size: int, load_balancer: str = ZIGZAG,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Global token positions held by `cp_rank` under a fixed layout, in local order (int64, (S / P,))."""
    check_sequence_length(seq_len, cp_size, load_balancer)
    if load_balancer == DOCUMENTS:
        raise missing_document_ids(seq_len, None)
    if load_balancer == STRIPED:
        return torch.arange(cp_rank, seq_len, cp_size, device=device)
    if load_balancer == CONTIGUOUS:
        chunk = seq_len // cp_size
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    chunk = seq_len // (2 * cp_size)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])
