"""The loss, written once: a local token sum divided by the step's global label-token count.

Every rank sums the cross entropy of the tokens it holds (CP shards, TP vocabulary shards under loss parallelism)
and divides by the label tokens of the whole optimizer step over all ranks of the batch (dp x cp, every micro-step),
so the summed loss and its gradients are the same on every mesh. The trainer, the dry run's memory probe and the
pipeline schedule's loss function all use these functions.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.parallel import loss_parallel

from data.labels import IGNORE_INDEX


def loss_context(enabled: bool):
    """torch's `loss_parallel()` when the logits are vocabulary-sharded DTensors, else nothing."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of this rank's tokens, in float32; works on plain and vocabulary-sharded DTensor logits
    (inside `loss_context`), returning a plain tensor either way."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def global_label_tokens(batches: list[dict], *, every_token_labelled: bool, rows_per_step: int, seq_len: int,
                        comm=None, data_group=None) -> int:
    """Label tokens of one optimizer step over all ranks: what every local loss sum is divided by.

    Text labels every token, so the count is rows x seq_len. Passkey rows label only the answer: count them and sum
    over the data-parallel ranks (`comm.reduce_values` over `data_group`; CP and TP ranks of one dp rank hold the
    same rows)."""
    if every_token_labelled:
        return rows_per_step * seq_len
    local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    return int(comm.reduce_values([local], group=data_group)[0])
