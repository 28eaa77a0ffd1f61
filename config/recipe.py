"""Recipes: TOML files read into the schema of config/schema.py, with `--section.key value` overrides on top.

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

from config.errors import RecipeError
from config.rope import RAMP_KEEP_TYPE, ROPE_SCALING_TYPES, is_scaling_type
from config.schema import (ACCELERATOR_MEMORY_GIB, CHOICES, DOCUMENTS, MIN_SEQ_LEN, SECTIONS, Config, RampTable,
                           StopSignal, choices)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_RECIPE = "recipes/debug.toml"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_recipe() -> str:
    """recipes/debug.toml, relative to the working folder when it is there, else in this checkout."""
    return DEFAULT_RECIPE if os.path.exists(DEFAULT_RECIPE) else os.path.join(REPO_ROOT, DEFAULT_RECIPE)


def _nearest(word: str, options, cutoff: float = 0.5) -> str:
    options = [str(o).lower() if isinstance(o, bool) else o for o in options]  # true/false as a recipe writes them
    match = difflib.get_close_matches(str(word), options, n=1, cutoff=cutoff)
    return f" Did you mean '{match[0]}'?" if match else f" Valid: {', '.join(options)}."


_BOOL_WORDS = ("true", "1", "yes", "on", "false", "0", "no", "off")


def _field_types(section: str) -> dict[str, type]:
    cls = type(getattr(Config(), section))
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(value, kind, where: str, from_text: bool):
    """Turns a TOML value or a command-line string into the field's type, or says what was expected."""
    if typing.get_origin(kind) is typing.Literal:  # a choice: read as text, checked against CHOICES by the caller
        if True in typing.get_args(kind):  # true / false / a word ("auto"): booleans read as bool fields are
            if isinstance(value, bool) or (from_text and str(value).lower() in _BOOL_WORDS):
                return _convert(value, bool, where, from_text)
            if not isinstance(value, str):
                raise RecipeError(f"{where}: expected true, false or a word "
                                  f"({', '.join(repr(c) for c in typing.get_args(kind) if isinstance(c, str))}), "
                                  f"got {value!r}. Fix the value.")
        kind = str
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, "a list")
    if typing.get_origin(kind) is list:
        expected = f"a list of {typing.get_args(kind)[0].__name__}"
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if from_text and str(value).lower() in _BOOL_WORDS:
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
        if dataclasses.is_dataclass(kind):
            return _convert_table(value, kind, where)
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            if dataclasses.is_dataclass(item):
                if from_text or not isinstance(value, list):
                    raise ValueError
                return [_convert_table(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
            if isinstance(value, str) and not from_text and item is str:
                value = [value]  # a single entry written as a plain string
            items = [v for v in str(value).split(",") if v] if from_text else value
            if not isinstance(items, list):
                raise ValueError
            return [_convert(v, item, where, from_text) for v in items]
    except (TypeError, ValueError):
        pass
    raise RecipeError(f"{where}: expected {expected}, got {value!r}. Fix the value.")


def _convert_table(value, kind, where: str):
    """A TOML table -> the dataclass `kind`, each key typed and checked like a section's."""
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: expected a table ([[...]] or {{...}}), got {value!r}.")
    hints = typing.get_type_hints(kind)
    instance = kind()
    for key, item in value.items():
        if key not in hints:
            raise RecipeError(f"{where}: unknown key '{key}'.{_nearest(key, hints)}")
        setattr(instance, key, _convert(item, hints[key], f"{where}.{key}", from_text=False))
    return instance


REPLACED_KEYS = {
    ("job", "collective_timeout_s"): "was split in two: job.init_timeout_s (set-up, each stage's first two steps, "
                                     "checkpoints, evaluations) and job.step_timeout_s (training steps after those; "
                                     "0 = measured): set those instead",
}


def _set(cfg: Config, section: str, key: str, value, origin: str, from_text: bool) -> None:
    if (section, key) in REPLACED_KEYS:
        raise RecipeError(f"{origin}: {section}.{key} {REPLACED_KEYS[section, key]}.")
    if section not in SECTIONS:
        raise RecipeError(f"{origin}: unknown section [{section}].{_nearest(section, SECTIONS)}")
    types = _field_types(section)
    if key not in types:
        raise RecipeError(f"{origin}: unknown key '{section}.{key}'.{_nearest(key, types)}")
    where = f"{origin}: {section}.{key}"
    converted = _convert(value, types[key], where, from_text)
    choices = CHOICES.get((section, key))
    if choices and converted not in choices:
        raise RecipeError(f"{where} = {converted!r} is not one of "
                          f"{', '.join(str(c).lower() if isinstance(c, bool) else c for c in choices)}."
                          f"{_nearest(converted, choices)}")
    setattr(getattr(cfg, section), key, converted)


def parse_ramp(tables, recipe_path: str) -> list[RampTable]:
    """The `[[ramp]]` array of tables -> typed stages (errors name `ramp[i].key`)."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise RecipeError(f"{recipe_path}: 'ramp' must be an array of tables: write each stage as [[ramp]].")
    fields = {f.name: f.type for f in dataclasses.fields(RampTable)}
    stages = []
    for i, table in enumerate(tables):
        stage = RampTable()
        for key, value in table.items():
            if key not in fields:
                raise RecipeError(f"{recipe_path}: unknown key 'ramp[{i}].{key}'.{_nearest(key, fields, 0.6)}")
            if key == "source_weights":
                if not isinstance(value, dict) or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                          for w in value.values()):
                    raise RecipeError(f"{recipe_path}: ramp[{i}].source_weights must be a table of numbers, e.g. "
                                      f"source_weights = {{books = 0.3, code = 0.7}}.")
                stage.source_weights = {str(k): float(w) for k, w in value.items()}
                continue
            if key == "offload":
                if not isinstance(value, bool):
                    raise RecipeError(f"{recipe_path}: ramp[{i}].offload = {value!r}: use true or false (absent = keep "
                                      f"the previous stage's).")
                stage.offload = value
                continue
            if key == "rope_type":
                if value != RAMP_KEEP_TYPE and not is_scaling_type(value):
                    types = " or ".join(f'"{t}"' for t in ROPE_SCALING_TYPES)
                    raise RecipeError(f"{recipe_path}: ramp[{i}].rope_type = {value!r}: use {types} (\"\" = keep).")
                stage.rope_type = value
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
    cfg.ramp = parse_ramp(raw.pop("ramp", []), recipe_path)
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise RecipeError(f"{recipe_path}: top-level key '{section}' must be a [section] table."
                              f"{_nearest(section, SECTIONS)}")
        for key, value in table.items():
            _set(cfg, section, key, value, recipe_path, from_text=False)
    overrides = parse_overrides(overrides or [])
    for section, key, text in overrides:
        _set(cfg, section, key, text, f"command line (recipe {recipe_path})", from_text=True)
    named = "cp_load_balancer" in raw.get("parallelism", {}) or \
        any((section, key) == ("parallelism", "cp_load_balancer") for section, key, _ in overrides)
    if not named:
        default_load_balancer(cfg)
    default_hardware_memory(cfg)
    validate(cfg)
    return cfg


def default_hardware_memory(cfg: Config) -> None:
    """Device and host memory left at 0 take the named accelerator's figures."""
    hw = cfg.hardware
    device, host = ACCELERATOR_MEMORY_GIB[hw.accelerator]
    hw.device_memory_gib = hw.device_memory_gib or device
    hw.host_memory_gib = hw.host_memory_gib or host


def default_load_balancer(cfg: Config) -> None:
    """A recipe that names no CP load balancer gets "documents" with document masking (it balances the visible
    pairs and sends only what other ranks see: bench/bench_cp_balance.py), else the schema's zigzag."""
    if cfg.data.document_masking:
        cfg.parallelism.cp_load_balancer = DOCUMENTS


def validate(cfg: Config) -> None:
    """Value checks that need no process group (world-size checks live with the mesh)."""
    where = cfg.recipe_path
    positive = [("training", "steps"), ("training", "local_batch_size"), ("metrics", "log_freq"),
                ("metrics", "straggler_intervals"),
                ("checkpoint", "interval"), ("parallelism", "pp"), ("parallelism", "dp_replicate"),
                ("parallelism", "cp"), ("parallelism", "tp"), ("activation_checkpoint", "every"),
                ("hardware", "gpus_per_node"), ("hardware", "device_memory_gib"), ("job", "init_timeout_s")]
    for section, key in positive:
        if getattr(getattr(cfg, section), key) < 1:
            raise RecipeError(f"{where}: {section}.{key} must be >= 1, got {getattr(getattr(cfg, section), key)}.")
    if cfg.job.flight_recorder_entries < 0:
        raise RecipeError(f"{where}: job.flight_recorder_entries must be >= 0 (0 = off), got "
                          f"{cfg.job.flight_recorder_entries}.")
    if cfg.job.step_timeout_s < 0:
        raise RecipeError(f"{where}: job.step_timeout_s must be >= 0 (0 = measured: 5x a stage's second step, at "
                          f"least 60 s), got {cfg.job.step_timeout_s}.")
    for name in cfg.checkpoint.save_on_signal:
        if name not in choices(StopSignal):
            raise RecipeError(f"{where}: checkpoint.save_on_signal names '{name}', which the trainer does not handle; "
                              f"use any of {list(choices(StopSignal))} (or [] for none).")
    for key in ("host_memory_gib", "nvlink_gb_per_s", "network_gb_per_s"):
        if getattr(cfg.hardware, key) < 0:
            raise RecipeError(f"{where}: hardware.{key} must be >= 0 (0 = the accelerator's), got "
                              f"{getattr(cfg.hardware, key)}.")
    if cfg.parallelism.dp_shard == 0 or cfg.parallelism.dp_shard < -1:
        raise RecipeError(f"{where}: parallelism.dp_shard must be >= 1 or -1 (= the remaining ranks), "
                          f"got {cfg.parallelism.dp_shard}.")
    if cfg.training.seq_len < MIN_SEQ_LEN:
        raise RecipeError(f"{where}: training.seq_len must be >= 2 (one input and one label token), "
                          f"got {cfg.training.seq_len}. Set e.g. --training.seq_len 512.")
    if cfg.optimizer.lr <= 0:
        raise RecipeError(f"{where}: optimizer.lr must be > 0, got {cfg.optimizer.lr}.")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise RecipeError(f"{where}: lr_scheduler.warmup_steps must be >= 0.")
    if cfg.training.loss_chunk_tokens < -1:
        raise RecipeError(f"{where}: training.loss_chunk_tokens must be >= 0 (0 = off) or -1 (automatic tiles), "
                          f"got {cfg.training.loss_chunk_tokens}.")
    for section, key in (("model", "mlp_chunk_tokens"), ("model", "norm_chunk_tokens")):
        if getattr(getattr(cfg, section), key) < 0:
            raise RecipeError(f"{where}: {section}.{key} must be >= 0 (0 = off), got "
                              f"{getattr(getattr(cfg, section), key)}.")
    if cfg.parallelism.attention_head_groups < 0:
        raise RecipeError(f"{where}: parallelism.attention_head_groups must be >= 0 (0 = by size, 1 = one group), "
                          f"got {cfg.parallelism.attention_head_groups}.")
    if cfg.parallelism.attention_sublayer_groups < 0:
        raise RecipeError(f"{where}: parallelism.attention_sublayer_groups must be >= 0 (0 or 1 = off), got "
                          f"{cfg.parallelism.attention_sublayer_groups}.")
    if cfg.metrics.straggler_threshold < 0:
        raise RecipeError(f"{where}: metrics.straggler_threshold must be >= 0 (0 = off), got "
                          f"{cfg.metrics.straggler_threshold}.")
    if cfg.metrics.profile_step < 0:
        raise RecipeError(f"{where}: metrics.profile_step must be >= 0 (0 = off), got {cfg.metrics.profile_step}.")
    ck = cfg.checkpoint
    for key in ("keep_latest_k", "hf_export_interval"):
        if getattr(ck, key) < 0:
            raise RecipeError(f"{where}: checkpoint.{key} must be >= 0, got {getattr(ck, key)}.")
    if ck.load_step < -1:
        raise RecipeError(f"{where}: checkpoint.load_step must be -1 (newest), 0 (start fresh) or a step, "
                          f"got {ck.load_step}.")
    if ck.load_step > 0 and not ck.enable:
        raise RecipeError(f"{where}: checkpoint.load_step = {ck.load_step} needs checkpoint.enable = true.")
    check_offload(cfg)
    check_cpu_offload(cfg)
    if cfg.data.placement == "work" and not (cfg.data.document_masking and cfg.data.dataset == "text"):
        raise RecipeError(f"{where}: data.placement = \"work\" moves document segments between rows, which needs "
                          f"data.document_masking = true and data.dataset = \"text\". Set those or placement = "
                          f"\"loader\".")
    check_documents_layout(cfg)
    if not cfg.data.corpus:
        raise RecipeError(f"{where}: data.corpus is empty. Use [\"pydoc\"] or local .txt/.jsonl paths.")


def check_documents_layout(cfg: Config) -> None:
    """The documents layout is planned from the document ids."""
    p = cfg.parallelism
    if p.cp_load_balancer != DOCUMENTS:
        return
    if not cfg.data.document_masking:
        raise RecipeError(f"{cfg.recipe_path}: parallelism.cp_load_balancer = \"documents\" places documents, so it "
                          f"needs data.document_masking = true. Turn it on or use cp_load_balancer = \"zigzag\".")


def check_offload(cfg: Config) -> None:
    """Offload moves what activation checkpointing keeps: without checkpointing there is nothing to move."""
    if cfg.activation_checkpoint.offload and cfg.activation_checkpoint.mode == "none":
        raise RecipeError(f"{cfg.recipe_path}: activation_checkpoint.offload = true needs activation_checkpoint.mode "
                          f"full, selective or op (it is \"none\"). Set a mode or offload = false.")
    if cfg.activation_checkpoint.offload_keep_last < 0:
        raise RecipeError(f"{cfg.recipe_path}: activation_checkpoint.offload_keep_last must be >= 0 (0 = every block "
                          f"input offloaded), got {cfg.activation_checkpoint.offload_keep_last}.")


def check_cpu_offload(cfg: Config) -> None:
    """Where FSDP2's CPU offload cannot serve here, one line before any process group: torchao's float8 weights
    compute their scales with all-reduces on the device (host-resident shards would go to NCCL on the host), and a
    pipeline's stages are materialised on the device (the offload wants them built on the host) and not measured by
    the dry run."""
    if not cfg.training.cpu_offload:
        return
    if cfg.training.float8 != "off":
        raise RecipeError(f"{cfg.recipe_path}: training.cpu_offload = true does not combine with training.float8 = "
                          f"\"{cfg.training.float8}\" (float8 scales are reduced on the device, offloaded weights "
                          f"live on the host). Set float8 = \"off\" or cpu_offload = false.")
    if cfg.parallelism.pp > 1:
        raise RecipeError(f"{cfg.recipe_path}: training.cpu_offload = true is not supported with parallelism.pp = "
                          f"{cfg.parallelism.pp} (pipeline stages are built on the device). Set pp = 1 (FSDP over "
                          f"the same GPUs) or cpu_offload = false.")


def to_dict(cfg: Config) -> dict:
    return {s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}


def toml_value(v) -> str:
    """One value as TOML (strings escaped, lists and dicts inline): --print-config's and the ramp planner's."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # [[data.sources]] entries and ramp source_weights, as inline tables
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def to_toml(cfg: Config) -> str:
    """The merged config as TOML (for --print-config and the run folder)."""
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    for stage in cfg.ramp:
        lines.append("[[ramp]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in dataclasses.asdict(stage).items() if v is not None]
        lines.append("")
    return "\n".join(lines)
