"""The recipe schema's run-side sections: `[job]` (where the run writes, its seed and collective timeouts),
`[metrics]` and `[checkpoint]` (re-exported by config/schema.py, where the model and training sections and the allowed
values of the rest live)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

AsyncMode = Literal["disabled", "async"]
ExportDtype = Literal["auto", "bfloat16", "float32", "float16"]
StopSignal = Literal["SIGTERM", "SIGUSR1"]
"""The signals `checkpoint.save_on_signal` may name (training/preemption.py)."""


@dataclass
class JobConfig:
    dump_folder: str = "outputs/debug"
    """Where metrics.jsonl, tb/ (TensorBoard) and checkpoints/ of this run go."""
    seed: int = 0
    """Seeds weights, data order and dropout-free randomness; the same seed gives the same run on every mesh."""
    description: str = ""
    """Free text shown at start-up."""
    init_timeout_s: int = 600
    """Seconds a collective may wait during set-up (communicators, checkpoint load), each ramp stage's first two
    steps, checkpoint saves and evaluations, before the job fails instead of hanging (training/timeouts.py)."""
    step_timeout_s: int = 0
    """Seconds a collective may wait in a training step once its stage's first two steps ran (a dead or stuck rank
    ends the job this much later); 0 = 5x the stage's second step, at least 60 s."""
    flight_recorder_entries: int = 20000
    """NCCL's flight recorder: the last this many collectives of each rank kept in memory and, when one times out,
    written to <dump_folder>/flight_recorder/rank_<R>, which the hang line names with the command that reads them
    (`python -m torch.distributed.flight_recorder.fr_trace`); 0 = off. GPU runs only (gloo has no recorder)."""


@dataclass
class MetricsConfig:
    log_freq: int = 1
    """Log every this many steps (console, metrics.jsonl, TensorBoard)."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars to <dump_folder>/tb."""
    profile_step: int = 0
    """Profile this optimizer step (1-based; 0 = off) with torch.profiler and write
    <dump_folder>/profile_step<N>_rank<R>.json: each class of work's device seconds, as the dry run prices them
    (training/step_profile.py); metrics.jsonl marks that step `profiled` so step-time medians can leave it out."""
    straggler_threshold: float = 0.5
    """A rank whose own time (data wait + its work, without collective waits) is more than this fraction above the
    other ranks' median is slow in that record (training/stragglers.py; why 0.5: docs/launch_at_scale.md); 0 = off.
    Each record of a multi-rank run carries every rank's split (`straggler` in metrics.jsonl)."""
    straggler_intervals: int = 2
    """A rank slow in this many records in a row is named in the step line (rank and host)."""


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save distributed checkpoints during training."""
    interval: int = 100
    """Save every this many steps."""
    folder: str = "checkpoints"
    """Sub-folder of dump_folder holding step-<N>/ checkpoints."""
    keep_latest_k: int = 3
    """Keep the newest k complete checkpoints, deleting older ones after each save; 0 keeps them all."""
    async_mode: AsyncMode = "disabled"
    """disabled: training waits while a checkpoint is written. async: the state is copied to CPU memory and written
    by a background thread while training goes on (one save in flight at a time)."""
    load_step: int = -1
    """Resume from: -1 = the newest complete checkpoint in the folder, if any; N = step N exactly; 0 = start fresh
    (existing checkpoints are ignored, and overwritten when the same step is saved again)."""
    hf_load_path: str = ""
    """A Hugging Face Llama 3.x / Qwen2.5 / Qwen3 folder (config.json + safetensors) whose weights start training when
    no checkpoint is resumed. Its shapes must match [model] (name = "hf" takes them from it); empty = random init."""
    hf_export_folder: str = ""
    """Sub-folder of dump_folder that receives Hugging Face exports (step-<N>/: weights, config.json,
    generation_config.json and the tokenizer files, loadable by transformers' Auto classes); empty = no export."""
    hf_export_dtype: ExportDtype = "auto"
    """dtype of exported weights: auto (the dtype of `hf_load_path`'s weights, bfloat16 for a model trained from
    scratch) | bfloat16 | float32 | float16."""
    hf_export_interval: int = 0
    """Export every this many steps as well as at the end of training; 0 = only at the end."""
    save_on_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """On these signals every rank finishes its step, a checkpoint of it is saved and the run stops: SIGTERM
    (preemption, scancel, the time limit) exits 0, SIGUSR1 (slurm/train.sbatch's warning ahead of the time limit)
    exits 75 for a requeue. Empty = no handlers (the signal kills the run). Needs enable = true."""
