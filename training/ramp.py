"""Context-length ramps: `[[ramp]]` stages in the recipe, each a complete Config for its span of steps.

    [training]
    tokens_per_step = 16384      # global tokens per optimizer step, kept constant across stages

    [[ramp]]                     # one table per stage, in order; the first starts at step 0
    start_step = 0
    seq_len = 512
    cp = 1                       # 0 or absent = the recipe's parallelism.cp
    rope_theta = 10000.0         # 0 or absent = keep the previous stage's

A stage may change `seq_len`, `cp` (traded against dp_shard: their product is fixed, so FSDP, which shards over the
flattened (dp_shard, cp) group, keeps every parameter where it is), RoPE (`rope_theta`, `rope_scaling_factor`,
-1 = off) and `local_batch_size`. With `training.tokens_per_step` the global batch of a stage is
tokens_per_step / seq_len rows, split into local batches and gradient-accumulation micro-steps. Everything is
resolved and checked before launch; a bad stage is a one-line error naming `ramp[i]`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from training.errors import RecipeError


@dataclass
class RampStage:
    start_step: int = -1
    """First optimizer step (0-based, i.e. the number of steps completed) trained with this stage's settings."""
    seq_len: int = 0
    """Sequence length of this stage."""
    cp: int = 0
    """Context-parallel degree of this stage, traded against dp_shard (0 = the recipe's parallelism.cp)."""
    rope_theta: float = 0.0
    """RoPE base from this stage on (0 = keep the previous stage's)."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 RoPE scaling factor from this stage on (0 = keep, -1 = off)."""
    local_batch_size: int = 0
    """Rows per data-parallel rank per micro-step (0 = derived from tokens_per_step and the recipe's value)."""
    source_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """Source weights from this stage on, by source name (unnamed sources keep the recipe's weight)."""


@dataclass
class Stage:
    index: int
    start_step: int
    end_step: int  # exclusive
    cfg: object  # training.config.Config with this stage's values filled in
    tokens_per_step: int  # global batch rows x seq_len

    @property
    def name(self) -> str:
        return f"ramp[{self.index}]" if self.index >= 0 else "recipe"


def parse_ramp(tables, recipe_path: str) -> list[RampStage]:
    """The `[[ramp]]` array of tables -> typed stages (errors name `ramp[i].key`)."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise RecipeError(f"{recipe_path}: 'ramp' must be an array of tables: write each stage as [[ramp]].")
    fields = {f.name: f.type for f in dataclasses.fields(RampStage)}
    stages = []
    for i, table in enumerate(tables):
        stage = RampStage()
        for key, value in table.items():
            if key not in fields:
                import difflib
                near = difflib.get_close_matches(key, list(fields), n=1)
                hint = f" Did you mean '{near[0]}'?" if near else f" Valid: {', '.join(fields)}."
                raise RecipeError(f"{recipe_path}: unknown key 'ramp[{i}].{key}'.{hint}")
            if key == "source_weights":
                if not isinstance(value, dict) or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                          for w in value.values()):
                    raise RecipeError(f"{recipe_path}: ramp[{i}].source_weights must be a table of numbers, e.g. "
                                      f"source_weights = {{books = 0.3, code = 0.7}}.")
                stage.source_weights = {str(k): float(w) for k, w in value.items()}
                continue
            want = int if fields[key] in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and
                                                                                 not isinstance(value, int)):
                raise RecipeError(f"{recipe_path}: ramp[{i}].{key}: expected "
                                  f"{'an integer' if want is int else 'a number'}, got {value!r}. Fix the value.")
            setattr(stage, key, want(value))
        for key in ("start_step", "seq_len"):
            if key not in table:
                raise RecipeError(f"{recipe_path}: ramp[{i}] needs '{key}'. Add {key} = ... to that [[ramp]] table.")
        stages.append(stage)
    return stages


def _fail(cfg, i: int, stage: RampStage, message: str):
    raise RecipeError(f"{cfg.recipe_path}: ramp[{i}] (start_step {stage.start_step}): {message}")


def _batch_for(cfg, i: int, stage: RampStage, seq_len: int, dp: int) -> tuple[int, int]:
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


def resolve_stages(cfg, world_size: int) -> list[Stage]:
    """One Stage per [[ramp]] table (or the recipe itself), each with a full Config, checked against the world."""
    from parallelisms.parallel_dims import ParallelDims

    p, steps = cfg.parallelism, cfg.training.steps
    base = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)

    def tokens_per_step(c, dp: int) -> int:
        rows = c.training.global_batch_size if c.training.global_batch_size != -1 else c.training.local_batch_size * dp
        return rows * c.training.seq_len

    if not cfg.ramp:
        return [Stage(-1, 0, steps, cfg, tokens_per_step(cfg, base.dp))]
    if p.pp > 1:
        raise RecipeError(f"{cfg.recipe_path}: [[ramp]] with parallelism.pp > 1 is not supported: pipeline stages fix "
                          f"their activation shapes at the first step. Use pp = 1 for ramped runs.")
    tradeable = base.dp_shard * base.cp
    stages, previous = [], cfg
    for i, stage in enumerate(cfg.ramp):
        if i == 0 and stage.start_step != 0:
            _fail(cfg, i, stage, "the first stage must start at step 0.")
        if i > 0 and stage.start_step <= cfg.ramp[i - 1].start_step:
            _fail(cfg, i, stage, f"start_step must increase: the previous stage starts at "
                                 f"{cfg.ramp[i - 1].start_step}.")
        if stage.start_step >= steps:
            _fail(cfg, i, stage, f"starts at or after the last step (training.steps = {steps}); raise training.steps "
                                 f"or remove the stage.")
        if stage.seq_len < 2:
            _fail(cfg, i, stage, f"seq_len must be >= 2, got {stage.seq_len}.")
        cp = stage.cp or p.cp
        if tradeable % cp:
            options = [d for d in range(1, tradeable + 1) if tradeable % d == 0]
            _fail(cfg, i, stage, f"cp {cp} cannot be traded against dp_shard: dp_shard x cp = {tradeable} ranks on "
                                 f"{world_size} launched. Use a cp in {options}.")
        s = copy.deepcopy(previous)
        s.ramp = []
        s.training.seq_len = stage.seq_len
        s.parallelism.cp, s.parallelism.dp_shard = cp, tradeable // cp
        if stage.rope_theta:
            s.model.rope_theta = stage.rope_theta
        if stage.rope_scaling_factor:
            s.model.rope_scaling_factor = stage.rope_scaling_factor
        if stage.local_batch_size:
            s.training.local_batch_size = stage.local_batch_size
        if stage.source_weights:
            _apply_source_weights(cfg, i, stage, s)
        dp = base.dp_replicate * s.parallelism.dp_shard
        if cfg.training.tokens_per_step:
            s.training.global_batch_size, s.training.local_batch_size = _batch_for(cfg, i, stage, stage.seq_len, dp)
        end = cfg.ramp[i + 1].start_step if i + 1 < len(cfg.ramp) else steps
        stages.append(Stage(i, stage.start_step, end, s, tokens_per_step(s, dp)))
        previous = s
    return stages


def _apply_source_weights(cfg, i: int, stage: RampStage, stage_cfg) -> None:
    """A stage's source_weights replace the named sources' weights from that stage on."""
    sources = {source.name: source for source in stage_cfg.data.sources}
    for name, weight in stage.source_weights.items():
        if name not in sources:
            _fail(cfg, i, stage, f"source_weights names '{name}', which is not one of the [[data.sources]] "
                                 f"({', '.join(sources) or 'none: set [[data.sources]] first'}).")
        if weight < 0:
            _fail(cfg, i, stage, f"source_weights.{name} = {weight}; weights must be >= 0.")
        sources[name].weight = weight
    if not sum(source.weight for source in sources.values()) > 0:
        _fail(cfg, i, stage, "source_weights leave every source at weight 0; give one a positive weight.")


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that trains optimizer step `step` (0-based: the number of steps already completed)."""
    return [s for s in stages if s.start_step <= step][-1]


def tokens_seen(stages: list[Stage], steps_done: int) -> int:
    """Global tokens trained on after `steps_done` optimizer steps (derived from the plan, so exact after a resume)."""
    return sum(max(0, min(steps_done, s.end_step) - s.start_step) * s.tokens_per_step for s in stages)


def source_tokens_seen(stages: list[Stage], steps_done: int) -> dict[str, int]:
    """Global tokens trained on per data source after `steps_done` steps (each stage's mixture from its own row 0)."""
    from data.sources import rows_per_source

    seen: dict[str, int] = {}
    for s in stages:
        steps = max(0, min(steps_done, s.end_step) - s.start_step)
        rows_per_step = s.tokens_per_step // s.cfg.training.seq_len
        for name, rows in rows_per_source(s.cfg, 0, steps * rows_per_step).items():
            seen[name] = seen.get(name, 0) + rows * s.cfg.training.seq_len
    return seen
