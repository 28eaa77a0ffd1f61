"""What every evaluation shares: its rows split evenly over the data-parallel ranks, and its per-token scores.

Every data-parallel rank must run the same forwards: FSDP all-gathers parameters over dp_shard x cp in each
forward, so a rank with one forward fewer leaves the others waiting in a collective forever. A rank takes rows
dp_rank, dp_rank + dp, ... and pads its share to ceil(rows / dp) with repeats of row 0 whose labels are all ignored:
they run the same forward and count nothing, so the results do not depend on the mesh.

Scores come from the hidden states a chunk of tokens at a time (models/chunked_scores.py), as the training loss
does, never from whole logits: evaluation then needs no more memory for the output layer than a training step.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from data.passkey import IGNORE_INDEX
from parallelisms.context_parallel import unshard_sequence

DEFAULT_EVAL_CHUNK_TOKENS = 2048
"""Tokens projected at a time when training.loss_chunk_tokens is 0 (whole-logits training loss)."""


def eval_chunk_tokens(loss_chunk_tokens: int) -> int:
    """The training loss's chunk, or the default where the training loss takes whole logits."""
    return loss_chunk_tokens if loss_chunk_tokens > 0 else DEFAULT_EVAL_CHUNK_TOKENS


def rank_rows(rows: int, dp_rank: int, dp_size: int) -> list[int | None]:
    """This rank's row numbers, padded with None (a masked repeat) to ceil(rows / dp_size) on every rank."""
    mine = list(range(dp_rank, rows, dp_size))
    return mine + [None] * (math.ceil(rows / dp_size) - len(mine))


def rank_batches(rows: int, dp_rank: int, dp_size: int, batch_size: int) -> list[list[int | None]]:
    """This rank's padded rows in forwards of `batch_size` rows (the same count and shapes on every rank)."""
    mine = rank_rows(rows, dp_rank, dp_size)
    return [mine[start:start + batch_size] for start in range(0, len(mine), batch_size)]


def padded_batch(row_fields, positions: list[int | None], device) -> tuple[dict, torch.Tensor]:
    """(batch of `row_fields(position)` stacked on `device`, bool per row: real, not padding). A padding row
    repeats row 0 with every label ignored."""
    fields = []
    for position in positions:
        row = dict(row_fields(0 if position is None else position))
        if position is None:
            row["labels"] = np.full_like(row["labels"], IGNORE_INDEX)
        fields.append(row)
    batch = {k: torch.from_numpy(np.stack([f[k] for f in fields])).to(device) for k in fields[0]}
    real = torch.tensor([p is not None for p in positions], device=device)
    return batch, real


def score_tokens(model, batch: dict, chunk_tokens: int, *, sparse_labels: bool, cp_context=None, cp_mesh=None,
                 cp_size: int = 1, load_balancer: str = "zigzag",
                 document_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, argmax) per token of `batch` (B, S) in global token order, from one forward of `model` sharded by
    `cp_context(batch)` (which shards the batch's sequence buffers in place). `document_ids`: the full ids, for
    the documents layout's unsharding. sparse_labels: score only labelled tokens (others: loss 0, argmax -1)."""
    with cp_context(batch) if cp_context else contextlib.nullcontext():
        loss, prediction = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"],
                                 loss_chunk_tokens=chunk_tokens, sparse_labels=sparse_labels, token_scores=True)
    if cp_size > 1:
        loss, prediction = (unshard_sequence(t.contiguous(), 1, cp_mesh, load_balancer=load_balancer,
                                             document_ids=document_ids) for t in (loss, prediction))
    return loss, prediction


def eval_spread(setup, comm) -> dict:
    """The keyword arguments that split an evaluation over the data-parallel ranks of a run and sum its counts."""
    group = setup.mesh.data.get_group() if setup.mesh.dims.dp > 1 else None
    return {"dp_rank": setup.mesh.dp_rank, "dp_size": setup.mesh.dims.dp,
            "reduce_sums": (lambda values: comm.reduce_values(values, group=group)) if group is not None else None,
            "chunk_tokens": eval_chunk_tokens(setup.loss_chunk_tokens)}
