"""What `--plan-ramp` is asked for, and the parts of a ramp that need no measurement: stage lengths, the constant
tokens per step and the steps of each stage.

Stage lengths grow geometrically from the base's seq_len to the target, by at most `MAX_GROWTH` per stage (LWM
doubled to quadrupled, ProLong went 8x from 64K to 512K); intermediate lengths are rounded to powers of two in log
space, so they split into any power-of-two CP layout; the last is the target itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

from config import RecipeError
from config.schema import Config

MAX_GROWTH = 8
"""Default growth of the sequence length from one stage to the next (at most)."""


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    target_seq_len: int
    out: str = ""
    """'' = recipes/<base name without its length suffix>_<length>_<gpus>gpu.toml"""
    offload: str = "auto"
    stages: int = 0
    """0 = as many as growing by at most MAX_GROWTH per stage needs."""
    tokens_per_stage: int = 0
    """Token budget of each stage (sets its steps); 0 = the base's steps split evenly."""

    def check(self, base: Config) -> None:
        where = f"{base.recipe_path}: --plan-ramp"
        if self.gpus < 1 or self.target_seq_len < 2 or self.stages < 0 or self.tokens_per_stage < 0:
            raise RecipeError(f"{where} needs --gpus >= 1 and --target-seq-len >= 2 (and --stages, "
                              f"--tokens-per-stage >= 0), e.g. --gpus 8 --target-seq-len 1048576.")
        if self.offload not in ("auto", "on", "off"):
            raise RecipeError(f"{where}: --offload {self.offload!r} is not one of auto, on, off.")
        if base.parallelism.pp > 1:
            raise RecipeError(f"{where}: the base has parallelism.pp = {base.parallelism.pp}; ramps run with pp = 1 "
                              f"(pipeline stages fix their shapes). Plan from --parallelism.pp 1.")


def parse_plan_args(args: list[str]) -> tuple[PlanRequest, list[str]]:
    """Takes the planner's flags (PlanRequest's fields, `--target-seq-len` for target_seq_len) out of the command
    line; the rest are recipe overrides (--section.key value)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in (f.name for f in dataclasses.fields(PlanRequest)):
        kind = str if name in ("out", "offload") else _whole
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind)
    try:
        known, rest = parser.parse_known_args(args)
    except argparse.ArgumentError as e:
        raise RecipeError(f"command line: {e}.") from None
    if known.gpus is None or known.target_seq_len is None:
        raise RecipeError("command line: --plan-ramp needs --gpus N and --target-seq-len L (e.g. --gpus 8 "
                          "--target-seq-len 1048576).")
    return PlanRequest(**{k: v for k, v in vars(known).items() if v is not None}), rest


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None


def length_name(tokens: int) -> str:
    """1048576 -> '1m', 65536 -> '64k', 1000 -> '1000'."""
    for unit, size in (("m", 2**20), ("k", 2**10)):
        if tokens % size == 0:
            return f"{tokens // size}{unit}"
    return str(tokens)


def default_out(recipe_path: str, request: PlanRequest) -> str:
    """recipes/<base>_<length>_<gpus>gpu.toml, with a length suffix of the base's name (llama3_8b_1m) dropped."""
    stem = os.path.splitext(os.path.basename(recipe_path))[0]
    head, _, tail = stem.rpartition("_")
    if head and tail[:-1].isdigit() and tail[-1] in "km":
        stem = head
    return os.path.join("recipes", f"{stem}_{length_name(request.target_seq_len)}_{request.gpus}gpu.toml")


def stage_lengths(start: int, target: int, stages: int = 0) -> list[int]:
    """From `start` to `target` in `stages` steps of equal ratio (0 = growth <= MAX_GROWTH per stage), the
    intermediate lengths rounded to the nearest power of two in log space (halves up)."""
    ratio = target / start
    if stages == 0:
        stages = 1 + max(0, math.ceil(math.log(ratio, MAX_GROWTH) - 1e-9))
    if stages == 1:
        return [target]
    lengths = [start]
    for i in range(1, stages - 1):
        lengths.append(2 ** math.floor(math.log2(start) + i * math.log2(ratio) / (stages - 1) + 0.5))
    lengths.append(target)
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise RecipeError(f"--stages {stages}: {start:,} -> {target:,} tokens has room for at most "
                          f"{1 + max(1, int(math.log2(ratio)))} stages of power-of-two lengths; use fewer.")
    return lengths


def tokens_per_step_for(base: Config, gpus: int, lengths: list[int]) -> int:
    """The base's training.tokens_per_step, or its global batch in tokens on `gpus` GPUs; raised to a multiple of
    every stage's length (one whole row of the longest at least)."""
    t, p = base.training, base.parallelism
    tokens = t.tokens_per_step
    if not tokens:
        dp = gpus // (p.pp * p.tp * p.cp) if p.dp_shard == -1 else p.dp_replicate * p.dp_shard
        tokens = t.global_batch_rows(max(1, dp)) * t.seq_len
    multiple = math.lcm(*lengths)
    return max(1, math.ceil(tokens / multiple)) * multiple


def stage_steps(base: Config, request: PlanRequest, n_stages: int, tokens_per_step: int) -> list[int]:
    """Steps of each stage: the token budget per stage / tokens per step, or the base's steps split evenly."""
    if request.tokens_per_stage:
        return [max(1, math.ceil(request.tokens_per_stage / tokens_per_step))] * n_stages
    total = base.training.steps
    if total < n_stages:
        raise RecipeError(f"{base.recipe_path}: training.steps = {total} cannot give each of {n_stages} stages a "
                          f"step; raise training.steps or pass --tokens-per-stage.")
    each = total // n_stages
    return [each] * (n_stages - 1) + [total - each * (n_stages - 1)]
