"""Evaluation's per-token scores from the hidden states in chunks (models/chunked_scores.py) against a float64
whole-logits reference: each token's cross entropy and its argmax, on one rank and vocabulary-sharded over 2 and 3
tensor-parallel ranks, never projecting more than one chunk of logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.chunked_loss import IGNORE_INDEX
from models.chunked_scores import chunked_token_scores
from tests.distributed import run_ranks
from tests.models.test_memory_kernels import LargestTensor, _loss_inputs


def _reference(hidden, weight, labels):
    logits = F.linear(hidden.detach().double(), weight.detach().double())
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return loss, logits.argmax(-1)


@pytest.mark.parametrize("chunk", [1, 37, 1000])
@pytest.mark.parametrize("sparse_labels", [False, True])
def test_token_scores_equal_a_float64_whole_logits_reference(chunk, sparse_labels):
    hidden, weight, labels = _loss_inputs(torch.float32)
    want_loss, want_argmax = _reference(hidden, weight, labels)
    with LargestTensor() as seen:
        loss, argmax = chunked_token_scores(hidden, weight, labels, chunk, sparse_labels)
    labelled = labels != IGNORE_INDEX
    assert loss.shape == labels.shape and argmax.shape == labels.shape
    assert torch.allclose(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    assert (loss[~labelled] == 0).all()
    if sparse_labels:  # only labelled tokens are projected
        assert torch.equal(argmax[labelled], want_argmax[labelled]) and (argmax[~labelled] == -1).all()
    else:
        assert torch.equal(argmax, want_argmax)
    assert seen.logit_rows <= chunk


def _vocab_sharded_body(rank, world_size, sparse_labels):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    hidden, weight, labels = _loss_inputs(torch.float32, seed=3)
    weight = weight.detach()
    want_loss, want_argmax = _reference(hidden, weight, labels)
    loss, argmax = chunked_token_scores(distribute_tensor(hidden.detach(), mesh, [Shard(1)]),
                                        distribute_tensor(weight, mesh, [Shard(0)]), labels, 41, sparse_labels)
    labelled = labels != IGNORE_INDEX
    keep = labelled if sparse_labels else torch.ones_like(labelled)
    return (float((loss.double() - want_loss).abs().max()), bool(torch.equal(argmax[keep], want_argmax[keep])))


@pytest.mark.parametrize("world_size, sparse_labels", [(2, False), (3, True)])  # 3: uneven vocabulary split
def test_vocabulary_sharded_scores_equal_the_whole_vocabulary(world_size, sparse_labels):
    for loss_err, argmax_equal in run_ranks(_vocab_sharded_body, world_size=world_size, args=(sparse_labels,),
                                            timeout=120):
        assert loss_err <= 1e-5 and argmax_equal
