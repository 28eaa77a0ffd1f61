"""Host syncs of the trainer's whole micro-step as a GPU would run it, counted on a CPU-only box (issue 27).

One rank of the planning probes' fake world (training/planning/fake/world.py) of the run's world size, on a `cuda`
mesh as fake CUDA tensors, takes its micro-batches from the trainer's own loader path (training/batch_plans
step_loader: placement by work, documents plans from real host ids) through the trainer's loop body (`move_batch`,
`micro_step`, `metrics.visible_pairs`) under the dispatch counter (training/planning/fake/counter.py): every scalar
read and device-to-host copy of a fake CUDA tensor is one place where a GPU run's host would wait.

The backward needs the fake CUDA runtime (training/planning/fake/cuda.py: CUDA hooks, no-op streams and events),
which must be preloaded: the probe runs in a process of its own (`fake_cuda_env`).

What it does not count: the reads once per optimizer step outside the micro-step (`Trainer.train_step` returns
`loss.item()` and `float(grad_norm)`: two per step) and the once-per-log-step metrics.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from config.schema import Config
from training import step
from training.batch_plans import stage_step_loader
from training.metrics import visible_pairs
from training.planning.fake.counter import DispatchCounter
from training.planning.fake.cuda import fake_cuda_preloaded
from training.planning.fake.world import fake_world
from training.step import StepSetup, clip_grad_norm_


@dataclass
class StepSyncs:
    """Host syncs of one rank's micro-steps on fake CUDA tensors."""
    micro_steps: int
    counts: dict
    """{"_local_scalar_dense" | "device_to_host": count} over all micro-steps."""
    places: dict
    """{"<kind> at <file:line function>": count}: where each one was made."""
    attention_calls: dict
    """{aten op name: calls} of the attention kernels the micro-steps ran (CUDA flash / varlen on fake CUDA)."""
    aten_ops: int
    clip_counts: dict | None = None
    """Host syncs of the step's gradient clipping by the global norm (`step.clip_grad_norm_`), once per optimizer
    step after the micro-steps; None when the micro-steps stopped early."""
    stopped: str | None = None
    """Why the micro-steps stopped early: fake tensors hold no values, so a step that reads one back (`.item()`,
    `.tolist()`) fails right after the counter has seen and located that read."""


def count_micro_step_syncs(cfg: Config, world_size: int, rank: int, micro_loader_for, steps: int = 1,
                           where: bool = True) -> StepSyncs:
    """`rank` of a fake world of `world_size` runs `steps` optimizer steps' micro-steps on fake CUDA tensors;
    `micro_loader_for(mesh)` builds this rank's per-micro-batch loader (training/build.build_stage_data's)."""
    if not fake_cuda_preloaded():
        raise RuntimeError("the fake CUDA runtime is not preloaded: run the probe with fake_cuda_env(os.environ)")
    with fake_world(cfg, world_size, rank, device="cuda", documents=True) as world:
        with unset_fake_temporarily():  # the trainer's own loader: real host ids and plans, made on the host
            loader = iter(stage_step_loader(cfg, world.setup, micro_loader_for(world.mesh), world.accum_steps, "cuda",
                                            pin_memory=False))
            batches = [b for _ in range(steps) for b in next(loader)["micro_batches"]]
        counted = _count_micro_steps(world.setup, batches, world.global_tokens, where)
        if not counted.stopped:
            with DispatchCounter() as clip_syncs:
                clip_grad_norm_(world.params, cfg.training.max_norm)
            counted.clip_counts = dict(clip_syncs.counts)
    return counted


def _count_micro_steps(setup: StepSetup, batches: list[dict], global_tokens: int, where: bool) -> StepSyncs:
    """The trainer's loop body (Trainer.train_step) per micro-batch, counted; stops at the first failure."""
    counter, stopped = DispatchCounter(where=where, record=True), None
    try:
        with counter:
            for batch in batches:
                local = step.move_batch(batch, torch.device("cuda"))
                step.micro_step(setup, local, global_tokens)
                visible_pairs(local["position_ids"])
    except Exception as e:  # a value read back from a fake tensor (counted and located), or any failure
        stopped = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    attention = collections.Counter(str(call[0]) for call in counter.attention_calls)
    return StepSyncs(len(batches), dict(counter.counts), dict(counter.places or {}), dict(attention), counter.ops,
                     None, stopped)
