"""Per-token scores for evaluation (cross entropy and the argmax) from the hidden states, a chunk of tokens at a time.

Evaluation needs each token's loss (long-document loss by position) and the model's greedy prediction (passkey,
needle in a haystack). Taking them from whole logits holds (tokens x vocab) in the model's dtype, its float32 copy
and the log-softmax at once (78 GiB for 64K tokens and a 128K vocabulary); this projects `chunk_tokens` hidden
states at a time with the same arithmetic as the training loss (models/chunked_loss.py: float32 logits, row max,
log-sum-exp), so evaluation never holds more logits than one training chunk.

Vocabulary-sharded weights (tensor parallelism) reduce each chunk's row max, exp-sum and target logit over the TP
group, and the argmax as (largest logit, then the lowest vocabulary id holding it), which is `argmax`'s first-
occurrence rule over the whole vocabulary.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.chunked_loss import IGNORE_INDEX, flat_operands
from models.tile_loops import active_sampler, is_sampled, tile_starts, uncounted_ballast


def _chunk_scores(h, weight, labels, vocab_start: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (float32 loss per token, 0 where unlabelled; argmax vocabulary id per token)."""
    logits = (h @ weight.t()).float()  # (n, V_local)
    valid = labels != IGNORE_INDEX
    local_label = labels - vocab_start
    mine = valid & (local_label >= 0) & (local_label < weight.size(0))
    target = logits.gather(1, local_label.clamp(0, weight.size(0) - 1)[:, None]).squeeze(1) * mine
    row_max, local_argmax = logits.max(dim=1)
    prediction = local_argmax + vocab_start
    if group is not None:
        local_max = row_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        # the lowest id among the ranks holding the global maximum (vocabulary shards are in rank order)
        candidate = torch.where(local_max == row_max, prediction, torch.full_like(prediction, torch.iinfo(
            prediction.dtype).max))
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
        prediction = candidate
        dist.all_reduce(target, group=group)
    logits -= row_max[:, None]
    sum_exp = logits.exp_().sum(dim=1)  # in place: the chunk's logits are not needed again
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
    loss = (row_max + sum_exp.log() - target) * valid
    return loss, prediction


@torch.no_grad()
def chunked_token_scores(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                         sparse_labels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, prediction), each shaped like `labels`: the float32 cross entropy of every token (0 where the label is
    `IGNORE_INDEX`) and the argmax of its logits `hidden @ weight.T`, computed `chunk_tokens` tokens at a time.

    hidden (..., D) plain or a DTensor over the TP mesh; weight (V, D) plain or vocabulary-sharded (Shard(0));
    labels (...) plain, matching hidden's (full) leading shape. Equal on every TP rank.
    sparse_labels: score only the labelled tokens (a passkey row labels a handful); the others get loss 0 and
    prediction -1."""
    flat_hidden, weight, flat_labels, vocab_start, group = flat_operands(hidden, weight, labels, chunk_tokens)
    loss = torch.zeros(flat_labels.shape, dtype=torch.float32, device=flat_hidden.device)
    prediction = torch.full(flat_labels.shape, -1, dtype=torch.long, device=flat_hidden.device)
    scored = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1) if sparse_labels else None
    if scored is not None:  # TP ranks hold the same labels, so they select the same rows and their collectives match
        flat_hidden, flat_labels = flat_hidden.index_select(0, scored), flat_labels.index_select(0, scored)
    losses, predictions = [], []
    n = flat_hidden.size(0)
    sampled = is_sampled(n, chunk_tokens, flat_hidden)  # a dry run's fake tensors: three chunks (models/tile_loops.py)
    for start in tile_starts(n, chunk_tokens, flat_hidden):
        if sampled and len(losses) == 1:  # the middle chunk runs on the results of all full chunks before the last
            with uncounted_ballast(active_sampler()):
                for _ in range(len(range(0, n, chunk_tokens)) - 3):
                    losses.append(torch.empty_like(losses[0]))
                    predictions.append(torch.empty_like(predictions[0]))
        chunk_loss, chunk_prediction = _chunk_scores(flat_hidden[start:start + chunk_tokens], weight,
                                                     flat_labels[start:start + chunk_tokens], vocab_start, group)
        losses.append(chunk_loss)
        predictions.append(chunk_prediction)
    if losses:
        if scored is None:
            loss, prediction = torch.cat(losses), torch.cat(predictions)
        else:
            loss.index_copy_(0, scored, torch.cat(losses))
            prediction.index_copy_(0, scored, torch.cat(predictions))
    return loss.view(labels.shape), prediction.view(labels.shape)
