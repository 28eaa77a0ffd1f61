"""Recipes: TOML files read into one dataclass per section, with `--section.key value` overrides on top.

Every error a user can make here (missing file, unknown section or key, wrong type, impossible value) raises
RecipeError with one line that names the key and the file and says what to do, so train.py can refuse bad input
before any process group starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field

from training.errors import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_RECIPE = "recipes/debug.toml"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_recipe() -> str:
    """recipes/debug.toml, relative to the working folder when it is there, else in this checkout."""
    return DEFAULT_RECIPE if os.path.exists(DEFAULT_RECIPE) else os.path.join(REPO_ROOT, DEFAULT_RECIPE)


@dataclass
class JobConfig:
    dump_folder: str = "outputs/debug"
    """Where metrics.jsonl, tb/ (TensorBoard) and checkpoints/ of this run go."""
    seed: int = 0
    """Seeds weights, data order and dropout-free randomness; the same seed gives the same run on every mesh."""
    description: str = ""
    """Free text shown at start-up."""
    collective_timeout_s: int = 300
    """A collective that waits longer than this (a dead or stuck rank) fails the job instead of hanging it."""


@dataclass
class ModelConfig:
    name: str = "debug"
    """Named Llama 3 shape: debug | llama3_8b | llama3_70b | llama3_405b. Fields below override it when set."""
    dim: int = 0
    """Hidden size (0 = from the named config)."""
    n_layers: int = 0
    """Number of transformer blocks (0 = from the named config)."""
    n_heads: int = 0
    """Query heads (0 = from the named config)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention (0 = from the named config)."""
    vocab_size: int = 0
    """Vocabulary size; a trained tokenizer gets exactly this many pieces (0 = from the named config)."""
    rope_theta: float = 0.0
    """RoPE base frequency (0 = from the named config)."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 RoPE frequency scaling factor (0 = from the named config; -1 = switch scaling off)."""


@dataclass
class TrainingConfig:
    steps: int = 20
    """Optimizer steps to run."""
    seq_len: int = 4096
    """Tokens per sequence (the model sees seq_len inputs and seq_len shifted labels)."""
    local_batch_size: int = 2
    """Sequences per data-parallel rank per micro-step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; a multiple of local_batch_size x dp gives gradient
    accumulation. -1 = local_batch_size x dp (no accumulation)."""
    dtype: str = "float32"
    """Parameter/compute dtype: float32 or bfloat16 (bf16 parameters keep fp32 gradient reduction under FSDP)."""
    max_norm: float = 1.0
    """Gradient clipping by the global norm over all shards; <= 0 switches clipping off."""
    compile: bool = False
    """torch.compile each attention and feed-forward submodule."""


@dataclass
class OptimizerConfig:
    name: str = "AdamW"
    """Only AdamW is offered."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 2
    """Linear warmup from ~0 to the peak learning rate over this many steps."""
    decay_type: str = "linear"
    """Decay after warmup: linear | cosine | constant."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""


@dataclass
class DataConfig:
    corpus: list[str] = field(default_factory=lambda: ["pydoc"])
    """Documents: "pydoc" (English docs shipped with every Python), local .txt/.jsonl files or folders of them."""
    tokenizer_path: str = ""
    """An existing SentencePiece tokenizer.model; empty = train one on the corpus (cached in cache_dir)."""
    cache_dir: str = ".cache"
    """Where trained tokenizers are cached."""
    document_masking: bool = False
    """Attention stays inside each packed document and positions restart per document."""
    num_workers: int = 0
    """Data-loader worker processes per rank."""


@dataclass
class ParallelismConfig:
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    dp_replicate: int = 1
    """Replicated data-parallel degree (HSDP outer dimension)."""
    dp_shard: int = -1
    """FSDP2 sharded data-parallel degree; -1 = every rank the other degrees leave."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (ring attention)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism)."""
    cp_load_balancer: str = "zigzag"
    """How sequence chunks are laid out on CP ranks: zigzag | striped | contiguous."""
    fsdp_reshard_after_forward: str = "default"
    """Free gathered parameters after forward: default (yes, but no under PP) | always | never."""
    loss_parallel: bool = True
    """With tp > 1: compute the cross entropy on vocabulary-sharded logits instead of gathering them first."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe | 1F1B (one stage per rank) | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble |
    ZBVZeroBubble (several stages per rank; ZBV holds exactly two, V-shaped)."""
    pp_microbatches: int = 0
    """Microbatches each local batch is split into for the pipeline (0 = one row each, i.e. local_batch_size)."""
    pp_layers_per_stage: int = 0
    """Blocks per pipeline stage; the first and last stage take fewer when they do not divide n_layers. 0 = split
    the blocks evenly over pp stages (2 x pp for multi-stage schedules)."""


@dataclass
class ActivationCheckpointConfig:
    mode: str = "none"
    """none | full (every block) | selective (every `every`-th block) | op (inside every block: save the attention
    kernels' outputs and every other matmul's, recompute the rest, so no attention call runs twice)."""
    every: int = 2
    """With mode = selective: checkpoint every k-th block."""


@dataclass
class MetricsConfig:
    log_freq: int = 1
    """Log every this many steps (console, metrics.jsonl, TensorBoard)."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars to <dump_folder>/tb."""


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
    async_mode: str = "disabled"
    """disabled: training waits while a checkpoint is written. async: the state is copied to CPU memory and written
    by a background thread while training goes on (one save in flight at a time)."""
    load_step: int = -1
    """Resume from: -1 = the newest complete checkpoint in the folder, if any; N = step N exactly; 0 = start fresh
    (existing checkpoints are ignored, and overwritten when the same step is saved again)."""
    hf_load_path: str = ""
    """A Hugging Face Llama folder (config.json + safetensors) whose weights start training when no checkpoint is
    resumed. Its tensor shapes must match [model]; empty = the usual random init."""
    hf_export_folder: str = ""
    """Sub-folder of dump_folder that receives Hugging Face exports (step-<N>/, loadable by transformers'
    LlamaForCausalLM.from_pretrained); empty = no export."""
    hf_export_dtype: str = "bfloat16"
    """dtype of exported weights: bfloat16 | float32 | float16."""
    hf_export_interval: int = 0
    """Export every this many steps as well as at the end of training; 0 = only at the end."""


@dataclass
class HardwareConfig:
    """The machines a recipe is meant for: the launch check and the dry run read these (training itself picks CUDA or
    CPU at run time)."""
    device: str = "auto"
    """auto: CUDA when visible, else CPU | cuda: a GPU-sized recipe; without enough GPUs the launcher refuses in one
    line (and suggests --dry-run) instead of starting | cpu: never look for GPUs."""
    gpus_per_node: int = 8
    """GPUs per node: nodes to ask Slurm for, and which collectives the dry run puts on NVLink vs InfiniBand."""
    device_memory_gib: float = 80.0
    """Memory per GPU the dry run holds every stage's peak against (H100 SXM: 80 GiB)."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    recipe_path: str = ""
    """The TOML file this config came from (for error messages)."""


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "recipe_path"]
CHOICES = {
    ("training", "dtype"): ("float32", "bfloat16"),
    ("optimizer", "name"): ("AdamW",),
    ("lr_scheduler", "decay_type"): ("linear", "cosine", "constant"),
    ("parallelism", "cp_load_balancer"): ("zigzag", "striped", "contiguous"),
    ("parallelism", "fsdp_reshard_after_forward"): ("default", "always", "never"),
    ("parallelism", "pp_schedule"): ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                     "ZBVZeroBubble"),
    ("activation_checkpoint", "mode"): ("none", "full", "selective", "op"),
    ("checkpoint", "async_mode"): ("disabled", "async"),
    ("checkpoint", "hf_export_dtype"): ("bfloat16", "float32", "float16"),
    ("hardware", "device"): ("auto", "cuda", "cpu"),
}


def _nearest(word: str, options) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else f" Valid: {', '.join(options)}."


def _field_types(section: str) -> dict[str, type]:
    cls = type(getattr(Config(), section))
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(value, kind, where: str, from_text: bool):
    """Turns a TOML value or a command-line string into the field's type, or says what was expected."""
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, "a list")
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if from_text and str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return str(value).lower() in ("true", "1", "yes", "on")
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool) or (not from_text and not isinstance(value, (int, float))):
                raise ValueError
            return float(value)
        if kind is str:
            if not from_text and not isinstance(value, str):
                raise ValueError
            return str(value)
        if typing.get_origin(kind) is list:
            if from_text:
                return [v for v in str(value).split(",") if v]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return list(value)
    except (TypeError, ValueError):
        pass
    raise RecipeError(f"{where}: expected {expected}, got {value!r}. Fix the value.")


def _set(cfg: Config, section: str, key: str, value, origin: str, from_text: bool) -> None:
    if section not in SECTIONS:
        raise RecipeError(f"{origin}: unknown section [{section}].{_nearest(section, SECTIONS)}")
    types = _field_types(section)
    if key not in types:
        raise RecipeError(f"{origin}: unknown key '{section}.{key}'.{_nearest(key, types)}")
    where = f"{origin}: {section}.{key}"
    converted = _convert(value, types[key], where, from_text)
    choices = CHOICES.get((section, key))
    if choices and converted not in choices:
        raise RecipeError(f"{where} = {converted!r} is not one of {', '.join(choices)}.{_nearest(converted, choices)}")
    setattr(getattr(cfg, section), key, converted)


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key value` or `--section.key=value` pairs -> [(section, key, text)]."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise RecipeError(f"command line: cannot read '{arg}'. Overrides look like --section.key value "
                              f"(e.g. --training.steps 5).")
        name, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise RecipeError(f"command line: '{arg}' needs a value, e.g. {arg} 5.")
            text, i = args[i + 1], i + 1
        section, _, key = name.partition(".")
        out.append((section, key, text))
        i += 1
    return out


def load_config(recipe_path: str, overrides: list[str] | None = None) -> Config:
    """Recipe file, then command-line overrides, then cross-field checks."""
    try:
        with open(recipe_path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe file '{recipe_path}' does not exist. Pass a path like recipes/debug.toml "
                          f"(ls recipes/ lists the shipped ones).") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{recipe_path}: not valid TOML ({e}). Fix the syntax at that line.") from None
    cfg = Config(recipe_path=recipe_path)
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise RecipeError(f"{recipe_path}: top-level key '{section}' must be a [section] table."
                              f"{_nearest(section, SECTIONS)}")
        for key, value in table.items():
            _set(cfg, section, key, value, recipe_path, from_text=False)
    for section, key, text in parse_overrides(overrides or []):
        _set(cfg, section, key, text, f"command line (recipe {recipe_path})", from_text=True)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Value checks that need no process group (world-size checks live with the mesh)."""
    where = cfg.recipe_path
    positive = [("training", "steps"), ("training", "local_batch_size"), ("metrics", "log_freq"),
                ("checkpoint", "interval"), ("parallelism", "pp"), ("parallelism", "dp_replicate"),
                ("parallelism", "cp"), ("parallelism", "tp"), ("activation_checkpoint", "every"),
                ("hardware", "gpus_per_node"), ("hardware", "device_memory_gib")]
    for section, key in positive:
        if getattr(getattr(cfg, section), key) < 1:
            raise RecipeError(f"{where}: {section}.{key} must be >= 1, got {getattr(getattr(cfg, section), key)}.")
    if cfg.parallelism.dp_shard == 0 or cfg.parallelism.dp_shard < -1:
        raise RecipeError(f"{where}: parallelism.dp_shard must be >= 1 or -1 (= the remaining ranks), "
                          f"got {cfg.parallelism.dp_shard}.")
    if cfg.training.seq_len < 2:
        raise RecipeError(f"{where}: training.seq_len must be >= 2 (one input and one label token), "
                          f"got {cfg.training.seq_len}. Set e.g. --training.seq_len 512.")
    if cfg.optimizer.lr <= 0:
        raise RecipeError(f"{where}: optimizer.lr must be > 0, got {cfg.optimizer.lr}.")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise RecipeError(f"{where}: lr_scheduler.warmup_steps must be >= 0.")
    ck = cfg.checkpoint
    for key in ("keep_latest_k", "hf_export_interval"):
        if getattr(ck, key) < 0:
            raise RecipeError(f"{where}: checkpoint.{key} must be >= 0, got {getattr(ck, key)}.")
    if ck.load_step < -1:
        raise RecipeError(f"{where}: checkpoint.load_step must be -1 (newest), 0 (start fresh) or a step, "
                          f"got {ck.load_step}.")
    if ck.load_step > 0 and not ck.enable:
        raise RecipeError(f"{where}: checkpoint.load_step = {ck.load_step} needs checkpoint.enable = true.")
    if not cfg.data.corpus:
        raise RecipeError(f"{where}: data.corpus is empty. Use [\"pydoc\"] or local .txt/.jsonl paths.")


def to_dict(cfg: Config) -> dict:
    return {s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}


def to_toml(cfg: Config) -> str:
    """The merged config as TOML (for --print-config and the run folder)."""
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)
