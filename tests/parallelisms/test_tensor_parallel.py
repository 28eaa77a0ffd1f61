"""Tensor + sequence + loss parallelism: the loss and every gradient equal the unsharded model's, attention sees
its local heads with unexpanded K/V, and impossible head splits are refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from models.llama import Llama, LlamaConfig, canonical_name
from parallelisms.tensor_parallel import check_tp_degree
from tests.distributed import run_ranks
from config import RecipeError

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)
BATCH, SEQ = 2, 16


class SdpaShapes(TorchFunctionMode):
    """Records the (q heads, k heads, v heads) of every F.scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls.append((args[0].shape[1], args[1].shape[1], args[2].shape[1]))
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference():
    """Loss and gradients of the plain model: mean cross entropy over all tokens."""
    model = Llama(LlamaConfig(**TINY))
    model.init_weights(0)
    inputs, labels = _batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.item(), {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}


def _tp_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {enabled: _tp_run(mesh, enabled) for enabled in (True, False)}


def _tp_run(mesh, loss_parallel):
    from torch.distributed.tensor import DTensor

    from parallelisms.tensor_parallel import apply_tp
    from training.loss import loss_context, token_loss_sum

    with torch.device("meta"):
        model = Llama(LlamaConfig(**TINY))
    apply_tp(model, mesh, loss_parallel)
    model.to_empty(device="cpu")
    model.init_weights(0)
    inputs, labels = _batch()
    shapes = SdpaShapes()
    with shapes, loss_context(loss_parallel):
        logits = model(inputs)
        sharded_logits = isinstance(logits, DTensor) and logits.placements[0].is_shard(2)
        loss = token_loss_sum(logits, labels) / labels.numel()
        loss.backward()
    # numpy, not tensors: torch shares tensors between processes through the sender, which exits right after.
    grads = {canonical_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy()
             for n, p in model.named_parameters()}
    local_out = model.layers["0"].attention.wq.weight.to_local().shape
    return loss.item(), grads, [tuple(c) for c in shapes.calls], sharded_logits, tuple(local_out)


@pytest.fixture(scope="module")
def tp2_results():
    return run_ranks(_tp_body, world_size=2, timeout=120)


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_tp2_loss_and_grads_equal_unsharded_model(tp2_results, loss_parallel):
    ref_loss, ref_grads = _reference()
    for loss, grads, calls, sharded_logits, wq_local in (per_rank[loss_parallel] for per_rank in tp2_results):
        assert abs(loss - ref_loss) / ref_loss <= 1e-6
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            err = (torch.from_numpy(grads[name]) - ref).abs().max().item() / ref.abs().max().item()
            assert err <= 1e-5, (name, err)
        # Local heads: 4 query heads and 2 K/V heads over tp 2 -> 2 and 1, K/V not expanded to the query heads.
        assert calls == [(2, 1, 1)] * TINY["n_layers"]
        assert wq_local == (TINY["dim"] // 2, TINY["dim"])
        assert sharded_logits == loss_parallel  # vocabulary-sharded logits are never gathered under loss parallel


@pytest.mark.parametrize("heads, kv_heads, tp, expect", [
    (16, 16, 3, "n_heads 16 is not divisible by parallelism.tp 3"),
    (16, 2, 4, "n_kv_heads 2 is not divisible by parallelism.tp 4"),
])
def test_impossible_head_split_is_refused(heads, kv_heads, tp, expect):
    with pytest.raises(RecipeError, match=expect):
        check_tp_degree(heads, kv_heads, tp)


def test_possible_head_split_passes():
    check_tp_degree(16, 8, 8)
    check_tp_degree(32, 8, 4)
