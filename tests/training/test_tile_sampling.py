"""The dry run's three-tile walk of the tile loops (models/tile_loops.py) changes no figure it reads: each tiled op,
forward and backward on fake tensors with ten tiles (the last short), measured under the probe's memory tracker and dispatch counter
with SampledTiles (three tiles run) and without (every tile run, the reference): the same peak, the same calls and
bytes of every aten op, and fewer dispatches actually made. Ten tiles of a few rows: the walk's claim is about the
sequence of allocations, which does not depend on the rows' width."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.chunked_loss import chunked_linear_cross_entropy
from models.chunked_scores import chunked_token_scores
from models.rope import apply_rotary
from models.tile_loops import SampledTiles, tile_starts
from models.tiled_mlp import tiled_swiglu
from models.tiled_norm import tiled_rms_norm
from training.planning.eval_memory import PeakMemTracker, tracked_bytes
from training.planning.fake.counter import DispatchCounter

TOKENS, DIM, TILE = 38, 16, 4
"""Ten tiles, the last one short: then only tile 1 shows a full tile on top of a full tile's leftovers."""


class _RawDispatches(TorchDispatchMode):
    """Every dispatch that reaches it, unweighted: what the walk saves."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _rotary(x):
    angles = torch.ones(1, TOKENS, 1, DIM // 4)  # two heads of DIM // 2
    return apply_rotary(x.view(1, TOKENS, 2, DIM // 2), angles.cos(), angles.sin(),
                        tile_elements=TILE * DIM)


def _norm(x):
    return tiled_rms_norm(x, torch.ones(DIM, requires_grad=True), 1e-5, TILE)


def _swiglu(x):
    w1, w3 = torch.ones(3 * DIM, DIM, requires_grad=True), torch.ones(3 * DIM, DIM, requires_grad=True)
    return tiled_swiglu(x, w1, w3, torch.ones(DIM, 3 * DIM, requires_grad=True), TILE)


def _loss(x):
    """The output projection fused with the loss, ten chunks of TILE tokens (models/chunked_loss.py)."""
    labels = torch.zeros(TOKENS, dtype=torch.long)
    return chunked_linear_cross_entropy(x, torch.ones(3 * DIM, DIM, requires_grad=True), labels, TILE)


def _scores(x):
    """The evaluations' per-token loss and argmax, ten chunks (models/chunked_scores.py): no backward."""
    loss, prediction = chunked_token_scores(x, torch.ones(3 * DIM, DIM), torch.zeros(TOKENS, dtype=torch.long), TILE)
    return loss + prediction


def _measure(op, sampled: bool) -> tuple:
    """(peak bytes, {op: calls}, {op: bytes}, raw dispatches) of op's forward and backward on fake tensors."""
    with FakeTensorMode(), (SampledTiles() if sampled else _RawDispatches()):
        x = torch.empty(TOKENS, DIM, requires_grad=True)
        with PeakMemTracker() as tracker, DispatchCounter() as counter, _RawDispatches() as raw:
            y = op(x).sum()
            if y.requires_grad:
                y.backward()
        peak = tracked_bytes(tracker.get_tracker_snapshot("peak"))["Total"]
    return peak, dict(counter.calls), dict(counter.bytes), raw.n


@pytest.mark.parametrize("op", [_rotary, _norm, _swiglu, _loss, _scores],
                         ids=["rope", "rms_norm", "swiglu", "chunked loss", "chunked scores"])
def test_three_tiles_give_every_tile_s_peak_and_counts(op):
    peak, calls, moved, dispatches = _measure(op, sampled=True)
    full_peak, full_calls, full_moved, full_dispatches = _measure(op, sampled=False)
    assert peak == full_peak > 0
    assert calls == full_calls and moved == full_moved
    assert dispatches < full_dispatches  # the walk ran: fewer tiles dispatched


def test_real_tensors_and_short_loops_run_every_tile():
    with SampledTiles():
        assert list(tile_starts(10, 1, torch.empty(10))) == list(range(10))  # real
        with FakeTensorMode():
            fake = torch.empty(10)
            assert list(tile_starts(10, 4, fake)) == [0, 4, 8]  # three tiles: nothing to skip
            assert list(tile_starts(10, 1, fake)) == [0, 1, 9]
    with FakeTensorMode():
        assert list(tile_starts(10, 1, torch.empty(10))) == list(range(10))  # not in a dry run's probe


def _ring_layer(sampled: bool, world: int = 4, rank: int = 1, heads: int = 16, kv_heads: int = 8,
                head_groups: int = 8) -> tuple:
    """(peak bytes, {op: calls}, {op: bytes}, attention calls by kernel, ring bytes sent, raw dispatches) of one
    layer's ring attention, forward and backward, `rank` of a fake zigzag CP group of `world`, in `head_groups`
    K/V head groups."""
    from parallelisms.cp.autograd import grouped_backward, grouped_forward
    from parallelisms.cp.block_spec import BlockSpec
    from parallelisms.cp.counters import CommStats
    from parallelisms.cp.exchange_ring import ring_backward, ring_forward
    from training.planning.fake.world import fake_process_group
    stats = CommStats()
    with fake_process_group(world, rank) as group, FakeTensorMode(allow_non_fake_inputs=True), \
            (SampledTiles() if sampled else _RawDispatches()):
        make = lambda h: torch.empty(1, 32, h, 8).transpose(1, 2)  # noqa: E731
        q, k, v = make(heads), make(kv_heads), make(kv_heads)
        spec = BlockSpec(group, True, None, "zigzag", None, stats, head_groups=head_groups)
        with PeakMemTracker() as tracker, DispatchCounter() as counter, _RawDispatches() as raw:
            out, lse, auxes = grouped_forward(ring_forward, q, k, v, spec)
            grads = grouped_backward(ring_backward, torch.empty_like(out), q, k, v, out, lse, auxes, spec)
            del out, lse, auxes, grads
        peak = tracked_bytes(tracker.get_tracker_snapshot("peak"))["Total"]
    return peak, dict(counter.calls), dict(counter.bytes), dict(counter.by_kernel), stats.bytes_sent, raw.n


def test_three_head_groups_give_every_group_s_peak_counts_and_ring_bytes():
    """The ring's head groups walked as tile loops are (parallelisms/cp/autograd.py): each group's ring writes its
    slice of preallocated outputs, so three groups give all eight's peak, op counts and bytes, attention calls and
    ring bytes (weighted by cp/counters.py). On the CPU kernels, whose forward keeps no kernel state between groups;
    the CUDA path's kernels keep a philox seed and offset per call, which the groups not run do not hold (the CUDA
    path's 4M-token peak 46 KB lower of 69.5 GiB, docs/design.md)."""
    sampled, full = _ring_layer(True), _ring_layer(False)
    assert sampled[:5] == full[:5] and full[0] > 0 and full[4] > 0 and sum(full[3].values()) > 0
    assert sampled[5] < full[5]  # the walk ran: fewer dispatches


def _ring_layer_cp8(sampled: bool, rank: int) -> tuple:
    """`_ring_layer` on `rank` of CP 8, one head group (GQA 2:1)."""
    return _ring_layer(sampled, world=8, rank=rank, heads=4, kv_heads=2, head_groups=1)


def _with_kernel_state(monkeypatch):
    """The CPU block kernels made to keep state from each call's forward to its backward, as CUDA's do (flash's
    philox seed and offset, cuDNN's stats): a 4 KiB tensor per call, handed back to the backward."""
    from parallelisms.cp import kernel_calls

    forward, backward = kernel_calls.block_forward, kernel_calls.block_backward

    def forward_with_state(*args, **kwargs):
        out, lse, aux = forward(*args, **kwargs)
        return out, lse, (aux, torch.empty(1024))

    def backward_with_state(dout, q, k_blk, v_blk, out, lse, aux, *args, **kwargs):
        return backward(dout, q, k_blk, v_blk, out, lse, aux[0], *args, **kwargs)

    monkeypatch.setattr(kernel_calls, "block_forward", forward_with_state)
    monkeypatch.setattr(kernel_calls, "block_backward", backward_with_state)


@pytest.mark.parametrize("kernel_state", [False, True], ids=["cpu kernels", "kernel state kept as on CUDA"])
def test_three_ring_steps_give_every_step_s_peak_counts_and_ring_bytes(monkeypatch, kernel_state):
    """The ring's steps walked in three where every step after the first computes the same pieces
    (parallelisms/cp/exchange_ring.py): rank 0 of zigzag CP 8, whose seven sources all come after it, gives all
    eight steps' peak (also with kernels that keep state until the backward, as CUDA's do: the five steps not run
    hold copies of the second's), op counts and bytes, attention calls and ring bytes. Rank 1, whose first source
    (rank 0) comes before it and the others after, computes different pieces per source and runs every step.
    Eight ranks: the walk needs more than three steps to skip any."""
    if kernel_state:
        _with_kernel_state(monkeypatch)
    sampled, full = _ring_layer_cp8(True, 0), _ring_layer_cp8(False, 0)
    assert sampled[:5] == full[:5] and full[0] > 0 and full[4] > 0 and sum(full[3].values()) > 0
    assert sampled[5] < full[5]  # the walk ran: fewer dispatches
    assert _ring_layer_cp8(True, 1) == _ring_layer_cp8(False, 1)  # every step ran
