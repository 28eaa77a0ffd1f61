"""Host memory of a stage, per rank and per node, held against what the node has, and the one line that stops a
stage that would not fit before torchrun starts (issue 48).

Why: host memory is where a CPU run dies without a word (the kernel's OOM killer SIGKILLs a rank and torchrun prints
a traceback with no hint), and with `training.cpu_offload` it is where a GPU run keeps its whole training state. What
one rank holds on the host, from the dry run's measurement of the stage (training/planning/memory_probe.py):
- the process: Python, torch and the trainer's code, measured as the planning process's own resident set before it
  builds anything (it has imported what a rank imports: train.py's imports);
- a CPU run: its whole measured step peak (its device is the host) plus the offloaded block inputs (host copies,
  outside the peak); `cpu_offload` moves nothing there, so it changes nothing;
- a CUDA run: with `cpu_offload` its parameter shards, gradients and AdamW state (pinned), with activation offload
  its pinned arena (parallelisms/host_arena.py);
- the loader's batches in flight (two prefetched steps per rank). Data workers are forked from their rank and share
  its pages copy-on-write: beyond their batches they are not counted (an estimate's known gap).
These are the bytes a rank uses. glibc's heap may hold more: its mmap threshold rises to the largest block freed, so
later tensors come from the heap, which returns little. Measured on the debug model (torch 2.13, 2 ranks): peak
resident sets 0.50 and 0.66 GiB with MALLOC_MMAP_THRESHOLD_=65536 (freed blocks go back at once; the plan said 0.51 and
0.67), 0.68 and 0.83 GiB without. A CPU run near its box's limit sets that variable (docs/frontier.md).
A node holds `min(world, hardware.gpus_per_node)` ranks (a CPU run: all of them, on one machine). The limit is
`hardware.host_memory_gib`, and on a CPU run also what the box has available now (/proc/meminfo MemAvailable: what
the kernel can give without swapping).
"""
from __future__ import annotations

from dataclasses import dataclass

from config.schema import Config

GIB = 2**30
RANK_EXTRAS_BYTES = 40 * 2**20
"""What a rank holds beyond the planning process's interpreter and its tensors: the gloo process group, the
tokenizer, the loader and the peak-FLOP probe's matrices. Measured on the debug recipe (2 ranks, torch 2.13 CPU): a
rank's resident set at its first step, less the planning process's and its parameters, 0.04 GiB."""
PREFETCHED_STEPS = 2
"""Steps of batches a rank's loader holds ahead (torch's DataLoader default prefetch of 2 per worker)."""
SCREEN_FRACTION = 0.5
"""The launch check measures a stage only when the cheap estimate (`screen_node_bytes`) reaches this fraction of the
node's memory: a debug run then starts without a probe, a stage near the limit is decided by measurement."""


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set now (VmRSS), 0 where /proc is missing."""
    kib = _proc_kib("/proc/self/status", "VmRSS")
    return 1024 * kib if kib is not None else 0


def available_bytes() -> int | None:
    """What the kernel can give new allocations without swapping (MemAvailable), None where /proc is missing."""
    kib = _proc_kib("/proc/meminfo", "MemAvailable")
    return 1024 * kib if kib is not None else None


def ranks_per_node(cfg: Config, world: int, device_type: str) -> int:
    """A CPU run is launched on one machine (run_train.sh without Slurm); GPU nodes hold gpus_per_node ranks."""
    return world if device_type == "cpu" else min(world, cfg.hardware.gpus_per_node)


def launch_device_type(cfg: Config) -> str:
    """The device the ranks will pick (training/hardware.py pick_device): CUDA when visible, unless the recipe says
    cpu; a recipe for GPUs (device = "cuda") is planned as one wherever it is checked."""
    import torch

    if cfg.hardware.device == "cuda":
        return "cuda"
    return "cuda" if cfg.hardware.device == "auto" and torch.cuda.is_available() else "cpu"


@dataclass
class HostPlan:
    """One stage's host bytes per rank, by part, and the node that holds `ranks` of them."""
    process: float
    tensors: float
    """A CPU run: the step's measured peak; a CUDA run: the offloaded training state (0 without cpu_offload)."""
    offload: float
    """Offloaded block inputs (activation_checkpoint.offload): pinned whole pages on CUDA."""
    batches: float
    ranks: int

    @property
    def per_rank(self) -> float:
        return self.process + self.tensors + self.offload + self.batches

    @property
    def per_node(self) -> float:
        return self.ranks * self.per_rank

    def describe(self) -> str:
        parts = f"process {self.process / GIB:.2f} + tensors {self.tensors / GIB:.2f}"
        if self.offload:
            parts += f" + offloaded activations {self.offload / GIB:.2f}"
        return (f"{self.per_node / GIB:,.2f} GiB per node = {self.ranks} rank(s) x {self.per_rank / GIB:,.2f} GiB "
                f"({parts} + batches {self.batches / GIB:.3f})")


def batch_bytes(cfg: Config) -> float:
    """A rank's loader batches in flight: ids, labels, positions and document ids (int64) of its rows per step."""
    t = cfg.training
    return PREFETCHED_STEPS * 4 * 8 * t.local_batch_size * t.seq_len * max(1, t.grad_accum_steps(1))


def host_plan(cfg: Config, memory, world: int, device_type: str, process_bytes: float) -> HostPlan:
    """The stage's host plan from its measured rank memory (memory_probe.RankMemory) on a `device_type` run."""
    from parallelisms.host_arena import stage_pinned_bytes

    if device_type == "cpu":
        tensors, offload = memory.peak, memory.host
        process_bytes += RANK_EXTRAS_BYTES
    else:
        tensors = memory.state if cfg.training.cpu_offload else 0.0
        offload = stage_pinned_bytes(memory.host)
    return HostPlan(process_bytes, tensors, offload, batch_bytes(cfg), ranks_per_node(cfg, world, device_type))


def node_limit(cfg: Config, device_type: str) -> tuple[float, str]:
    """(bytes a node may hold, where the figure comes from)."""
    limit, source = cfg.hardware.host_memory_gib * GIB, "hardware.host_memory_gib"
    available = available_bytes() if device_type == "cpu" else None
    if available is not None and available < limit:
        return float(available), "available on this machine now"
    return limit, source


def cheapest_fix(cfg: Config, device_type: str) -> str:
    """What cuts a stage's host bytes most for least, in the order tried."""
    ac = cfg.activation_checkpoint
    if device_type == "cpu" and ac.mode != "full":
        return "set activation_checkpoint.mode = \"full\" (each block keeps only its input)"
    if device_type == "cpu":
        return "shorten this stage's training.seq_len or lower training.local_batch_size, or run on a larger machine"
    if ac.offload:
        return "raise cp over more nodes (each GPU offloads fewer tokens) or set activation_checkpoint.offload = false"
    if cfg.training.cpu_offload:
        return "spread the job over more nodes (each holds 1/nodes of the offloaded state) or use a larger host"
    return "set hardware.host_memory_gib to the node's real memory or use a larger host"


def host_refusal(cfg: Config, stage_name: str, seq_len: int, plan: HostPlan, limit: float, source: str,
                 device_type: str) -> str:
    """The one line naming the stage, the GiB needed and available, and the cheapest fix."""
    return (f"{cfg.recipe_path}: stage {stage_name} (seq_len {seq_len:,}) needs {plan.per_node / GIB:,.1f} GiB of host "
            f"memory per node ({plan.ranks} rank(s) x {plan.per_rank / GIB:,.1f} GiB) but the node has "
            f"{limit / GIB:,.1f} GiB ({source}): {cheapest_fix(cfg, device_type)}. "
            f"./run_train.sh {cfg.recipe_path} --dry-run shows the plan.")


def screen_node_bytes(cfg: Config, world: int, device_type: str, process_bytes: float) -> float:
    """A cheap estimate of a stage's host bytes per node, to decide whether the launch check measures it: the
    training state (16 bytes per parameter over the FSDP ranks, fp32 master, gradient and two moments) on a CPU run
    or an offloading one, and on a CPU run the activations a block keeps (~34 values per token and hidden unit
    without checkpointing, as Korthikanti et al. count them, one with full checkpointing) over the CP ranks."""
    from models.llama import recipe_model_config
    from training.planning.workload import parameter_count

    m, t, p = recipe_model_config(cfg), cfg.training, cfg.parallelism
    shards = max(1, world // max(1, p.tp * p.pp * p.dp_replicate))
    state = 16 * parameter_count(m) / shards / max(1, p.tp * p.pp) if device_type == "cpu" or t.cpu_offload else 0
    activations = 0.0
    if device_type == "cpu":
        per_token = m.dim * (1 if cfg.activation_checkpoint.mode == "full" else 34) * m.n_layers * 4
        activations = per_token * t.local_batch_size * t.seq_len / p.cp
    return ranks_per_node(cfg, world, device_type) * (process_bytes + state + activations)


def check_host_memory(cfg: Config, world: int) -> None:
    """Before torchrun (train.py --check): every stage whose cheap estimate comes near the node's memory is measured
    as the dry run measures it, and one that would not fit stops in one line (RecipeError). Stages far below the
    limit (every debug run) cost no measurement."""
    from config import RecipeError
    from models.llama import recipe_model_config
    from training.ramp import resolve_stages

    device_type = launch_device_type(cfg)
    process = resident_bytes()
    limit, source = node_limit(cfg, device_type)
    for stage in resolve_stages(cfg, world):
        scfg = stage.cfg
        if scfg.parallelism.pp > 1 or screen_node_bytes(scfg, world, device_type, process) < SCREEN_FRACTION * limit:
            continue  # a pipeline is not measured by the probe (the dry run says so)
        from training.planning.memory_probe import measure_memory  # lazy: it imports much of torch's compiler

        memory = measure_memory(scfg, world, recipe_model_config(scfg).n_layers, 0)
        plan = host_plan(scfg, memory, world, device_type, process)
        if plan.per_node > limit:
            raise RecipeError(host_refusal(scfg, stage.name, scfg.training.seq_len, plan, limit, source, device_type))
