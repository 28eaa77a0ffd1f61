"""Which part of a K/V block a rank computes at each ring step, derived from the load balancer's layout.

At step s rank r holds the K/V block of rank src = (r - s) mod P. Causal cases (L = local length, c = L / 2):
- contiguous: src == r -> causal; src < r -> full; src > r -> nothing.
- zigzag:     src == r -> causal over the local 2c (positions increase in local order);
              src < r  -> all of Q against the first half of K/V;  src > r -> second half of Q against all of K/V.
              Every off-diagonal step is exactly half a block.
- striped:    src <= r -> causal (j <= i);  src > r -> strictly lower (j < i): Q[1:] against K/V[:-1], causal.
Non-causal: every step is the full block. Document masking then narrows a task further: a task whose documents cannot
meet is skipped; a partly visible one gets a float additive mask (-inf where hidden); rows that see nothing in the block
are reported so the caller zeroes them instead of trusting the kernel's output for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.sequence_sharding import local_positions

FULL = slice(None)


@dataclass(frozen=True)
class BlockTask:
    q_rows: slice
    kv_rows: slice
    is_causal: bool  # top-left aligned; only ever used with as many Q rows as K/V rows


@dataclass
class MaskedTask:
    task: BlockTask
    is_causal: bool
    mask: torch.Tensor | None  # float additive (B, 1, Lq, Lk)
    empty_rows: torch.Tensor | None  # bool (B, 1, Lq): rows that see nothing in this block


def block_tasks(rank: int, src: int, cp_size: int, local_len: int, load_balancer: str,
                is_causal: bool) -> list[BlockTask]:
    if not is_causal:
        return [BlockTask(FULL, FULL, False)]
    if src == rank:
        return [BlockTask(FULL, FULL, True)]
    if load_balancer == "contiguous":
        return [BlockTask(FULL, FULL, False)] if src < rank else []
    if load_balancer == "zigzag":
        half = local_len // 2
        if src < rank:
            return [BlockTask(FULL, slice(0, half), False)]
        return [BlockTask(slice(half, local_len), FULL, False)]
    if load_balancer == "striped":
        if src < rank:
            return [BlockTask(FULL, FULL, True)]
        return [BlockTask(slice(1, local_len), slice(0, local_len - 1), True)] if local_len > 1 else []
    raise ValueError(f"unknown load balancer {load_balancer!r}")


class DocumentShards:
    """Every CP rank's document ids (B, L_local), so any rank can mask against any K/V block it receives."""

    def __init__(self, per_rank: list[torch.Tensor]):
        self.per_rank = per_rank

    @classmethod
    def from_full(cls, full_ids: torch.Tensor, cp_size: int, load_balancer: str) -> "DocumentShards":
        seq_len = full_ids.size(1)
        return cls([full_ids.index_select(1, local_positions(seq_len, r, cp_size, load_balancer,
                                                              device=full_ids.device))
                    for r in range(cp_size)])


def _structure(task: BlockTask, n_q: int, n_k: int, device) -> torch.Tensor | None:
    if not task.is_causal:
        return None
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def mask_task(task: BlockTask, doc_q: torch.Tensor, doc_k: torch.Tensor, dtype: torch.dtype) -> MaskedTask | None:
    """Narrows `task` by documents; None when no query of the block may see any of its keys."""
    dq, dk = doc_q[:, task.q_rows], doc_k[:, task.kv_rows]
    same_doc = dq[:, :, None] == dk[:, None, :]  # (B, Lq, Lk)
    structure = _structure(task, dq.size(1), dk.size(1), dq.device)
    visible = same_doc if structure is None else same_doc & structure
    if not bool(visible.any()):
        return None
    hidden_by_docs = ~same_doc if structure is None else ~same_doc & structure
    if not bool(hidden_by_docs.any()):  # documents hide nothing the structure shows
        return MaskedTask(task, task.is_causal, None, None)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, float("-inf"))
    sees_something = visible.any(dim=-1)
    empty_rows = None if bool(sees_something.all()) else ~sees_something[:, None, :]
    return MaskedTask(task, False, mask[:, None], empty_rows)


def resolve_tasks(tasks: list[BlockTask], docs: DocumentShards | None, rank: int, src: int,
                  dtype: torch.dtype) -> list[MaskedTask]:
    if docs is None:
        return [MaskedTask(t, t.is_causal, None, None) for t in tasks]
    resolved = [mask_task(t, docs.per_rank[rank], docs.per_rank[src], dtype) for t in tasks]
    return [m for m in resolved if m is not None]
