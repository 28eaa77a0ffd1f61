"""Context-length ramps: `[[ramp]]` stages in the recipe, each a complete Config for its span of steps.

    [training]
    tokens_per_step = 16384      # global tokens per optimizer step, kept constant across stages

    [[ramp]]                     # one table per stage, in order; the first starts at step 0
    start_step = 0
    seq_len = 512
    cp = 1                       # 0 or absent = the recipe's parallelism.cp
    rope_theta = 10000.0         # 0 or absent = keep the previous stage's
    offload = true               # activation offload from this stage on; absent = keep the previous stage's

A stage may change `seq_len`, `cp` (traded against dp_shard: their product is fixed, so FSDP, which shards over the
flattened (dp_shard, cp) group, keeps every parameter where it is), RoPE (`rope_theta`, `rope_scaling_factor`,
-1 = off, `rope_type` llama3 | yarn), `local_batch_size` and activation `offload` (the model is built once, with
the offloader when any stage offloads; the trainer switches it on and off per stage, training/trainer.py). With
`training.tokens_per_step` the global batch of a stage is tokens_per_step / seq_len rows, split into local batches
and gradient-accumulation micro-steps. Everything is resolved and checked before launch; a bad stage is a one-line
error naming `ramp[i]`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

from config import Config, RampTable, RecipeError
from config.rope import RopeSettings
from config.schema import MIN_SEQ_LEN
from models.llama import LlamaConfig, recipe_model_config
from data.sources import rows_per_source
from parallelisms.parallel_dims import ParallelDims


@dataclass
class RampStage:
    """One stage of the context-length ramp, resolved: the recipe with the stage's values filled in, its parallel
    degrees on the launched world and its span of optimizer steps. (A pipeline stage and a dry-run row are other
    things: parallelisms/pipeline_parallel.py, training/planning/dry_run.py.)"""
    index: int  # -1: the recipe itself (no [[ramp]])
    start_step: int
    end_step: int  # exclusive
    cfg: Config
    dims: ParallelDims

    @property
    def name(self) -> str:
        return f"ramp[{self.index}]" if self.index >= 0 else "recipe"

    @property
    def global_batch_rows(self) -> int:
        return self.cfg.training.global_batch_rows(self.dims.dp)

    @property
    def grad_accum_steps(self) -> int:
        return self.cfg.training.grad_accum_steps(self.dims.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_rows * self.cfg.training.seq_len

    @functools.cached_property
    def model(self) -> LlamaConfig:
        """The model shape of this stage (its RoPE may differ from the previous stage's)."""
        return recipe_model_config(self.cfg)


def _fail(cfg: Config, i: int, stage: RampTable, message: str):
    raise RecipeError(f"{cfg.recipe_path}: ramp[{i}] (start_step {stage.start_step}): {message}")


def _batch_for(cfg, i: int, stage: RampTable, seq_len: int, dp: int) -> tuple[int, int]:
    """(global_batch_size, local_batch_size) of a stage under the tokens-per-step policy."""
    t = cfg.training
    tokens = t.tokens_per_step
    if tokens % seq_len:
        _fail(cfg, i, stage, f"training.tokens_per_step {tokens} is not a multiple of seq_len {seq_len}; "
                             f"use a tokens_per_step divisible by every stage's seq_len.")
    rows = tokens // seq_len
    if rows % dp:
        _fail(cfg, i, stage, f"{rows} rows per step (tokens_per_step / seq_len) cannot be split over {dp} "
                             f"data-parallel ranks; raise training.tokens_per_step to a multiple of {dp * seq_len}.")
    per_rank = rows // dp
    local = stage.local_batch_size or min(t.local_batch_size, per_rank)
    while per_rank % local:
        local -= 1
    if stage.local_batch_size and per_rank % stage.local_batch_size:
        _fail(cfg, i, stage, f"local_batch_size {stage.local_batch_size} does not divide the {per_rank} rows each "
                             f"data-parallel rank gets per step.")
    return rows, local


def resolve_stages(cfg: Config, world_size: int) -> list[RampStage]:
    """One RampStage per [[ramp]] table (or the recipe itself), each with a full Config, checked against the world."""
    p, steps = cfg.parallelism, cfg.training.steps
    base = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    if not cfg.ramp:
        return [RampStage(-1, 0, steps, cfg, base)]
    if p.pp > 1:
        raise RecipeError(f"{cfg.recipe_path}: [[ramp]] with parallelism.pp > 1 is not supported: pipeline stages fix "
                          f"their activation shapes at the first step. Use pp = 1 for ramped runs.")
    stages, previous = [], cfg
    for i, table in enumerate(cfg.ramp):
        _check_table(cfg, i, table, base)
        s = _stage_config(cfg, previous, i, table, base)
        dims = dataclasses.replace(base, dp_shard=s.parallelism.dp_shard, cp=s.parallelism.cp)
        end = cfg.ramp[i + 1].start_step if i + 1 < len(cfg.ramp) else steps
        stages.append(RampStage(i, table.start_step, end, s, dims))
        previous = s
    return stages


def _check_table(cfg: Config, i: int, table: RampTable, base: ParallelDims) -> None:
    """The checks one [[ramp]] table needs against its neighbours and the launched world."""
    steps = cfg.training.steps
    if i == 0 and table.start_step != 0:
        _fail(cfg, i, table, "the first stage must start at step 0.")
    if i > 0 and table.start_step <= cfg.ramp[i - 1].start_step:
        _fail(cfg, i, table, f"start_step must increase: the previous stage starts at {cfg.ramp[i - 1].start_step}.")
    if table.start_step >= steps:
        _fail(cfg, i, table, f"starts at or after the last step (training.steps = {steps}); raise training.steps "
                             f"or remove the stage.")
    if table.seq_len < MIN_SEQ_LEN:
        _fail(cfg, i, table, f"seq_len must be >= {MIN_SEQ_LEN}, got {table.seq_len}.")
    tradeable = base.dp_shard * base.cp
    cp = table.cp or cfg.parallelism.cp
    if tradeable % cp:
        options = [d for d in range(1, tradeable + 1) if tradeable % d == 0]
        _fail(cfg, i, table, f"cp {cp} cannot be traded against dp_shard: dp_shard x cp = {tradeable} ranks on "
                             f"{base.world_size} launched. Use a cp in {options}.")


def _stage_config(cfg: Config, previous: Config, i: int, table: RampTable, base: ParallelDims) -> Config:
    """The previous stage's config with this table's values: seq_len, cp traded against dp_shard, RoPE, batch."""
    tradeable = base.dp_shard * base.cp
    cp = table.cp or cfg.parallelism.cp
    s = copy.deepcopy(previous)
    s.ramp = []
    s.training.seq_len = table.seq_len
    s.parallelism.cp, s.parallelism.dp_shard = cp, tradeable // cp
    for key, value in RopeSettings.from_recipe(table).recipe_fields().items():
        setattr(s.model, key, value)
    if table.local_batch_size:
        s.training.local_batch_size = table.local_batch_size
    if table.source_weights:
        _apply_source_weights(cfg, i, table, s)
    if table.offload is not None:
        s.activation_checkpoint.offload = table.offload
        if table.offload and s.activation_checkpoint.mode == "none":
            _fail(cfg, i, table, "offload = true needs activation_checkpoint.mode full, selective or op (it is "
                                 "\"none\"): offload moves what checkpointing keeps. Set a mode or remove offload.")
    if cfg.training.tokens_per_step:
        dp = base.dp_replicate * s.parallelism.dp_shard
        s.training.global_batch_size, s.training.local_batch_size = _batch_for(cfg, i, table, table.seq_len, dp)
    return s


def _apply_source_weights(cfg: Config, i: int, table: RampTable, stage_cfg: Config) -> None:
    """A stage's source_weights replace the named sources' weights from that stage on."""
    sources = {source.name: source for source in stage_cfg.data.sources}
    for name, weight in table.source_weights.items():
        if name not in sources:
            _fail(cfg, i, table, f"source_weights names '{name}', which is not one of the [[data.sources]] "
                                 f"({', '.join(sources) or 'none: set [[data.sources]] first'}).")
        if weight < 0:
            _fail(cfg, i, table, f"source_weights.{name} = {weight}; weights must be >= 0.")
        sources[name].weight = weight
    if not sum(source.weight for source in sources.values()) > 0:
        _fail(cfg, i, table, "source_weights leave every source at weight 0; give one a positive weight.")


def model_build_config(stages: list[RampStage]) -> Config:
    """The config the one model of a ramped run is built with: the first stage's, with the activation offloader
    when any stage offloads (each stage then switches it on or off)."""
    cfg = copy.deepcopy(stages[0].cfg)
    cfg.activation_checkpoint.offload = any(s.cfg.activation_checkpoint.offload for s in stages)
    return cfg


def stage_at(stages: list[RampStage], step: int) -> RampStage:
    """The stage that trains optimizer step `step` (0-based: the number of steps already completed)."""
    return [s for s in stages if s.start_step <= step][-1]


def tokens_seen(stages: list[RampStage], steps_done: int) -> int:
    """Global tokens trained on after `steps_done` optimizer steps (derived from the plan, so exact after a resume)."""
    return sum(max(0, min(steps_done, s.end_step) - s.start_step) * s.tokens_per_step for s in stages)


def source_tokens_seen(stages: list[RampStage], steps_done: int) -> dict[str, int]:
    """Global tokens trained on per data source after `steps_done` steps (each stage's mixture from its own row 0)."""
    seen: dict[str, int] = {}
    for s in stages:
        steps = max(0, min(steps_done, s.end_step) - s.start_step)
        seq_len = s.cfg.training.seq_len
        for name, rows in rows_per_source(s.cfg, 0, steps * s.global_batch_rows).items():
            seen[name] = seen.get(name, 0) + rows * seq_len
    return seen
