"""`./run_train.sh BASE.toml --plan-ramp --gpus N --target-seq-len L`: plan (ramp_planner.py), print the table, write
the recipe. The written TOML holds the base's values that differ from the defaults (overrides given
on the command line included), the planned [[ramp]] stages and comments that say why each stage is what it is."""
from __future__ import annotations

import dataclasses
import os
import textwrap
import time

from config.recipe import toml_value
from config.rope import RopeSettings
from config.schema import Config, SECTIONS, SourceConfig
from models.llama import recipe_model_config
from training.planning.dry_run import format_table
from training.planning.ramp_lengths import PlanRequest, default_out, length_name
from training.planning.ramp_planner import RampPlan, plan_ramp
from training.planning.workload import parameter_count
from training.planning.price import PREDICTION_STATEMENT
from training.planning.rope_rule import ROPE_RULE_SOURCE, men_lower_bound

COLUMNS = ("stage", "seq_len", "cp", "dp_shard", "tp", "offload", "peak GiB", "host GiB", "step s", "tok/s/GPU",
           "steps", "GPU-h")


def _changed(obj, default) -> list[tuple[str, object]]:
    """The fields of a dataclass that differ from its defaults, in declaration order."""
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if getattr(obj, f.name) != getattr(default, f.name)]


def recipe_config(plan: RampPlan, out: str) -> Config:
    """The base with the plan's recipe-wide values: the first stage's layout, tokens per step, steps, offload."""
    cfg = dataclasses.replace(plan.base)
    first, last = plan.stages[0], plan.stages[-1]
    stem = os.path.splitext(os.path.basename(out))[0]
    lengths = " -> ".join(length_name(s.seq_len).upper() for s in plan.stages)
    cfg.job = dataclasses.replace(cfg.job, dump_folder=f"outputs/{stem}",
                                  description=f"{cfg.model.name} context ramp {lengths} on {plan.request.gpus} GPUs "
                                              f"(planned by --plan-ramp)")
    cfg.training = dataclasses.replace(cfg.training, seq_len=first.seq_len, tokens_per_step=plan.tokens_per_step,
                                       steps=last.start_step + last.steps, global_batch_size=-1)
    p = first.chosen.cfg.parallelism
    cfg.parallelism = dataclasses.replace(cfg.parallelism, pp=1, tp=p.tp, cp=p.cp, dp_shard=p.dp_shard)
    cfg.activation_checkpoint = dataclasses.replace(cfg.activation_checkpoint,
                                                    mode=first.chosen.cfg.activation_checkpoint.mode,
                                                    offload=first.chosen.offload)
    return cfg


def _header(plan: RampPlan, out: str, base_path: str, argv_tail: str) -> list[str]:
    base, req = plan.base, plan.request
    m = recipe_model_config(base)
    nodes = -(-req.gpus // base.hardware.gpus_per_node)
    return _comment(
        f"{base.model.name} ({parameter_count(m) / 1e9:.2f}B parameters) grown to {req.target_seq_len:,} tokens on "
        f"{req.gpus} GPUs ({nodes} node(s) x {min(req.gpus, base.hardware.gpus_per_node)}, "
        f"{base.hardware.device_memory_gib:g} GiB each), in {len(plan.stages)} [[ramp]] stages.") + [
        f"# Written by: ./run_train.sh {base_path} --plan-ramp{argv_tail}",
        f"#   plan check, here (no GPU):  ./run_train.sh {out} --dry-run",
        "#",
    ] + _comment(
        "Each stage takes the layout with the best predicted step time among those that fit: CP as small as fits "
        "(dp_shard the rest of the GPUs), the base's TP, activation offload only when nothing fits without it. "
        "Peaks are measured by the dry run's probe (the trainer's step on a fake process group), step times are "
        "its calibrated prediction:") + _comment(f"{PREDICTION_STATEMENT}.", "#   ") + _comment(
        f"tokens_per_step = {plan.tokens_per_step:,} in every stage (the optimizer sees the same step); "
        f"{plan.usable_gib:g} GiB usable per GPU. {ROPE_RULE_SOURCE}. Total: {plan.total_gpu_hours():,.0f} "
        f"GPU-hours (predicted; the roofline bound would say {plan.total_roofline_gpu_hours():,.0f}).") + (
        _comment(f"{plan.note}.") if plan.note else [])


def _comment(text: str, prefix: str = "# ") -> list[str]:
    return textwrap.wrap(text, 118, initial_indent=prefix, subsequent_indent=prefix)


def _stage_comment(plan: RampPlan, index: int) -> list[str]:
    s = plan.stages[index]
    c, t = s.chosen.cfg, s.measured.times
    rows = plan.tokens_per_step // s.seq_len
    why = "; ".join(s.rejected) if s.rejected else "the smallest CP"
    offload = "on (nothing fits without it)" if s.chosen.offload else "off"
    return _comment(
        f"stage {index}: {s.seq_len:,} tokens, {rows} row(s) per step; cp {s.chosen.cp} x dp_shard "
        f"{c.parallelism.dp_shard} (tp {s.chosen.tp}), offload {offload}: peak "
        f"{s.measured.peak_gib:.1f} GiB device, {s.measured.host_gib:.1f} GiB host, of {plan.usable_gib:g} usable. "
        f"Predicted {s.step_s:.2f} s/step ({t['predicted_band'][0]:.2f}..{t['predicted_band'][1]:.2f}), "
        f"{t['predicted_tokens_per_gpu_s']:,.0f} tok/s/GPU; {s.steps} steps = "
        f"{s.gpu_hours(plan.request.gpus):,.1f} GPU-hours. Not a smaller CP: {why}. rope_theta {s.rope_theta:.3g} "
        f">= Men et al. bound {men_lower_bound(s.seq_len):.3g} at this length.")


def render_recipe(plan: RampPlan, out: str, base_path: str, argv_tail: str = "") -> str:
    cfg = recipe_config(plan, out)
    defaults = Config()
    lines = _header(plan, out, base_path, argv_tail)
    for section in SECTIONS:
        values = _changed(getattr(cfg, section), getattr(defaults, section))
        sources = getattr(cfg, section).sources if section == "data" else []
        values = [(k, v) for k, v in values if k != "sources" or section != "data"]
        if not values and not sources:
            continue
        lines += ["", f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in values]
        for source in sources:
            lines += ["", "[[data.sources]]"] + [f"{k} = {toml_value(v)}" for k, v in _changed(source, SourceConfig())]
    for i, stage in enumerate(plan.stages):
        rope = RopeSettings(theta=stage.rope_theta).recipe_fields()  # the [[ramp]] keys of the planned RoPE
        lines += [""] + _stage_comment(plan, i) + ["[[ramp]]", f"start_step = {stage.start_step}",
                                                    f"seq_len = {stage.seq_len}", f"cp = {stage.chosen.cp}",
                                                    *(f"{k} = {v!r}" for k, v in rope.items())]
        if i and stage.chosen.offload != plan.stages[i - 1].chosen.offload:  # absent = the previous stage's
            lines.append(f"offload = {toml_value(stage.chosen.offload)}")
    return "\n".join(lines) + "\n"


def format_plan_table(plan: RampPlan) -> str:
    return format_table([[str(i), f"{s.seq_len:,}", str(s.chosen.cp), str(s.chosen.cfg.parallelism.dp_shard),
                          str(s.chosen.tp), "on" if s.chosen.offload else "off", f"{s.measured.peak_gib:.1f}",
                          f"{s.measured.host_gib:.1f}", f"{s.step_s:.2f}",
                          f"{s.measured.times['predicted_tokens_per_gpu_s']:,.0f}", str(s.steps),
                          f"{s.gpu_hours(plan.request.gpus):,.1f}"] for i, s in enumerate(plan.stages)], COLUMNS)


def run_plan_ramp(cfg: Config, request: PlanRequest, argv_tail: str = "") -> int:
    """Plans, prints the table and writes the recipe; a target that fits nothing raises a one-line RecipeError."""
    start = time.perf_counter()
    out = request.out or default_out(cfg.recipe_path, request)
    plan = plan_ramp(cfg, request, progress=lambda line: print(line, flush=True))
    text = render_recipe(plan, out, cfg.recipe_path, argv_tail)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"ramp plan for {cfg.model.name} to {request.target_seq_len:,} tokens on {request.gpus} GPUs "
          f"(tokens_per_step {plan.tokens_per_step:,}, {plan.usable_gib:g} GiB usable per GPU; peaks measured by the "
          f"dry run's probe, step times its calibrated prediction):")
    print(format_plan_table(plan))
    if plan.note:
        print(plan.note)
    print(f"total: {plan.total_gpu_hours():,.1f} GPU-hours; wrote {out}; planning took "
          f"{time.perf_counter() - start:.0f}s")
    return 0
