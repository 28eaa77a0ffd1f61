"""The chunked linear cross-entropy and the tiled SwiGLU against plain torch (whole logits + F.cross_entropy, the
untiled feed-forward): same loss, same gradients, and never a (tokens x vocab) or (tokens x ffn_dim) tensor whole."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.chunked_loss import IGNORE_INDEX, chunked_linear_cross_entropy
from models.tiled_mlp import tiled_swiglu
from tests.distributed import run_ranks

N, DIM, VOCAB, FFN = 300, 32, 1000, 96


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class LargestTensor(TorchDispatchMode):
    """Elements of the largest tensor any op creates while active, and the most rows of any (rows x VOCAB) matrix
    product (the logits projected at once)."""

    def __init__(self):
        super().__init__()
        self.largest = self.logit_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        if func is torch.ops.aten.mm.default and out.size(1) == VOCAB:
            self.logit_rows = max(self.logit_rows, out.size(0))
        return out


def _loss_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, N // 2, DIM, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, DIM, generator=g) * DIM ** -0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, N // 2), generator=g)
    labels[:, ::7] = IGNORE_INDEX
    return hidden, weight, labels


def _reference_loss(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).flatten(0, 1).float(), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk", [1, 37, 128, N, 4 * N])
def test_chunked_loss_equals_whole_logits_cross_entropy(dtype, tolerance, chunk):
    hidden, weight, labels = _loss_inputs(dtype)
    reference = _reference_loss(hidden, weight, labels) / 123
    reference.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk) / 123
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) <= 1e-6 * abs(reference.item())  # both sum float32 token losses
    assert rel(hidden.grad, expected[0]) <= tolerance and rel(weight.grad, expected[1]) <= tolerance
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype


def test_chunked_loss_never_holds_the_whole_logits_and_runs_without_grad():
    hidden, weight, labels = _loss_inputs(torch.float32)
    spy = LargestTensor()
    with spy:
        chunked_linear_cross_entropy(hidden, weight, labels, 50).backward()
    assert spy.largest == max(50 * VOCAB, VOCAB * DIM) < N * VOCAB  # a chunk of logits or the weight's gradient
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hidden, weight, labels, 50)
        assert loss.item() == pytest.approx(_reference_loss(hidden, weight, labels).item(), rel=1e-6)


def test_the_loss_hands_its_input_gradient_on_and_a_split_backward_still_gets_the_weights():
    """The loss node lives as long as the loss tensor, through the whole backward: it must not keep the hidden
    states' gradient it made in the forward (8 GiB at 1M tokens per rank of an 8B model, at the step's peak). A
    zero-bubble pipeline schedule's split backward (the input's gradient, then the weight's from the same node)
    still gets both, equal to whole-logits cross entropy's."""
    import weakref

    hidden, weight, labels = _loss_inputs(torch.float32)
    x = hidden.detach().clone().requires_grad_()
    reference = _reference_loss(x * 2, weight, labels) / 123
    ref_x, ref_w = torch.autograd.grad(reference, [x, weight])
    loss = chunked_linear_cross_entropy(x * 2, weight, labels, 50) / 123
    held = weakref.ref(loss.grad_fn.next_functions[0][0].grads[0])  # DivBackward -> the loss node's gradient
    (grad_x,) = torch.autograd.grad(loss, [x], retain_graph=True)  # the input pass, as a zero-bubble schedule's
    assert held() is None, "the loss node still holds the input gradient after handing it on"
    (grad_w,) = torch.autograd.grad(loss, [weight])  # the weight pass: the same node's backward again
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-5, atol=1e-7)


def _sparse_labels(labels):
    """Five labelled tokens per row, as in a passkey row; the rest ignored."""
    sparse = torch.full_like(labels, IGNORE_INDEX)
    sparse[:, 40:45] = labels[:, 40:45]
    return sparse


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_sparse_labels_project_only_the_labelled_tokens_for_the_same_result(dtype, tolerance):
    hidden, weight, labels = _loss_inputs(dtype)
    labels = _sparse_labels(labels)
    reference = _reference_loss(hidden, weight, labels)
    reference.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    spy = LargestTensor()
    with spy:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, 64, sparse_labels=True)
    loss.backward()
    assert spy.logit_rows == int((labels != IGNORE_INDEX).sum()) < 64  # the labelled tokens only, not a 64-token chunk
    assert abs(loss.item() - reference.item()) <= 1e-6 * abs(reference.item())
    assert rel(hidden.grad, expected[0]) <= tolerance and rel(weight.grad, expected[1]) <= tolerance
    assert hidden.grad[:, :40].abs().max() == 0 and hidden.grad.dtype == dtype


@pytest.mark.parametrize("sparse_labels", [False, True])
def test_every_label_ignored_gives_zero_loss_and_zero_gradients(sparse_labels):
    hidden, weight, labels = _loss_inputs(torch.float32)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full_like(labels, IGNORE_INDEX), 64, sparse_labels)
    loss.backward()
    assert loss.item() == 0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def _vocab_sharded_body(rank, world_size, sparse_labels):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    hidden, weight, labels = _loss_inputs(torch.float32)
    labels = _sparse_labels(labels) if sparse_labels else labels
    reference = _reference_loss(hidden, weight, labels)
    reference.backward()
    sharded_weight = distribute_tensor(weight.detach(), mesh, [Shard(0)]).requires_grad_()
    seq_sharded = distribute_tensor(hidden.detach(), mesh, [Shard(1)]).requires_grad_()  # sequence parallel input
    loss = chunked_linear_cross_entropy(seq_sharded, sharded_weight, labels, 41, sparse_labels)
    loss.backward()
    return (abs(loss.item() - reference.item()) / reference.item(),
            rel(seq_sharded.grad.full_tensor(), hidden.grad), rel(sharded_weight.grad.full_tensor(), weight.grad))


@pytest.mark.parametrize("world_size, sparse_labels", [(2, False), (3, False), (2, True)])  # 3: uneven vocab split
def test_vocabulary_sharded_chunked_loss_equals_the_whole_vocabulary(world_size, sparse_labels):
    for loss_err, hidden_err, weight_err in run_ranks(_vocab_sharded_body, world_size=world_size,
                                                      args=(sparse_labels,), timeout=120):
        assert loss_err <= 1e-6 and hidden_err <= 1e-6 and weight_err <= 1e-6


def _mlp_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, N // 2, DIM, generator=g).to(dtype).requires_grad_()
    w1, w3 = ((torch.randn(FFN, DIM, generator=g) * 0.2).to(dtype).requires_grad_() for _ in range(2))
    w2 = (torch.randn(DIM, FFN, generator=g) * 0.2).to(dtype).requires_grad_()
    return x, w1, w3, w2


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tile", [1, 64, N])
def test_tiled_swiglu_equals_the_untiled_feed_forward(dtype, tolerance, tile):
    x, w1, w3, w2 = inputs = _mlp_inputs(dtype)
    reference = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    grad_out = torch.randn_like(reference)
    reference.backward(grad_out)
    expected = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    spy = LargestTensor()
    with spy:
        out = tiled_swiglu(x, w1, w3, w2, tile)
        out.backward(grad_out)
    assert rel(out, reference) <= tolerance
    assert all(rel(t.grad, e) <= tolerance for t, e in zip(inputs, expected))
    if tile < N:
        assert spy.largest < N * FFN  # no untiled (tokens x ffn_dim) intermediate


def _tp_mlp_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    x, w1, w3, w2 = _mlp_inputs(torch.float32)
    reference = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    reference.sum().backward()
    xs = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
    ws = [distribute_tensor(w.detach(), mesh, [Shard(d)]).requires_grad_() for w, d in ((w1, 0), (w3, 0), (w2, 1))]
    out = tiled_swiglu(xs, *ws, 29)  # this rank's sequence shard, as TP's row-wise w2 returns it
    out.sum().backward()
    dist.barrier()
    rows = N // 2 // world_size
    return (rel(out, reference[:, rank * rows:(rank + 1) * rows]), rel(xs.grad.full_tensor(), x.grad),
            *(rel(w.grad.full_tensor(), ref.grad) for w, ref in zip(ws, (w1, w3, w2))))


def test_tiled_swiglu_on_tensor_parallel_shards():
    for errors in run_ranks(_tp_mlp_body, world_size=2, timeout=120):
        assert max(errors) <= 1e-6, errors
