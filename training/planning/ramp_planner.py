"""`--plan-ramp`: from a base recipe, a GPU count and a target length to a context ramp whose every stage fits.

Per stage (lengths: ramp_lengths.py, RoPE: rope_rule.py) the planner picks the layout with the best predicted step
time among those that fit, preferring the base's TP and no activation offload (`auto` turns it on only in the stages
that fit nothing without it), and trading CP against dp_shard on the same GPUs. Memory is the dry run's probe
(memory_probe.py), but not once per candidate: for a fixed model, GPU count, TP and offload setting the peak is
linear in the tokens a rank holds per micro-step, so two probes fix a line per setting (`MemoryLine`). The line
proposes; the dry run's full measurement of the chosen layout decides, host memory included. Step times and GPU-hours
are the dry run's calibrated prediction (price.py).
"""
from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from config import RecipeError
from config.schema import Config, RampTable
from models.llama import recipe_model_config
from parallelisms.sublayer_groups import refusal as sublayer_groups_refusal
from training.planning.dry_run import RUNTIME_RESERVE_GIB, PlanRow, RowResult, measure_row, node_host_gib, stage_times
from training.planning.memory_probe import GIB, RankMemory, measure_memory, with_section
from training.launch_checks.preflight import preflight_stages
from training.planning.ramp_lengths import PlanRequest, stage_lengths, stage_steps, tokens_per_step_for
from training.planning.rope_rule import stage_rope_theta

PROBE_TOKENS = (16384, 65536)
"""Tokens per rank per micro-step of the two probes that fix a memory line (the planning table's points), or an
eighth and a half of the target length when that is shorter."""


@dataclass
class MemoryLine:
    """One rank's measured GiB on a fixed model, GPU count, TP and offload setting, as a function of the tokens T it
    holds per micro-step: forward/backward peak `fixed + slope * T` (+ the sharded gradients when micro-steps
    accumulate, as the dry run measures them), optimizer-step peak `optimizer` (no T in it), host `host_slope * T`."""
    fixed: float
    slope: float
    optimizer: float
    grads: float
    host_slope: float
    state: float
    """Parameters, gradients and AdamW state of the rank (FSDP-sharded: ~1/GPUs)."""

    def peak(self, tokens: float, accumulating: bool) -> float:
        return max(self.fixed + self.slope * tokens + (self.grads if accumulating else 0.0), self.optimizer)

    @classmethod
    def through(cls, small: RankMemory, large: RankMemory, t_small: int, t_large: int,
                cpu_offload: bool = False) -> "MemoryLine":
        """With `cpu_offload` the state is on the host (the probe's fake tensors count it): off the device line,
        and the optimizer step runs there."""
        slope = (large.peak_forward_backward - small.peak_forward_backward) / GIB / (t_large - t_small)
        on_host = large.state / GIB if cpu_offload else 0.0
        return cls(fixed=small.peak_forward_backward / GIB - slope * t_small - on_host, slope=slope,
                   optimizer=0.0 if cpu_offload else max(small.peak_optimizer_step, large.peak_optimizer_step) / GIB,
                   grads=0.0 if cpu_offload else large.grads / GIB, host_slope=large.host / GIB / t_large,
                   state=large.state / GIB)


@dataclass
class Candidate:
    """One layout of one stage: its resolved Config, the line's peak and the predicted step time."""
    cfg: Config
    cp: int
    tp: int
    offload: bool
    predicted_gib: float
    estimated_step_s: float


@dataclass
class PlannedStage:
    seq_len: int
    rope_theta: float
    start_step: int
    steps: int
    chosen: Candidate
    measured: RowResult
    """The dry run's own measurement of the chosen layout (peak, host, roofline times with the measured ring)."""
    rejected: list[str] = field(default_factory=list)
    """Why each smaller CP (or, with offload on, each layout without it) was not taken, one phrase each (for the
    recipe's comments)."""

    @property
    def step_s(self) -> float:
        return self.measured.times["predicted_s"]

    def gpu_hours(self, gpus: int) -> float:
        return self.steps * self.step_s * gpus / 3600


@dataclass
class RampPlan:
    base: Config
    request: PlanRequest
    tokens_per_step: int
    stages: list[PlannedStage]
    usable_gib: float
    note: str = ""
    """What the planner turned on beyond the base recipe and why (printed, and in the recipe's header)."""

    def total_gpu_hours(self) -> float:
        return sum(s.gpu_hours(self.request.gpus) for s in self.stages)

    def total_roofline_gpu_hours(self) -> float:
        return sum(s.steps * s.measured.times["overlap_s"] * self.request.gpus / 3600 for s in self.stages)


class ProbeCache:
    """Memory lines by (tp, offload), each probed once per plan (two dry-run probes)."""

    def __init__(self, base: Config, gpus: int, target_seq_len: int):
        self.base, self.gpus, self.lines = base, gpus, {}
        self.points = tuple(min(t, max(64, target_seq_len // d)) for t, d in zip(PROBE_TOKENS, (8, 2)))

    def line(self, tp: int, offload: bool) -> MemoryLine:
        if (tp, offload) not in self.lines:
            sharded = self.gpus // (tp * self.base.parallelism.dp_replicate)
            cp = 2 if sharded % 2 == 0 else 1  # a ring in the probe, so its blocks are on the line
            points = []
            for tokens in self.points:
                cfg = layout_config(self.base, tp=tp, cp=cp, sharded=sharded, offload=offload)
                cfg.training.seq_len, cfg.training.local_batch_size = tokens * cp, 1
                cfg.training.global_batch_size, cfg.training.tokens_per_step = -1, 0
                points.append(measure_memory(cfg, self.gpus, recipe_model_config(cfg).n_layers))
            self.lines[tp, offload] = MemoryLine.through(*points, *self.points, self.base.training.cpu_offload)
        return self.lines[tp, offload]


def layout_config(base: Config, *, tp: int, cp: int, sharded: int, offload: bool) -> Config:
    """The base recipe on a planned layout: pp 1 (ramps need it), dp_shard x cp = the sharded GPUs, no ramp."""
    cfg = copy.deepcopy(base)
    cfg.ramp = []
    p = cfg.parallelism
    p.pp, p.tp, p.cp, p.dp_shard = 1, tp, cp, sharded // cp
    ac = cfg.activation_checkpoint
    ac.offload = offload
    if offload and ac.mode == "none":
        ac.mode = "full"  # offload moves what checkpointing keeps
    return cfg


@dataclass(frozen=True)
class StageAsk:
    """One stage to lay out: the base recipe on `gpus` at one TP and offload setting, `seq_len` tokens a row at RoPE
    `theta`, `tokens_per_step` a step (what every layout of the stage shares; the CP degree is what varies)."""
    base: Config
    gpus: int
    tp: int
    offload: bool
    seq_len: int
    theta: float
    tokens_per_step: int

    @property
    def sharded(self) -> int:
        """GPUs of one replica's dp_shard x cp."""
        return self.gpus // (self.tp * self.base.parallelism.dp_replicate)


def stage_candidate(ask: StageAsk, cp: int) -> Config:
    """The resolved Config a [[ramp]] stage with these values trains with (the trainer's own resolution and
    checks: RecipeError when the layout cannot take this stage)."""
    cfg = layout_config(ask.base, tp=ask.tp, cp=1, sharded=ask.sharded, offload=ask.offload)
    cfg.training.tokens_per_step, cfg.training.steps = ask.tokens_per_step, 1
    cfg.ramp = [RampTable(start_step=0, seq_len=ask.seq_len, cp=cp, rope_theta=ask.theta)]
    return preflight_stages(cfg, ask.gpus, check_data=False)[0].cfg


def tp_options(base: Config, gpus: int) -> list[int]:
    """The base's TP, then doublings (more TP only when nothing fits without it): within a node, dividing the KV
    heads and the GPUs."""
    m, tp, out, replicas = recipe_model_config(base), base.parallelism.tp, [], base.parallelism.dp_replicate
    while tp <= base.hardware.gpus_per_node and m.num_kv_heads % tp == 0 and gpus % (tp * replicas) == 0:
        out.append(tp)
        tp *= 2
    return out


def candidates(ask: StageAsk, probes: ProbeCache, usable: float, rejected: list[str]) -> list[Candidate]:
    """Every CP (a power of two on the sharded GPUs) whose stage resolves and whose line fits, best first."""
    out = []
    for cp in (2**i for i in range(ask.sharded.bit_length()) if ask.sharded % 2**i == 0):
        try:
            cfg = stage_candidate(ask, cp)
        except RecipeError as e:
            rejected.append(f"cp {cp}: {_short(e)}")
            continue
        t, dp = cfg.training, cfg.parallelism.dp_shard * cfg.parallelism.dp_replicate
        peak = probes.line(ask.tp, ask.offload).peak(t.local_batch_size * t.seq_len / cp, t.grad_accum_steps(dp) > 1)
        if peak > usable:
            rejected.append(f"cp {cp}: {peak:.0f} GiB predicted > {usable:g}")
            continue
        dims = preflight_stages(cfg, ask.gpus, check_data=False)[0].dims
        times = stage_times(cfg, dims, ask.base.hardware.gpus_per_node)
        out.append(Candidate(cfg, cp, ask.tp, ask.offload, peak, times["predicted_s"]))
    return sorted(out, key=lambda c: (c.estimated_step_s, c.cp))


def _short(error: RecipeError) -> str:
    """The reason of a stage check, without the recipe path and stage prefix."""
    text = re.sub(r" \([^)]*\)", "", str(error).split(": ")[-1])
    return text.split("; ")[0].rstrip(".")


def plan_stage(ask: StageAsk, probes: ProbeCache, usable: float,
               rejected: list[str]) -> tuple[Candidate, RowResult] | None:
    """The fastest layout of one stage that the dry run's measurement confirms fits, or None; why each layout it
    passed over did not fit goes to `rejected`."""
    base = ask.base
    for candidate in candidates(ask, probes, usable, rejected):
        result = measure_row(PlanRow(f"{ask.seq_len}", candidate.cfg), ask.gpus, base.hardware.gpus_per_node)
        host = node_host_gib(result, base.hardware.gpus_per_node)
        if base.training.cpu_offload:  # the offloaded state too (training/launch_checks/host_memory.py)
            host = host + result.host.tensors * result.host.ranks / GIB
        if result.peak_gib <= usable and host <= base.hardware.host_memory_gib:
            return candidate, result
        if result.peak_gib > usable:
            rejected.append(f"cp {candidate.cp}: measured {result.peak_gib:.1f} GiB > {usable:g}")
        else:
            rejected.append(f"cp {candidate.cp}: {host:,.0f} GiB host per node > {base.hardware.host_memory_gib:g}")
    return None


def plan_ramp(base: Config, request: PlanRequest, progress: Callable[[str], None] | None = None) -> RampPlan:
    """The plan, or a RecipeError naming the smallest GPU count (or the feature) that would make it fit. Where the
    base fits no plan, the planner turns on what trades speed or host memory for device memory, in this order, each
    kept once turned on: FSDP2's CPU offload of the state, then the frontier's memory cuts (`memory_cuts`). The plan's
    note says what it turned on and why; `progress` gets a line per attempt (a long plan takes minutes)."""
    say = progress or (lambda line: None)
    plan, failing_seq_len, probes = _plan(base, request)
    first_failing, current, turned_on = failing_seq_len, base, []
    if plan is None and offloadable(base):  # the state on the host: FSDP2's CPU offload, for the whole run
        say(f"plan: {failing_seq_len:,} tokens fit no layout; trying training.cpu_offload = true")
        current = with_section(base, "training", cpu_offload=True)
        plan, failing_seq_len, last_probes = _plan(current, request)
        turned_on.append(f"training.cpu_offload = true, chosen by the planner: {first_failing:,} tokens fit no layout "
                         "with the parameters, gradients and AdamW state on the GPUs")
    else:
        last_probes = probes
    # the optimizer step's peak, which no cut below makes smaller (on a line the plan probed already)
    state_alone = last_probes.line(current.parallelism.tp, False).optimizer
    for cut in memory_cuts(current, request):
        if plan is not None or state_alone > current.hardware.device_memory_gib - RUNTIME_RESERVE_GIB:
            break
        say(f"plan: {failing_seq_len:,} tokens fit no layout; trying {cut.setting}")
        current = with_section(current, cut.section, **cut.values)
        turned_on.append(f"{cut.setting}, chosen by the planner: {failing_seq_len:,} tokens fit no layout without it")
        one_stage = dataclasses.replace(request, target_seq_len=failing_seq_len, stages=1, tokens_per_stage=0)
        alone = _plan(current, one_stage)  # the length that failed, alone: cheaper than the whole ramp
        if alone[0] is None:
            continue
        plan, failing_seq_len, _ = alone if one_stage == request else _plan(current, request)
    if plan is None:
        raise RecipeError(what_would_fit(base, request, first_failing, probes))
    plan.note = "; ".join(turned_on)
    return plan


@dataclass(frozen=True)
class MemoryCut:
    section: str
    values: dict
    setting: str
    """How a recipe says it, for the plan's note."""


MEMORY_CUT_TILE_TOKENS = 8192
"""The SwiGLU's and the norms' tile when the planner turns them on (docs/frontier.md: 76.5 -> 58.4 KiB per token of
an 8B block at 8M tokens on 8 GPUs came from 8K tiles and the grouped sublayer together)."""


def memory_cuts(base: Config, request: PlanRequest) -> list[MemoryCut]:
    """The frontier work's memory cuts (docs/frontier.md, bench/bench_frontier.py's rungs) that the base does not
    have and that apply to it, in the order the planner adds them: the feed-forward and norms in 8K-token tiles; the
    attention sublayer in one group per K/V head (on the ring or all-gather, where parallelisms/sublayer_groups.py
    `refusal` allows it); each offloaded block input brought back only when its own recompute starts (one on the
    device instead of two); the last two checkpointed blocks' inputs kept on the device (host memory traded for
    device memory: last, for when the host binds). The two offload ones only where activation offload may run."""
    m, p, ac = recipe_model_config(base), base.parallelism, base.activation_checkpoint
    cuts = []
    if base.model.mlp_chunk_tokens in (0, None) or base.model.mlp_chunk_tokens > MEMORY_CUT_TILE_TOKENS:
        cuts.append(MemoryCut("model", dict(mlp_chunk_tokens=MEMORY_CUT_TILE_TOKENS,
                                            norm_chunk_tokens=MEMORY_CUT_TILE_TOKENS),
                              f"model.mlp_chunk_tokens = norm_chunk_tokens = {MEMORY_CUT_TILE_TOKENS}"))
    groups = m.num_kv_heads
    if (p.attention_sublayer_groups <= 1 < groups and p.cp_impl in ("ring", "allgather")
            and not sublayer_groups_refusal(with_section(base, "parallelism", attention_sublayer_groups=groups),
                                            m.n_heads, groups, m.qkv_bias or m.qk_norm)):
        cuts.append(MemoryCut("parallelism", dict(attention_sublayer_groups=groups),
                              f"parallelism.attention_sublayer_groups = {groups}"))
    if request.offload != "off" or ac.offload:
        if ac.offload_prefetch:
            cuts.append(MemoryCut("activation_checkpoint", dict(offload_prefetch=False),
                                  "activation_checkpoint.offload_prefetch = false"))
        if ac.offload_keep_last < 2:
            cuts.append(MemoryCut("activation_checkpoint", dict(offload_keep_last=2),
                                  "activation_checkpoint.offload_keep_last = 2"))
    return cuts


def offloadable(base: Config) -> bool:
    """Where the planner may turn FSDP2's CPU offload on (config/recipe.py check_cpu_offload refuses the rest)."""
    t = base.training
    return not t.cpu_offload and t.float8 == "off" and base.parallelism.pp == 1


def _plan(base: Config, request: PlanRequest) -> tuple[RampPlan | None, int, ProbeCache]:
    """(the plan, 0, probes), or (None, the first seq_len that fits no layout on the TP that got farthest, probes):
    a larger TP can fail sooner (the grouped sublayer refuses TP), and the length that binds is the farther one."""
    request.check(base)
    usable = base.hardware.device_memory_gib - RUNTIME_RESERVE_GIB
    lengths = stage_lengths(min(base.training.seq_len, request.target_seq_len), request.target_seq_len,
                            request.stages)
    tokens_per_step = tokens_per_step_for(base, request.gpus, lengths)
    steps = stage_steps(base, request, len(lengths), tokens_per_step)
    probes = ProbeCache(base, request.gpus, request.target_seq_len)
    # Offload is per stage (the trainer switches one offloader on and off, training/trainer.py): `auto` plans each
    # stage without it first and turns it on only when that stage fits nothing otherwise.
    # TP is one degree for the whole ramp: the base's, raised only when nothing fits with it (and offload).
    offloads = {"off": [False], "on": [True], "auto": [False, True]}[request.offload]
    if probes.line(base.parallelism.tp, False).optimizer > usable:  # the sharded state alone: no layout helps
        return None, request.target_seq_len, probes
    farthest = 0  # the first length that fits no layout, on the TP that planned the most stages
    for tp in tp_options(base, request.gpus):
        planned, theta, start = [], recipe_model_config(base).rope_theta, 0
        for seq_len, n in zip(lengths, steps):
            theta = stage_rope_theta(seq_len, theta)
            rejected: list[str] = []
            for offload in offloads:
                ask = StageAsk(base, request.gpus, tp, offload, seq_len, theta, tokens_per_step)
                found = plan_stage(ask, probes, usable, rejected)
                if found is not None:
                    break
                if offload is False and len(offloads) > 1:
                    rejected[:] = [f"without offload {why}" for why in rejected]
            if found is None:
                farthest = max(farthest, seq_len)
                break
            planned.append(PlannedStage(seq_len, theta, start, n, *found, rejected))
            start += n
        else:
            if base.activation_checkpoint.mode == "none" and any(s.chosen.offload for s in planned):
                # one model build has one checkpoint mode, and offload needs one: every stage checkpointed
                return _plan(with_section(base, "activation_checkpoint", mode="full"), request)
            return RampPlan(base, request, tokens_per_step, planned, usable), 0, probes
    return None, farthest, probes


def what_would_fit(base: Config, request: PlanRequest, seq_len: int, probes: ProbeCache) -> str:
    """One line for a stage that fits nothing: the feature that would make it fit on these GPUs, else the smallest
    GPU count, proposed from a memory line (the sharded state scales as 1/GPUs) and confirmed by a measured plan."""
    usable = base.hardware.device_memory_gib - RUNTIME_RESERVE_GIB
    where = f"{base.recipe_path}: --plan-ramp to {seq_len:,} tokens on {request.gpus} GPUs fits no layout"
    one_stage = dict(target_seq_len=seq_len, stages=1, tokens_per_stage=0)
    if request.offload == "off" and _plan(base, dataclasses.replace(request, offload="on", **one_stage))[0]:
        return f"{where}; it fits with activation offload: rerun with --offload auto."
    offload_allowed = request.offload != "off"
    line = probes.line(base.parallelism.tp, offload_allowed)
    sharded = request.gpus // (base.parallelism.tp * base.parallelism.dp_replicate)
    gpus = request.gpus
    for _ in range(10):
        gpus *= 2
        shrink = request.gpus / gpus  # the sharded state (and the optimizer's temporaries) shrink with the GPUs
        tokens = max(seq_len / (sharded * gpus // request.gpus), 1.0)
        if max(line.fixed - line.state * (1 - shrink) + line.slope * tokens, line.optimizer * shrink) > usable:
            continue
        plan = _plan(base, dataclasses.replace(request, gpus=gpus, **one_stage))[0]
        if plan is None:
            continue
        stage = plan.stages[0].chosen
        how = f"cp {stage.cp}, tp {stage.tp}" + (", activation offload" if stage.offload else "")
        return (f"{where} (parameters, gradients and AdamW state alone take {line.state:.3g} GiB of {usable:.3g} per "
                f"GPU); the smallest GPU count that fits is {gpus} ({how}; measured): rerun with --gpus {gpus}.")
    return f"{where}, nor does any up to {gpus} GPUs; shorten --target-seq-len."
