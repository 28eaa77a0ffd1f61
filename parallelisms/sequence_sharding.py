"""How a sequence is laid out over the context-parallel ranks, and the moves between full and local layouts.

Three load balancers (every rank holds S / P tokens, in increasing position order):
- "zigzag":     2P chunks; rank r holds chunks r and 2P-1-r (head and tail), so causal work is equal on every rank.
- "striped":    token t lives on rank t % P.
- "contiguous": P chunks; rank r holds chunk r (causal work grows with r; kept for comparison).
- "documents":  per row, from the row's document ids: documents placed by attention work (document_layout.py); the
                positions then depend on the row, so these functions take the full `document_ids` (B, S) for it.
The ring needs nothing but these layouts: which blocks a rank computes follows from them (see ring_plan.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from config import RecipeError, Refusal, choices
from config.schema import LoadBalancer
from parallelisms.document_layout import DocumentLayout

LOAD_BALANCERS = choices(LoadBalancer)


def check_load_balancer(load_balancer: str) -> None:
    if load_balancer not in LOAD_BALANCERS:
        raise RecipeError(f"parallelism.cp_load_balancer: unknown load balancer {load_balancer!r}; "
                          f"use one of {', '.join(LOAD_BALANCERS)}")


def sequence_divisor(cp_size: int, load_balancer: str) -> int:
    """The number a sequence length must be divisible by: zigzag (and documents, which is zigzag for a row of one
    document) cut it into 2*cp chunks, the others into cp."""
    check_load_balancer(load_balancer)
    return 2 * cp_size if load_balancer in ("zigzag", "documents") else cp_size


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


def documents_plan(document_ids: torch.Tensor | None, seq_len: int, cp_size: int) -> DocumentLayout:
    """The documents layout of full (B, S) ids; refuses a missing or mis-sized `document_ids`."""
    if document_ids is None or document_ids.dim() != 2 or document_ids.size(1) != seq_len:
        got = None if document_ids is None else tuple(document_ids.shape)
        raise Refusal(f"load balancer 'documents' needs the full (batch, {seq_len}) document_ids, got {got}")
    return DocumentLayout.plan(document_ids, cp_size)


def local_positions(seq_len: int, cp_rank: int, cp_size: int, load_balancer: str = "zigzag",
                    device: torch.device | str = "cpu", document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Global token positions held by `cp_rank`, in local order (int64), on `device` (CPU for index plans).
    (S / P,) for the fixed layouts; (B, S / P) for "documents", planned from the full `document_ids` (B, S)."""
    check_sequence_length(seq_len, cp_size, load_balancer)
    if load_balancer == "documents":
        return documents_plan(document_ids, seq_len, cp_size).rank_positions(cp_rank, device)
    if load_balancer == "striped":
        return torch.arange(cp_rank, seq_len, cp_size, device=device)
    if load_balancer == "contiguous":
        chunk = seq_len // cp_size
        return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    chunk = seq_len // (2 * cp_size)
    tail = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])


def shard_sequence(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int,
                   load_balancer: str = "zigzag", document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's tokens of `x` along `seq_dim` (a view for striped/contiguous, a new tensor for zigzag and
    documents; documents needs the full `document_ids` (B, S) and seq_dim = 1)."""
    seq_len = x.size(seq_dim)
    check_sequence_length(seq_len, cp_size, load_balancer)
    if not 0 <= cp_rank < cp_size:
        raise Refusal(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    if cp_size == 1:
        return x
    if load_balancer == "documents":
        return documents_plan(document_ids, seq_len, cp_size).shard(x, seq_dim, cp_rank)
    if load_balancer == "striped":
        index = [slice(None)] * x.dim()
        index[seq_dim] = slice(cp_rank, None, cp_size)
        return x[tuple(index)]
    if load_balancer == "contiguous":
        return x.chunk(cp_size, dim=seq_dim)[cp_rank]
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup or a 1-D DeviceMesh (None means the default group)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise Refusal(f"context parallelism needs a 1-D DeviceMesh, got {group.ndim} dims "
                             f"{group.mesh_dim_names}; pass mesh['cp']")
        return group.get_group()
    return group if group is not None else dist.group.WORLD


def unshard_sequence(x_local: torch.Tensor, seq_dim: int, group, load_balancer: str = "zigzag",
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
    if load_balancer == "documents":
        layout = document_ids if isinstance(document_ids, DocumentLayout) else \
            documents_plan(document_ids, seq_len, cp_size)
        return layout.unshard(parts, seq_dim)
    positions = torch.cat([local_positions(seq_len, r, cp_size, load_balancer, device=local.device)
                           for r in range(cp_size)])
    gathered = torch.cat(parts, dim=seq_dim)
    full = torch.empty_like(gathered)
    full.index_copy_(seq_dim, positions, gathered)
    return full
