"""Pipeline parallelism: the layers split into stages, one torch.distributed.pipelining schedule per rank.

A stage is the full Llama with the blocks it does not own deleted (block names stay "0".."n-1", so every stage
initialises its blocks exactly as the full model would) and `tok_embeddings` / `norm` + `output` kept only on the
first / last stage. Each stage is then parallelised like a whole model (TP, AC, compile, FSDP).

Data: every PP rank of a DP rank loads the same rows; CP shards the whole local batch along the sequence before the
schedule splits it into microbatches along the batch. `position_ids` reach every stage as a keyword argument (RoPE
needs true positions everywhere). The last stage computes each microbatch's summed token loss divided by the GLOBAL
token count, so gradients are summed over microbatches (scale_grads=False) exactly as without PP.

Single-stage schedules (GPipe, 1F1B) put stage r on PP rank r; multi-stage ones hold several stages per rank, looped
(stage s on rank s % pp) or V-shaped for ZBVZeroBubble (rank r holds stages r and 2*pp-1-r).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from config import RecipeError, Refusal, choices
from config.schema import MultiStageSchedule, PipelineSchedule, SingleStageSchedule

SINGLE_STAGE_SCHEDULES = choices(SingleStageSchedule)
MULTI_STAGE_SCHEDULES = choices(MultiStageSchedule)
SCHEDULES = choices(PipelineSchedule)


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds and which stages this configuration puts on which PP rank."""
    schedule: str
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]
    microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        if self.schedule == "ZBVZeroBubble":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return list(range(pp_rank, self.num_stages, self.pp))


def split_layers(n_layers: int, num_stages: int, layers_per_stage: int = 0) -> list[list[int]]:
    """Consecutive layer ids per stage.

    layers_per_stage = 0: as even as possible, the spare layers going to middle stages first (the first and last
    stages also run the embedding and the output projection). layers_per_stage = k: every stage k layers, the
    shortfall k * num_stages - n_layers taken alternately from the first and the last stage.
    """
    if num_stages > n_layers:
        raise Refusal(f"{n_layers} layers cannot fill {num_stages} stages")
    if layers_per_stage:
        sizes = [layers_per_stage] * num_stages
        shortfall = layers_per_stage * num_stages - n_layers
        for i in range(shortfall):
            sizes[0 if i % 2 == 0 else -1] -= 1
    else:
        sizes = [n_layers // num_stages] * num_stages
        order = list(range(1, num_stages - 1)) + [num_stages - 1, 0]
        for i in range(n_layers % num_stages):
            sizes[order[i]] += 1
    if min(sizes) < 1 or sum(sizes) != n_layers:
        raise Refusal(f"cannot split {n_layers} layers into {num_stages} stages of {layers_per_stage}")
    bounds = [0, *itertools.accumulate(sizes)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_stages)]


_STAGE_RULE = {"v": "exactly 2 x pp", "multi": "a multiple of pp", "single": "exactly pp"}


def _schedule_kind(schedule: str) -> str:
    if schedule == "ZBVZeroBubble":
        return "v"
    return "multi" if schedule in MULTI_STAGE_SCHEDULES else "single"


def _stage_count_fits(schedule: str, pp: int, num_stages: int) -> bool:
    kind = _schedule_kind(schedule)
    if kind == "v":
        return num_stages == 2 * pp
    return num_stages % pp == 0 if kind == "multi" else num_stages == pp


def plan_pipeline(n_layers: int, pp: int, schedule: str, layers_per_stage: int, microbatches: int,
                  local_batch_size: int, where: str = "recipe") -> PipelinePlan:
    """Validates the pipeline settings (one-line RecipeErrors, no process group needed) and returns the plan."""
    if schedule not in SCHEDULES:
        raise RecipeError(f"{where}: parallelism.pp_schedule '{schedule}' is not one of {', '.join(SCHEDULES)}.")
    multi = schedule in MULTI_STAGE_SCHEDULES
    if layers_per_stage < 0:
        raise RecipeError(f"{where}: parallelism.pp_layers_per_stage must be >= 0 (0 = split evenly).")
    if layers_per_stage:
        num_stages = math.ceil(n_layers / layers_per_stage)
    else:
        num_stages = 2 * pp if multi else pp
    if n_layers < num_stages:
        raise RecipeError(f"{where}: model n_layers {n_layers} is fewer than the {num_stages} pipeline stages "
                          f"(pp {pp}, schedule {schedule}). Lower parallelism.pp or use a deeper model.")
    if layers_per_stage and not _stage_count_fits(schedule, pp, num_stages):
        valid = [k for k in range(1, n_layers + 1) if _stage_count_fits(schedule, pp, math.ceil(n_layers / k))]
        hint = (f"Use pp_layers_per_stage {min(valid, key=lambda k: abs(k - layers_per_stage))} or 0"
                if valid else "Use pp_layers_per_stage 0")
        raise RecipeError(f"{where}: pp_layers_per_stage {layers_per_stage} makes {num_stages} stages of "
                          f"{n_layers} layers, but schedule {schedule} needs {_STAGE_RULE[_schedule_kind(schedule)]} "
                          f"(pp {pp}) stages. {hint}.")
    if microbatches < 0:
        raise RecipeError(f"{where}: parallelism.pp_microbatches must be >= 0 (0 = one row per microbatch).")
    m = microbatches or local_batch_size
    if local_batch_size % m:
        raise RecipeError(f"{where}: training.local_batch_size {local_batch_size} cannot be split into "
                          f"parallelism.pp_microbatches {m} equal microbatches. Use a divisor of {local_batch_size}.")
    if schedule != "GPipe" and m < pp:
        raise RecipeError(f"{where}: schedule {schedule} needs at least pp = {pp} microbatches, got {m}. "
                          f"Raise training.local_batch_size / parallelism.pp_microbatches or use GPipe.")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
        raise RecipeError(f"{where}: schedule {schedule} needs pp_microbatches {m} to be a multiple of "
                          f"{max(1, m // pp)} (microbatches // pp). Use a multiple of pp = {pp}.")
    layers = split_layers(n_layers, num_stages, layers_per_stage)
    return PipelinePlan(schedule, pp, tuple(tuple(ids) for ids in layers), m)


def stage_module(model: nn.Module, layer_ids, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` (normally on the meta device) holding only this stage's parts."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in list(stage.layers.keys()):
        if name not in keep:
            del stage.layers[name]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage


class Pipeline:
    """This rank's stages and their schedule. `step(batch, loss_divisor)` runs forward and backward of one (already
    CP-sharded) local batch and returns this rank's summed microbatch losses, each `loss_fn(logits, labels)` divided
    by `loss_divisor` (the step's global token count; zero on ranks without the last stage)."""

    def __init__(self, plan: PipelinePlan, stage_ids: list[int], modules: list[nn.Module], pp_group,
                 device: torch.device, loss_fn):
        self.plan = plan
        self.modules = modules
        self.has_first = 0 in stage_ids
        self.has_last = plan.num_stages - 1 in stage_ids
        self.device = device
        # Imported here: torch.distributed.pipelining imports torch._dynamo (0.4 s), which every launch's one-process
        # recipe check (`train.py --check`, before torchrun) then paid for nothing: 1.95 s -> 1.5 s.
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [PipelineStage(module, idx, plan.num_stages, device, group=pp_group)
                  for idx, module in zip(stage_ids, modules)]
        cls = get_schedule_class(plan.schedule)
        # The schedule keeps one loss function for the whole run; the divisor changes per step (step() sets it).
        self._loss_divisor = 1

        def scaled_loss(logits, labels):
            if logits.dim() == 0:  # the last stage computed the loss itself (chunked with the output projection)
                return logits / self._loss_divisor
            return loss_fn(logits, labels) / self._loss_divisor

        self.schedule = cls(stages if plan.schedule in MULTI_STAGE_SCHEDULES else stages[0],
                            n_microbatches=plan.microbatches, loss_fn=scaled_loss, scale_grads=False)

    def step(self, batch: dict, loss_divisor: int | float = 1, loss_chunk_tokens: int = 0,
             sparse_labels: bool = False) -> torch.Tensor:
        """`loss_chunk_tokens` > 0: the last stage gets the labels and returns its summed loss (the model's fused,
        chunked loss) instead of logits."""
        self._loss_divisor = loss_divisor
        losses = [] if self.has_last else None
        target = batch["labels"] if self.has_last else None
        args = (batch["input_ids"],) if self.has_first else ()
        fused = dict(labels=batch["labels"], loss_chunk_tokens=loss_chunk_tokens, sparse_labels=sparse_labels) \
            if loss_chunk_tokens else {}
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False,
                           position_ids=batch["position_ids"], **fused)
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def build_pipeline(model: nn.Module, plan: PipelinePlan, pp_rank: int, pp_group, device: torch.device,
                   parallelize_stage, materialize, loss_fn) -> Pipeline:
    """Splits `model` (meta device) into this rank's stages, parallelises and materialises each, and builds the
    schedule. `parallelize_stage(module) -> module` and `materialize(module)` are the composer's per-stage steps."""
    stage_ids = plan.stages_of_rank(pp_rank)
    modules = []
    for idx in stage_ids:
        module = stage_module(model, plan.stage_layers[idx], idx == 0, idx == plan.num_stages - 1)
        module = parallelize_stage(module)
        materialize(module)
        modules.append(module)
    return Pipeline(plan, stage_ids, modules, pp_group, device, loss_fn)
