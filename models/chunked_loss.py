"""The output projection and the cross entropy fused and computed a chunk of tokens at a time.

At long context the (tokens x vocab) logits, their float32 copy and their gradient dominate activation memory (Llama
3's vocabulary is 128,256 wide: 1M tokens would need ~0.5 TiB of logits). `chunked_linear_cross_entropy` never holds
more than one chunk of them: the forward projects `chunk_tokens` hidden states, takes their loss, and computes the
chunk's gradients right away (softmax minus one-hot times the weight for the hidden states, accumulated in float32 for
the weight), so the backward only scales the stored gradients by the incoming one. Nothing is recomputed, and the
result is the same loss and gradients as projecting everything and calling `F.cross_entropy(reduction="sum")`,
within float32 rounding.

Vocabulary-sharded weights (tensor parallelism with loss parallelism) compute each chunk's log-sum-exp and target
logit with three small all-reduces over the TP group; the hidden states' gradient is then partial per rank and reduced
by the DTensor layout it came from. Labels equal to `ignore_index` count nothing and get no gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from models.autocast import to_autocast_dtype
from models.tile_loops import tile_starts

IGNORE_INDEX = -100  # what `F.cross_entropy` ignores by default, and what the data marks unlabelled tokens with


def _label_masks(labels, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, ...]:
    """Per token, computed once for all chunks (each chunk takes its rows, views): (labelled, labelled and held by
    this rank's vocabulary rows, the local label as a gather / scatter index (n, 1), minus the latter mask as float32
    (n, 1): the one-hot's values)."""
    valid = labels != IGNORE_INDEX
    local_label = labels - vocab_start
    mine = valid & (local_label >= 0) & (local_label < local_vocab)
    index = local_label.clamp(0, local_vocab - 1)[:, None]
    return valid, mine, index, -mine[:, None].to(torch.float32)


def _chunk_loss_and_grad(h, weight, masks, group, with_grad: bool):
    """One chunk: (summed loss, float32 gradient of the logits or None). h (n, D), weight (V_local, D), masks the
    chunk's rows of `_label_masks`."""
    valid, mine, index, minus_mine = masks
    logits = (h @ weight.t()).float()  # (n, V_local)
    target = logits.gather(1, index).squeeze(1) * mine  # the label's logit where this rank holds it, else 0
    row_max = logits.amax(dim=1)
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    logits -= row_max[:, None]
    if with_grad:
        probs = logits.exp_()  # in place: the chunk's logits are not needed again
        sum_exp = probs.sum(dim=1)
    else:
        sum_exp = logits.exp().sum(dim=1)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target, group=group)
    lse = row_max + sum_exp.log()
    loss = ((lse - target) * valid).sum()
    if not with_grad:
        return loss, None
    probs /= sum_exp[:, None]  # softmax
    probs.scatter_add_(1, index, minus_mine)  # minus one-hot; no data-dependent shapes
    probs *= valid[:, None]
    return loss, probs


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens: int, vocab_start: int, group, with_grad: bool):
        n = hidden.size(0)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        masks = _label_masks(labels, vocab_start, weight.size(0))
        for start in tile_starts(n, chunk_tokens, hidden):  # a dry run's fake tensors: three (models/tile_loops.py)
            h, rows = hidden[start:start + chunk_tokens], slice(start, start + chunk_tokens)
            chunk_loss, grad_logits = _chunk_loss_and_grad(h, weight, [m[rows] for m in masks], group, with_grad)
            loss += chunk_loss
            if with_grad:
                g = grad_logits.to(hidden.dtype)
                del grad_logits
                torch.mm(g, weight, out=grad_hidden[start:start + chunk_tokens])
                grad_weight += (g.t() @ h).float()
        # The weight's gradient is kept by backward: zero-bubble pipeline schedules run this node's backward twice,
        # once for the input gradient and once for the weight's. Accumulated in float32, stored in the weight's dtype.
        ctx.with_grad = with_grad
        ctx.grads = [grad_hidden, grad_weight.to(weight.dtype) if with_grad else None]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """The input gradient is handed on (scaled in place) and no longer held here: the node lives as long as the
        loss does, through the whole backward, and at 1M tokens per rank of an 8B model that gradient is 8 GiB at
        the step's peak (docs/frontier.md). A second call (a zero-bubble schedule's weight pass) gets the weight's
        gradient again and none for the input."""
        if not ctx.with_grad:
            raise RuntimeError("chunked_linear_cross_entropy ran without gradients (with_grad=False) and cannot be "
                               "back-propagated; call it with gradients enabled")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads[0] = None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        return grad_hidden, grad_weight * grad_loss.to(grad_weight.dtype), None, None, None, None, None


def _vocab_shard(weight: DTensor) -> tuple[torch.Tensor, int, object]:
    """(local rows of a vocabulary-sharded weight, the first vocabulary id they hold, the TP process group).
    Shard(0) gives rank r rows [r * ceil(V / n), ...), the last ranks fewer (torch.chunk's split)."""
    if len(weight.placements) != 1 or weight.placements[0] != Shard(0):
        raise ValueError(f"chunked loss expects the output weight sharded on the vocabulary over one mesh dim, got "
                         f"{weight.placements}")
    mesh = weight.device_mesh
    rows_per_rank = -(-weight.size(0) // mesh.size())
    start = min(mesh.get_local_rank() * rows_per_rank, weight.size(0))
    return weight.to_local(), start, mesh.get_group()


def flat_operands(hidden, weight, labels: torch.Tensor, chunk_tokens: int):
    """(flat hidden (N, D), local weight rows, flat labels (N,), first vocabulary id of those rows, TP group or None):
    the plain tensors a chunked projection works on, from plain or TP (DTensor) inputs. Every TP rank gets all tokens
    (its gradient is partial per rank) and its own vocabulary shard; shared by the loss and the eval scores."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        weight, vocab_start, group = _vocab_shard(weight)
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    elif isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat_labels = labels.reshape(-1)
    if flat_labels.numel() != flat_hidden.size(0):
        raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states {tuple(hidden.shape)}")
    return flat_hidden, weight, flat_labels, vocab_start, group


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_tokens: int, sparse_labels: bool = False) -> torch.Tensor:
    """Summed cross entropy of `hidden @ weight.T` against `labels` (float32 scalar), `chunk_tokens` at a time.

    hidden (..., D) plain or a DTensor over the TP mesh (e.g. sequence-sharded by sequence parallelism); weight
    (V, D) plain or a DTensor sharded on the vocabulary (Shard(0)); labels (...) matching hidden's (full) leading
    shape. Returns a plain tensor, equal on every TP rank.

    sparse_labels: project and score only the tokens whose label is not `ignore_index` (a passkey row labels 5 of
    its tokens), for the same result; selecting them costs one host sync, so it is for data known to be sparse."""
    flat_hidden, weight, flat_labels, vocab_start, group = flat_operands(hidden, weight, labels, chunk_tokens)
    flat_hidden, weight = to_autocast_dtype(flat_hidden, weight)  # its out= GEMM and backward ignore autocast
    if sparse_labels:  # TP ranks hold the same labels, so they select the same rows and their collectives match
        labelled = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)
        flat_hidden, flat_labels = flat_hidden.index_select(0, labelled), flat_labels.index_select(0, labelled)
    with_grad = torch.is_grad_enabled() and (flat_hidden.requires_grad or weight.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, flat_labels, chunk_tokens, vocab_start, group,
                                            with_grad)
