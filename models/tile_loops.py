"""The tile loops of the long-context blocks (RoPE, RMSNorm, SwiGLU), and how a dry run walks them in three tiles.

A tile loop over fake tensors (the dry run's memory probe: models/rope.py, tiled_norm.py, tiled_mlp.py on fake
tensors under torch's memory tracker) allocates and frees the same sizes in every full tile: at 1M tokens over 8
ranks the RoPE of q and k runs 32 tiles, each a dozen fake dispatches at ~2.6 ms (the tracker's, the counter's and
FakeTensor's Python each see it), and the tile loops were about two thirds of the 8B dry run's time.

`SampledTiles`, entered by the probe (training/planning/fake/world.py), lets a loop over fake tensors run three
tiles: the first, the second, and the last. That is the whole loop's allocation sequence as far as any peak can
tell: tile 0 starts from nothing of the loop; tile 1 starts with tile 0's leftovers still referenced (Python frees
a tile's temporaries when the next tile rebinds their names), as every later full tile does with its predecessor's;
the last tile (full or short) follows a full tile either way. The dispatch counter (training/planning/fake/
counter.py) counts tile 1's ops `weight` = n - 2 times, so the op, kernel and byte counts the step price reads are
the whole loop's. The CP attention's head groups (parallelisms/cp/autograd.py: a ring per group, each writing its
slice of preallocated outputs) are walked the same way, and the ring's byte counter (cp/counters.py) scales what
the middle group sends by its weight; so are the ring's steps where every step after the first computes the same
pieces (parallelisms/cp/exchange_ring.py, with copies of the kernels' saved state for the steps not run, made under
`uncounted_ballast`). Fake tensors hold no values, so the tiles not run change no number. Real
tensors, compiled graphs (whose inputs are functional wrappers, never bare fake tensors) and loops of three tiles or
fewer run every tile.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack


class SampledTiles(TorchDispatchMode):
    """While entered, tile loops over fake tensors run three tiles (module docstring). Passes every op through;
    `weight` is how many tiles the one now running stands for (1 outside the loops)."""

    def __init__(self):
        super().__init__()
        self.weight = 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def uncounted_ballast(sampler: SampledTiles):
    """Tensors made inside stand for what the iterations not run would hold (their memory counts, as the memory
    tracker sees them), not for work: weight 0, so the dispatch counter and the byte counters add nothing."""
    outer = sampler.weight
    sampler.weight = 0
    try:
        yield
    finally:
        sampler.weight = outer


def active_sampler() -> SampledTiles | None:
    """The innermost entered SampledTiles, if any."""
    return next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, SampledTiles)), None)


def is_sampled(length: int, tile: int, like: torch.Tensor) -> bool:
    """Whether `tile_starts(length, tile, like)` runs three tiles (then the second stands for all but two)."""
    return isinstance(like, FakeTensor) and len(range(0, length, tile)) > 3 and active_sampler() is not None


def tile_starts(length: int, tile: int, like: torch.Tensor) -> Iterator[int]:
    """The first index of each tile of `tile` along a dimension of `length`: all of them, or under `SampledTiles`
    with a fake `like`, the first, second (standing for n - 2 tiles while the loop body runs) and last."""
    starts = range(0, length, tile)
    sampler = active_sampler() if is_sampled(length, tile, like) else None
    if sampler is None:
        yield from starts
        return
    yield starts[0]
    outer = sampler.weight  # a loop inside a sampled one (a ring's head groups hold no tile loop today) multiplies
    sampler.weight = outer * (len(starts) - 2)
    try:
        yield starts[1]
    finally:
        sampler.weight = outer
    yield starts[-1]
