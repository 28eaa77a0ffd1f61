"""`./run_train.sh RECIPE --dry-run`: does the plan fit, and how fast would it go, before anyone spends a GPU-day.

One process, no GPU. For every training stage: one rank's memory measured in the fake world (memory_probe.py) against
the device's, a step time priced over the stage's Workload (workload.py; price.py, and the roofline bound), the CUDA
path's counts (cuda_path_table.py) and the host plan. Names the first stage that does not fit and what to change,
checked with one more measurement. Exit code 0 when every stage fits, 1 otherwise.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from config import RecipeError
from config.schema import Config
from models.llama import recipe_model_config
from parallelisms.host_arena import stage_pinned_bytes
from parallelisms.cp.layouts import sequence_divisor
from training.launch_checks.eval_config import stage_eval_config
from training.planning.eval_memory import eval_refusal
from training.planning.cuda_path_table import cuda_json, print_cuda_path
from training.planning.memory_probe import GIB, RankMemory, measure_memory, with_section
from training.launch_checks.preflight import preflight
from training.planning.rates import load_rates, rates_source, rates_warnings
from training.ramp import resolve_stages
from training.checkpoint_disk import check_checkpoint_disk, disk_summary, preemption_lead
from training.planning.roofline import ROOFLINE_STATEMENT, roofline
from training.planning.float8_cost import float8_problem, float8_statement
from training.planning.offload_cost import offload_step_s
from training.launch_checks.host_memory import (HostPlan, host_plan, host_refusal, launch_device_type, node_limit,
                                           resident_bytes)
from training.planning.accelerators import accelerator_for
from training.planning.price import PREDICTION_STATEMENT, predict_step
from training.planning.workload import document_lengths, parameter_count, stage_documents_kernel, workload_for

RUNTIME_RESERVE_GIB = 2.0
"""Device memory that tensors cannot use: the CUDA context (~0.5 GiB) and NCCL communicator buffers (~1 GiB)."""


@dataclass
class PlanRow:
    """One row of the dry run's table: a complete Config to measure (a ramp stage, or a candidate fix of one)."""
    name: str
    cfg: Config


def plan_rows(cfg: Config, world: int) -> list[PlanRow]:
    """One row per ramp stage (its own seq_len, cp, rope, batch, and the evaluations it runs), or the recipe itself
    without [[ramp]]."""
    stages = resolve_stages(cfg, world)
    return [PlanRow(s.name, stage_eval_config(s, last=s is stages[-1])) for s in stages]


@dataclass
class RowResult:
    row: PlanRow
    world: int
    dims: object
    memory: RankMemory
    times: dict
    host: HostPlan | None = None
    """The stage's host memory per rank and node (training/launch_checks/host_memory.py)."""
    cuda: dict = dataclasses.field(default_factory=dict)
    """The CUDA path on fake CUDA tensors (cuda_path_table.py): launches, syncs, attention transients."""

    @property
    def peak_gib(self) -> float:
        """Device memory: offloaded block inputs are not in it (they are `host_gib`), nor, with cpu_offload on a GPU,
        the training state (`device_peak`)."""
        return device_peak(self.row.cfg, self.memory) / GIB

    @property
    def host_gib(self) -> float:
        return self.memory.host / GIB


def device_peak(cfg: Config, memory: RankMemory) -> float:
    """A GPU rank's device bytes. With `training.cpu_offload` the parameter shards, gradients and AdamW state are on
    the host; the device holds, beyond the measured transients, one block's shards on their way in and its reduced
    gradients on their way out (FSDP2 copies them per block; on the probe's CPU tensors those copies are no-ops)."""
    if not cfg.training.cpu_offload:
        return memory.peak
    per_block = memory.params / max(1, recipe_model_config(cfg).n_layers)
    return max(memory.peak - memory.state, 0.0) + 2 * per_block


def measure_row(row: PlanRow, world: int, gpus_per_node: int, process_bytes: float = 0.0) -> RowResult:
    """`process_bytes`: one rank's interpreter with the trainer imported (host_memory.resident_bytes)."""
    cfg = row.cfg
    dims = preflight(cfg, world)  # no data check: the data lives where the recipe will run
    if dims.pp > 1:  # a schedule's stages exchange tensor shapes at run time, which a fake process group cannot answer
        raise RecipeError(f"{cfg.recipe_path}: the dry run measures plans with parallelism.pp = 1 only; check this "
                          f"one with --parallelism.pp 1 and dp_shard x {dims.pp} (the same GPUs) as an approximation.")
    problem = float8_problem(cfg.training.float8, cfg.hardware.accelerator, accelerator_for(cfg.hardware).fp8_flops)
    if problem:
        raise RecipeError(f"{cfg.recipe_path}: {problem}.")
    # pp = 1: every rank holds the same shapes, rank 0 the largest of FSDP's uneven shards
    memory = measure_memory(cfg, world, recipe_model_config(cfg).n_layers)
    times = stage_times(cfg, dims, gpus_per_node, memory.cp_ring_bytes, memory.host, memory.bandwidth_bytes)
    host = host_plan(cfg, memory, world, launch_device_type(cfg), process_bytes)
    return RowResult(row, world, dims, memory, times, host)


def stage_times(cfg: Config, dims, gpus_per_node: int, cp_ring_bytes: float | None = None,
                offload_bytes: float = 0.0, bandwidth_bytes: float | None = None) -> dict:
    """One stage's step times over one Workload and AcceleratorSpec: the roofline bound (roofline.py: `overlap_s`,
    `serial_s`, MFU, `comm_gib`) and the calibrated prediction (price.py: `predicted_s`, `predicted_band`,
    `predicted_tokens_per_gpu_s`, `predicted_parts`), which the ramp planner ranks candidate layouts by."""
    workload = workload_for(cfg, dims, gpus_per_node, cp_ring_bytes, offload_bytes, bandwidth_bytes)
    spec, rates = accelerator_for(cfg.hardware), load_rates(cfg.hardware.accelerator)
    times = roofline(workload, spec)
    times["comm_gib"] = times.pop("comm_bytes") / GIB
    prediction = predict_step(workload, spec, rates)
    step_s, band, parts = prediction.step_s, list(prediction.band), dict(prediction.parts)
    if cfg.training.cpu_offload:  # the host's AdamW and the per-block copies (training/planning/offload_cost.py)
        shard = 4 * parameter_count(workload.model) / (dims.dp_shard * dims.cp * dims.tp * dims.pp)
        host = offload_step_s(shard, workload.grad_accum, min(dims.world_size, gpus_per_node),
                              cfg.hardware.accelerator, spec.pcie_bytes_per_s, spec.pcie_fraction,
                              rates and rates.host_optimizer, rates and rates.host_copy)
        moved = parts.pop("optimizer", 0.0)  # AdamW runs on the host, not on the device
        step_s, band = step_s - moved, [band[0] - moved, band[1] - moved]
        for name, (fast, slow) in host.items():
            parts[name] = (fast + slow) / 2
            step_s, band = step_s + parts[name], [band[0] + fast, band[1] + slow]
    times.update(predicted_s=step_s, predicted_band=band,
                 predicted_tokens_per_gpu_s=prediction.tokens_per_sec_per_gpu * prediction.step_s / step_s,
                 predicted_parts=parts,
                 rates_source=rates_source(rates, workload.attention_kernel, workload.float8 != "off"))
    return times


def documents_statement(cfg: Config) -> str:
    """Which kernel packed documents are priced on, and on which documents."""
    kernel = stage_documents_kernel(cfg)
    needs = (" (needs nvidia-cudnn-frontend on the nodes, requirements-gpu.txt; without it FlashAttention-2 varlen "
             "runs)" if kernel == "cudnn_thd" else "")
    lengths = "the recipe's own documents" if document_lengths(cfg) is not None else "the stated mix (workload.py)"
    return (f"documents: at CP 1 one packed call per layer on {kernel}{needs}, priced piece by piece on {lengths} "
            f"(training/planning/documents_cost.py); under CP the ring's blocks on their visible pairs; memory "
            f"measured as plain causal attention (an upper bound: masked blocks skip)")


def propose_fix(result: RowResult, usable_gib: float) -> tuple[str, Config | None]:
    """What to change in a stage that does not fit: (advice, a config to check it with, if any)."""
    cfg, dims, mem = result.row.cfg, result.dims, result.memory
    state_gib, act_gib = mem.state / GIB, mem.activations / GIB
    if cfg.activation_checkpoint.mode != "full":
        return ("set activation_checkpoint.mode = \"full\" (each block keeps only its input)",
                with_section(cfg, "activation_checkpoint", mode="full"))
    if state_gib >= usable_gib and not cfg.training.cpu_offload and dims.pp == 1 and cfg.training.float8 == "off":
        return (f"parameters, gradients and AdamW state take {state_gib:.1f} GiB per GPU: keep them in host memory "
                f"with training.cpu_offload = true (FSDP2's CPU offload; the step then pays the host's AdamW and "
                f"the per-block copies), or shard them over more GPUs", with_section(cfg, "training", cpu_offload=True))
    if state_gib >= usable_gib:
        need = math.ceil(dims.dp_shard * dims.cp * state_gib / (0.5 * usable_gib))
        return (f"parameters, gradients and optimizer state alone take {state_gib:.1f} GiB: shard them over more "
                f"GPUs (FSDP over dp_shard x cp = {need} or more ranks, i.e. more nodes)", None)
    # Activations scale as 1/cp (each rank holds seq_len / cp tokens): trade dp_shard for cp, keeping the GPUs.
    room = usable_gib - state_gib
    factor = 2
    while act_gib / factor > room and factor < 1024:
        factor *= 2
    new_cp = dims.cp * factor
    multiple = sequence_divisor(new_cp, cfg.parallelism.cp_load_balancer)
    if dims.dp_shard % factor == 0 and cfg.training.seq_len % multiple == 0:
        return (f"raise parallelism.cp from {dims.cp} to {new_cp} and lower dp_shard from {dims.dp_shard} to "
                f"{dims.dp_shard // factor} (same {result.world} GPUs; activations ~1/cp)",
                with_section(cfg, "parallelism", cp=new_cp, dp_shard=dims.dp_shard // factor))
    gpus = result.world * factor // math.gcd(factor, dims.dp_shard)
    offload = "" if cfg.activation_checkpoint.offload else ", or set activation_checkpoint.offload = true"
    return (f"raise parallelism.cp from {dims.cp} to {new_cp} (activations ~1/cp): that takes about {gpus} GPUs, "
            f"or shorten training.seq_len by {factor}x{offload}", None)


def _header(cfg: Config, world: int, first: RowResult) -> list[str]:
    hw, memory, mcfg = cfg.hardware, first.memory, recipe_model_config(cfg)
    n_layers = mcfg.n_layers
    nodes = math.ceil(world / hw.gpus_per_node)
    usable = hw.device_memory_gib - RUNTIME_RESERVE_GIB
    depth = (f"blocks {memory.blocks_measured[0]} and {memory.blocks_measured[1]} measured, extrapolated linearly to "
             f"{n_layers}" if len(memory.blocks_measured) == 2 else f"all {n_layers} blocks")
    count = parameter_count(mcfg)
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    lines = [f"dry run of {cfg.recipe_path}: {cfg.model.name} ({size} parameters), "
             f"{world} GPUs = {nodes} node(s) x {min(world, hw.gpus_per_node)}, {cfg.training.dtype}, "
             f"activation checkpointing {cfg.activation_checkpoint.mode}"]
    if cfg.job.description:
        lines.append(f"  recipe: {cfg.job.description}")
    lines += [
        f"  memory: measured, not estimated: rank 0 of a fake process group of "
        f"{world} ranks, real model and composer on fake tensors, one optimizer step under torch's FSDPMemTracker; "
        f"{depth}",
        f"  device: {hw.device_memory_gib:g} GiB per GPU minus {RUNTIME_RESERVE_GIB:g} GiB for the CUDA context and "
        f"NCCL buffers = {usable:g} GiB for tensors (hardware.device_memory_gib)",
        f"  accelerator: {cfg.hardware.accelerator} (hardware.accelerator); host memory "
        f"{cfg.hardware.host_memory_gib:g} GiB per node (hardware.host_memory_gib)",
        f"  {PREDICTION_STATEMENT}",
        f"  rates: {first.times['rates_source']}",
        *[f"  {line}" for line in rates_warnings(load_rates(cfg.hardware.accelerator), cfg.hardware.accelerator,
                                                 torch.__version__)],
        f"  {ROOFLINE_STATEMENT}",
    ]
    if cfg.data.document_masking:
        lines.append(f"  {documents_statement(cfg)}")
    if cfg.activation_checkpoint.offload:
        back = ("the next block's brought back under the current one's recompute (two on the device)"
                if cfg.activation_checkpoint.offload_prefetch else
                "each brought back when its own recompute starts, the copy waited for (one on the device; "
                "activation_checkpoint.offload_prefetch = false)")
        kept = cfg.activation_checkpoint.offload_keep_last
        if kept:
            back += (f"; the last {kept} block(s)' inputs stay on the device (activation_checkpoint."
                     f"offload_keep_last, in the device peak)")
        lines.append("  activation offload: each checkpointed block's input waits in host memory between forward and "
                     f"backward (host GiB, not in the device peak), copied over PCIe on a side stream; {back}")
    if cfg.parallelism.attention_sublayer_groups > 1:
        lines.append(f"  attention sublayer in {cfg.parallelism.attention_sublayer_groups} K/V head groups under CP "
                     "(projections, RoPE and attention per group; the backward projects q/k/v again: "
                     "parallelisms/sublayer_groups.py)")
    if cfg.training.cpu_offload:
        lines.append("  cpu offload: parameters, gradients and AdamW state in pinned host memory (the device peak "
                     "holds one block's shards in and its gradients out); the step adds the host's AdamW and 3 x the "
                     "shards over PCIe per micro-step, unoverlapped (planning/offload_cost.py; an upper bound)")
    if cfg.training.float8 != "off":
        lines.append(f"  {float8_statement(cfg.training.float8, mcfg, cfg.model.mlp_chunk_tokens > 0)}")
    return lines


COLUMNS = ("stage", "seq_len", "cp", "dp_shard", "tp", "pp", "params", "grads", "optim", "activ", "peak GiB",
           "eval GiB", "host GiB", "fits", "predicted s (band)", "pred tok/s/GPU", "roofline s overlap..serial", "MFU",
           "roofline tok/s/GPU", "comm GiB")


def _gib(nbytes: float) -> str:
    value = nbytes / GIB
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _row(result: RowResult, index: int, usable_gib: float) -> list[str]:
    d, m, t = result.dims, result.memory, result.times
    return [f"{index} {result.row.name}", f"{result.row.cfg.training.seq_len:,}", str(d.cp), str(d.dp_shard),
            str(d.tp), str(d.pp), _gib(m.params), _gib(m.grads), _gib(m.optimizer), _gib(m.activations),
            _gib(result.peak_gib * GIB), _gib(m.peak_eval), _gib(m.host),
            "yes" if result.peak_gib <= usable_gib else "NO",
            f"{t['predicted_s']:.2f} ({t['predicted_band'][0]:.2f}..{t['predicted_band'][1]:.2f})",
            f"{t['predicted_tokens_per_gpu_s']:,.0f}", f"{t['overlap_s']:.2f}..{t['serial_s']:.2f}",
            f"{100 * t['mfu_overlap']:.0f}%..{100 * t['mfu_serial']:.0f}%", f"{t['tokens_per_gpu_s']:,.0f}",
            f"{t['comm_gib']:.0f}"]


def format_table(rows: list, columns: tuple = COLUMNS) -> str:
    """`rows` of cells under `columns`, each column as wide as its widest cell (the dry run's and the planner's)."""
    table = [list(columns)] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table)


def write_json(cfg: Config, results: list[RowResult], usable_gib: float) -> str:
    """<dump_folder>/dry_run.json: one entry per stage, for planners and scripts (the table is for people)."""
    stages = [{"name": r.row.name, "seq_len": r.row.cfg.training.seq_len, "cp": r.dims.cp,
               "peak_device_gib_per_rank": r.peak_gib, "host_gib_per_rank": r.host_gib,
               "eval_peak_device_gib_per_rank": r.memory.peak_eval / GIB,
               "host_pinned_gib_per_rank": stage_pinned_bytes(r.memory.host) / GIB,  # parallelisms/host_arena.py
               "fits": r.peak_gib <= usable_gib, "world": r.world, "dp_shard": r.dims.dp_shard, "tp": r.dims.tp,
               "pp": r.dims.pp, "ac_mode": r.row.cfg.activation_checkpoint.mode,
               "offload": r.row.cfg.activation_checkpoint.offload, "peak_phase": r.memory.peak_phase,
               "usable_device_gib": usable_gib, "predicted_step_s": r.times["predicted_s"],
               "predicted_step_s_band": r.times["predicted_band"],
               "predicted_tokens_per_sec_per_gpu": r.times["predicted_tokens_per_gpu_s"],
               "roofline_step_s": r.times["overlap_s"], "accelerator": cfg.hardware.accelerator,
               "rates_source": r.times["rates_source"], "float8": r.row.cfg.training.float8,
               "predicted_parts_s": r.times["predicted_parts"],
               "host_gib_per_node": node_host_gib(r, cfg.hardware.gpus_per_node),
               "host_memory_gib_per_node": cfg.hardware.host_memory_gib,
               "host_peak_gib_per_rank": r.host.per_rank / GIB, "host_peak_gib_per_node": r.host.per_node / GIB,
               "cpu_offload": r.row.cfg.training.cpu_offload, **cuda_json(r.cuda, r.peak_gib)}
              for r in results]
    path = os.path.join(cfg.job.dump_folder, "dry_run.json")
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"stages": stages}, f, indent=1)
    return path


def node_host_gib(result: RowResult, gpus_per_node: int) -> float:
    """Pinned host memory one node holds for activation offload: every GPU of the node offloads the same bytes."""
    return result.host_gib * min(result.world, gpus_per_node)


def print_host_plan(cfg: Config, results: list[RowResult]) -> str | None:
    """One line per stage (its host bytes per node against the node's); the first stage over it refused, or None."""
    device_type = launch_device_type(cfg)
    limit, source = node_limit(cfg, device_type)
    print(f"  host memory ({device_type} run; training/launch_checks/host_memory.py), of {limit / GIB:,.1f} GiB per "
          f"node ({source}):")
    for index, r in enumerate(results):
        print(f"    stage {index + 1} ({r.row.name}): {r.host.describe()}"
              f"{'' if r.host.per_node <= limit else '  DOES NOT FIT'}")
    over = next((r for r in results if r.host.per_node > limit), None)
    return over and host_refusal(over.row.cfg, over.row.name, over.row.cfg.training.seq_len, over.host, limit, source,
                                 device_type)


def print_checkpoint_plan(cfg: Config, world: int, step_s: float) -> None:
    """The checkpoint folder's disk, and the lead a SIGUSR1 ahead of the time limit needs."""
    model, nodes = recipe_model_config(cfg), max(1, world // cfg.hardware.gpus_per_node)
    try:  # the dry run may run far from the cluster's disk: what the launch check would refuse is a warning
        fits = check_checkpoint_disk(cfg, model, world, nodes)
    except RecipeError as e:
        fits = f"warning: {e}"
    for line in (disk_summary(cfg, model, world, nodes), fits, preemption_lead(step_s, model, world, nodes)):
        if line:
            print(line)


def run_dry_run(cfg: Config, world: int) -> int:
    start = time.perf_counter()
    process = resident_bytes()  # before any probe: a rank's interpreter with the trainer imported
    usable = cfg.hardware.device_memory_gib - RUNTIME_RESERVE_GIB
    results = []
    for index, row in enumerate(plan_rows(cfg, world)):
        try:
            results.append(measure_row(row, world, cfg.hardware.gpus_per_node, process))
        except RecipeError:
            raise
        except Exception as e:  # the real step failed: that is what a dry run is for
            first_line = (str(e).strip().splitlines() or [""])[0]
            print(f"stage {index + 1} ({row.name}, seq_len {row.cfg.training.seq_len:,}): the training step fails "
                  f"under the dry run, so it would fail on the GPUs too: {type(e).__name__}: {first_line}")
            return 1
    print("\n".join(_header(cfg, world, results[0])))
    print("  columns: GiB per rank (params/grads/optim = persistent state; activ = the rest of the peak: saved and "
          "recomputed activations, logits and loss, gathered parameters, comm buffers; peak = device memory, the "
          "larger of the training step and the stage's evaluations (eval = the evaluations' own peak, 0 where the "
          "stage runs none); host = offloaded block inputs in host memory); comm = bytes sent per step")
    print(format_table([_row(r, i + 1, usable) for i, r in enumerate(results)]))
    print_cuda_path(cfg, results, usable)
    if cfg.checkpoint.enable:
        print_checkpoint_plan(cfg, world, max(r.times["predicted_s"] for r in results))
    print(f"wrote {write_json(cfg, results, usable)}")
    refusal = print_host_plan(cfg, results)  # offloaded activations included
    if refusal is not None:
        print(refusal)
        return 1
    failing = next((i for i, r in enumerate(results) if r.peak_gib > usable), None)
    if failing is None:
        worst = max(results, key=lambda r: r.peak_gib)
        print(f"every stage fits: highest peak {_gib(worst.peak_gib * GIB)} GiB of {usable:g} GiB usable "
              f"(stage {results.index(worst) + 1}, {worst.memory.peak_phase}). "
              f"dry run took {time.perf_counter() - start:.0f}s")
        return 0
    bad = results[failing]
    refusal = eval_refusal(bad.row.cfg, bad.memory.peak_eval / GIB, usable)
    if refusal is not None and bad.memory.train_peak / GIB <= usable:
        print(f"stage {failing + 1} ({bad.row.name}, seq_len {bad.row.cfg.training.seq_len:,}) does NOT fit: {refusal}")
        return 1
    advice, candidate = propose_fix(bad, usable)
    print(f"stage {failing + 1} ({bad.row.name}, seq_len {bad.row.cfg.training.seq_len:,}) does NOT fit: "
          f"peak {_gib(bad.peak_gib * GIB)} GiB > {usable:g} GiB usable, reached in the {bad.memory.peak_phase}.")
    print(f"  change: {advice}")
    if candidate is not None:
        checked = measure_row(PlanRow(bad.row.name, candidate), world, cfg.hardware.gpus_per_node)
        verdict = "fits" if checked.peak_gib <= usable else "still does not fit"
        print(f"  checked with the same measurement: peak {_gib(checked.peak_gib * GIB)} GiB, {verdict}")
    print(f"dry run took {time.perf_counter() - start:.0f}s")
    return 1
