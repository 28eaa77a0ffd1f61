"""The one fake world of the planning probes: one rank of a training run, built without a GPU and without the memory.

`fake_world(cfg, world_size, rank, device)` makes, until exit: a fake process group of `world_size` ranks in this
process (torch's "fake" backend: collectives return at once); the recipe's mesh, with the trainer's hybrid subgroups;
the real model built on the meta device, given to the real composer (TP, activation checkpointing and offload, FSDP2)
and materialised as fake tensors (shapes and dtypes, no storage), DTensor's sharding propagation kept out of that
fake mode; the trainer's StepSetup for it. On exit the process group is destroyed, `sys.excepthook` restored and
DTensor's caches emptied, so the next world starts as a fresh training process does. The memory probe, the step-sync
probe, bench/bench_layer_memory.py and bench/bench_step_kernels.py all build their rank here; `fake_process_group`
alone serves the one-layer CUDA-path probes; `warm_up_optimizer` is shared with the tests' real-tensor reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from config.schema import Config
from models.llama import Llama, recipe_model_config
from models.tile_loops import SampledTiles
from parallelisms.context_parallel import CommStats
from parallelisms.cp.layouts import DOCUMENTS, ZIGZAG
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize, uses_loss_parallel
from parallelisms.stage_meshes import add_hybrid_subgroups
from training.build import build_optimizer, stage_ulysses_degree
from training.step import StepSetup, clip_grad_norm_


@dataclass
class FakeWorld:
    """One rank's model and step setup on fake tensors, inside `fake_world`'s fake mode."""
    cfg: Config
    model_config: object
    """The model's ModelConfig (models/llama.py), as recipe_model_config made it."""
    mesh: object
    """The rank's TrainingMesh."""
    model: torch.nn.Module
    setup: StepSetup
    global_tokens: int
    """Tokens of the global batch: the loss normaliser micro_step takes."""
    accum_steps: int
    """Micro-steps per optimizer step on this rank."""
    optimizer: torch.optim.Optimizer | None = None
    """The run's optimizer after one warm-up step (fake_world's `optimizer`), else None."""

    @property
    def params(self) -> list:
        return list(self.model.parameters())


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """Rank `rank` of a fake process group of `world_size` in this process until exit, unless one of that size and
    rank is up already (a probe inside a fake world); a group of another size is refused: it would plan and count
    for the wrong degree. Yields the WORLD group; on exit restores `sys.excepthook` (init_process_group wraps it in a
    "[rankN]: " prefixer) and empties DTensor's caches."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # lazy: the probes' testing backend only

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"fake process group of {world_size} (rank {rank}): a process group of "
                               f"{dist.get_world_size()} ranks (this one rank {dist.get_rank()}) is already up")
        yield dist.group.WORLD
        return
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_dtensor_caches()


@contextlib.contextmanager
def fake_world(cfg: Config, world_size: int, rank: int = 0, device: str = "cpu", documents: bool = False,
               optimizer: bool = False):
    """Rank `rank` of `cfg` in a fake world of `world_size` (see the module docstring); yields a `FakeWorld` inside
    the fake mode. `device`: "cpu", or "cuda" in a process with the fake CUDA runtime preloaded
    (training/planning/fake/cuda.py), where FSDP2 also gets no-op streams. `optimizer`: build the run's optimizer
    (as on the GPU it plans for) and warm it up (`warm_up_optimizer`), as a rank holds it after its first step.

    Without `documents` (the memory probes) document ids are data, and fake tensors hold none: attention is causal
    (a masked ring skips blocks, so causal is the upper bound) and the documents CP layout is measured as its row of
    one document, zigzag's layout (the same S / P tokens per rank). With it (the step-sync probe, whose batches carry
    real host plans) the recipe's document masking and layout stay."""
    from training.planning.fake.cuda import fsdp_streams_on_fake_cuda

    p, t = cfg.parallelism, cfg.training
    with fake_process_group(world_size, rank), \
            (fsdp_streams_on_fake_cuda() if device == "cuda" else contextlib.nullcontext()):
        dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
        mcfg = recipe_model_config(cfg)
        mesh = dims.build_mesh(device)
        add_hybrid_subgroups(mesh, stage_ulysses_degree(cfg, mcfg, mesh, device))  # as the trainer makes them
        with torch.device("meta"):
            model = Llama(mcfg)
        if device == "cpu":
            model = parallelize(model, mesh, cfg)
        if p.cp_load_balancer == DOCUMENTS and not documents:  # no ids to plan from: its one-document row
            p = dataclasses.replace(p, cp_load_balancer=ZIGZAG)
        with FakeTensorMode(allow_non_fake_inputs=True), _sharding_propagation_in_its_own_fake_mode(), \
                SampledTiles():  # tile loops in three tiles: the same peaks and counts (models/tile_loops.py)
            if device != "cpu":  # in the mode: FSDP2 makes its (empty) buffers on the device
                model = parallelize(model, mesh, cfg)
            setup = StepSetup(model, mesh, p, document_masking=documents and cfg.data.document_masking,
                              loss_parallel=uses_loss_parallel(cfg, mesh), stats=CommStats(),
                              loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size))
            model.to_empty(device=device)  # without FSDP float32 (one-device bf16 is autocast)
            world = FakeWorld(cfg, mcfg, mesh, model, setup, t.global_batch_rows(dims.dp) * t.seq_len,
                              t.grad_accum_steps(dims.dp))
            if optimizer:
                world.optimizer, _ = build_optimizer(cfg, [model], device_type="cuda")  # as on the GPU
                warm_up_optimizer(world.params, world.optimizer, t.max_norm)
            yield world


def warm_up_optimizer(params: list, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """One step on zero gradients: AdamW's state (and DTensor's sharding caches) exist from the first step of a
    training run on, so every later step peaks with them in memory. Measure after this."""
    for param in params:
        param.grad = torch.zeros_like(param)
    clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fake_batch(cfg: Config, device: str = "cpu", shape: tuple[int, int] | None = None) -> dict:
    """A micro-batch of the recipe's shape, or of `shape` = (rows, length) (one document per row)."""
    shape = shape or (cfg.training.local_batch_size, cfg.training.seq_len)
    zeros = lambda: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
    return {"input_ids": zeros(), "labels": zeros(),
            "position_ids": torch.arange(shape[1], device=device).expand(shape).clone(), "document_ids": zeros()}


def _sharding_propagation_in_its_own_fake_mode():
    """DTensor derives each op's output shape by running it on global-shape placeholders in `detect_fake_mode() or
    FakeTensorMode()`, uncached under a fake mode. On a real rank that is a throwaway fake mode, which the trackers
    skip; under the probe's FakeTensorMode it is the probe's own mode, so they counted the placeholders as this rank's
    memory (fp32 tp2: AdamW's foreach ops put full-size copies of every parameter at the optimizer step's peak, 53.5
    MiB predicted vs 27.3 MiB real). With this the probe's DTensor ops propagate as a real rank's do."""
    from torch.distributed.tensor import _sharding_prop

    return mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None)


def _forget_dtensor_caches() -> None:
    """DTensor caches sharding propagation and redistribution plans by DeviceMesh, and two meshes compare equal when
    their shape and dim names do, whatever process groups they hold. The next probe's tp sub-mesh (a (2, 2, 2) mesh's
    and a (4, 2) mesh's are equal) would then get outputs on this probe's mesh, whose group names were destroyed with
    its process group or now name other groups: "Could not resolve the process group registered under the name 25"
    in the planner's tp > 1 probes. Each probe starts from empty caches, as a fresh training process does."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
