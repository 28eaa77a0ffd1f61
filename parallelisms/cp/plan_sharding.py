"""How a sequence is laid out over the context-parallel ranks, and the moves between full and local layouts.

The layouts (layouts.py names them; every rank holds S / P tokens, in increasing position order): the fixed ones
place tokens by position alone; DOCUMENTS places each row's documents by attention work (plan_layout.py), so these
functions take the full `document_ids` (B, S) for it. Which blocks a rank computes follows from the layout
(plan_pieces.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from config.errors import Refusal

from parallelisms.cp.groups import resolve_group
from parallelisms.cp.layouts import (CONTIGUOUS, DOCUMENTS, STRIPED, ZIGZAG, check_load_balancer, check_sequence_length,
                                     fixed_positions, missing_document_ids)
from parallelisms.cp.plan_layout import DocumentLayout


def documents_plan(document_ids: torch.Tensor | None, seq_len: int, cp_size: int) -> DocumentLayout:
    """The documents layout of full (B, S) ids; refuses a missing or mis-sized `document_ids`."""
    if document_ids is None or document_ids.dim() != 2 or document_ids.size(1) != seq_len:
        raise missing_document_ids(seq_len, None if document_ids is None else tuple(document_ids.shape))
    return DocumentLayout.plan(document_ids, cp_size)


def local_positions(seq_len: int, cp_rank: int, cp_size: int, load_balancer: str = ZIGZAG,
                    device: torch.device | str = "cpu", document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Global token positions held by `cp_rank`, in local order (int64), on `device` (CPU for index plans).
    (S / P,) for the fixed layouts; (B, S / P) for "documents", planned from the full `document_ids` (B, S)."""
    check_sequence_length(seq_len, cp_size, load_balancer)
    if load_balancer == DOCUMENTS:
        return documents_plan(document_ids, seq_len, cp_size).rank_positions(cp_rank, device)
    return fixed_positions(seq_len, cp_rank, cp_size, load_balancer, device)


def shard_sequence(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int,
                   load_balancer: str = ZIGZAG, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's tokens of `x` along `seq_dim` (a view for striped/contiguous, a new tensor for zigzag and
    documents; documents needs the full `document_ids` (B, S) and seq_dim = 1)."""
    seq_len = x.size(seq_dim)
    check_sequence_length(seq_len, cp_size, load_balancer)
    if not 0 <= cp_rank < cp_size:
        raise Refusal(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    if cp_size == 1:
        return x
    if load_balancer == DOCUMENTS:
        return documents_plan(document_ids, seq_len, cp_size).shard(x, seq_dim, cp_rank)
    if load_balancer == STRIPED:
        index = [slice(None)] * x.dim()
        index[seq_dim] = slice(cp_rank, None, cp_size)
        return x[tuple(index)]
    if load_balancer == CONTIGUOUS:
        return x.chunk(cp_size, dim=seq_dim)[cp_rank]
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def unshard_sequence(x_local: torch.Tensor, seq_dim: int, group, load_balancer: str = ZIGZAG,
                     document_ids: torch.Tensor | DocumentLayout | None = None) -> torch.Tensor:
    """The full tensor in global token order: all-gather over the CP group, then undo the layout (no autograd).
    "documents" needs the full `document_ids` (B, S) or their DocumentLayout."""
    pg = resolve_group(group)
    cp_size = dist.get_world_size(pg)
    check_load_balancer(load_balancer)
    if cp_size == 1:
        return x_local.detach().clone()
    local = x_local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=pg)
    seq_len = local.size(seq_dim) * cp_size
    if load_balancer == DOCUMENTS:
        layout = document_ids if isinstance(document_ids, DocumentLayout) else \
            documents_plan(document_ids, seq_len, cp_size)
        return layout.unshard(parts, seq_dim)
    positions = torch.cat([local_positions(seq_len, r, cp_size, load_balancer, device=local.device)
                           for r in range(cp_size)])
    gathered = torch.cat(parts, dim=seq_dim)
    full = torch.empty_like(gathered)
    full.index_copy_(seq_dim, positions, gathered)
    return full
