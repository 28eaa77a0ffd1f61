"""Distributed checkpoints: save every `interval` steps, resume exactly, on this mesh or another one.

What a checkpoint holds (one DCP folder, `<dump_folder>/<folder>/step-<N>/`):
- `model`: this rank's parameters (FSDP/TP DTensor shards) under their plain names (`layers.3.attention.wq.weight`,
  the same on any pipeline split), read back into whatever mesh the resuming job has (DCP reshards);
- `optimizer`: AdamW state in the flattened per-parameter form, so it reshards the same way;
- `lr_scheduler`, `dataloader` (the GLOBAL count of rows consumed, so a new data-parallel degree neither repeats nor
  skips a row), `train_state` (step), and each rank's RNG states (restored when the same rank exists again).
Publishing is atomic (see training/checkpoint_files.py): the folder gets its final name only after every rank has
finished writing and the files are checksummed. Loading verifies sizes and checksums (split over the ranks); a bad
newest checkpoint is skipped with a warning naming the file, a bad chosen one is an error naming the file, and a
checkpoint of another model shape is refused naming the first mismatched parameter.

Checkpoint collectives run on a gloo group of their own when training uses NCCL (DCP coordinates on the CPU) or saves
asynchronously (the background thread's collectives must not interleave with training's); else on the default group.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from config import RecipeError, Refusal
from config.schema import CheckpointConfig
from training.hf_export import export_dtype, write_export_extras
from models.hf import load_hf_weights, quiet_single_process_dcp, save_hf
from parallelisms.float8 import plain_weights
from training import checkpoint_files as files
from training.checkpoint_disk import DiskErrorWriter, raise_if_disk_failure
from training.checkpoint_shapes import check_model_shapes, expected_model_shapes

_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelParts(nn.Module):
    """One module over this rank's pipeline parts, keeping the parts' own parameter names (a stage's blocks keep
    their global ids), so state-dict helpers see one model and names do not depend on the pipeline split."""

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                mine = self._modules.get(name)
                if mine is None:
                    self.add_module(name, nn.ModuleDict(child.items()) if isinstance(child, nn.ModuleDict)
                                    else child)
                elif isinstance(child, nn.ModuleDict) and isinstance(mine, nn.ModuleDict):
                    mine.update(child.items())
                elif mine is not child and any(True for _ in child.parameters()):
                    raise Refusal(f"model parts both hold a '{name}' with parameters")


def merged_model(model_parts: Sequence[nn.Module]) -> nn.Module:
    return model_parts[0] if len(model_parts) == 1 else ModelParts(model_parts)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Owns `<dump_folder>/<config.folder>`: `load()` once after the model, optimizer, scheduler and data loader
    exist; `maybe_save(step, last)` after every step; `close()` at the end (waits for an async save).

    `model_parts` is this rank's list of modules (several pipeline stages possible) over which the one `optimizer`
    steps. `model_config` (a models.llama.LlamaConfig) enables the full-model shape check and HF export.
    """

    def __init__(self, config: CheckpointConfig, dump_folder: str, model_parts: Sequence[nn.Module], optimizer,
                 lr_scheduler, dataloader, model_config=None, description: dict | None = None, export_extras=None):
        self.config = config
        self.folder = os.path.join(dump_folder, config.folder)
        self.hf_export_root = os.path.join(dump_folder, config.hf_export_folder) if config.hf_export_folder else ""
        self.model_parts = list(model_parts)
        self.model = merged_model(self.model_parts)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.model_config = model_config if model_config is not None else getattr(model_parts[0], "config", None)
        self.description = description or {}
        self.export_extras = export_extras  # training.hf_export.ExportExtras: tokenizer, generation config, ids
        self.stateful: dict[str, object] = {}  # more state_dict()/load_state_dict() objects, e.g. a ramp stage
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = None  # None = the default group
        if self.distributed and (config.enable or config.hf_load_path or config.hf_export_folder):
            backend = dist.get_backend()
            if backend != "fake" and (backend != "gloo" or config.async_mode == "async"):
                self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._executor = ThreadPoolExecutor(1, "checkpoint") if config.async_mode == "async" else None
        self._pending: Future | None = None
        self.saved_step: int | None = None
        """The step of the last save started (published once `wait()` returns)."""

    def register(self, name: str, stateful) -> None:
        """Checkpoint one more object with state_dict() / load_state_dict() (identical on every rank); register
        before `load()`."""
        self.stateful[name] = stateful

    # ------------------------------------------------------------ state
    def _state(self, step: int) -> dict:
        state = {
            "model": plain_weights(get_model_state_dict(self.model)),  # float8 or not, the same plain tensors
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIMIZER_OPTIONS),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": {"step": step},
            "rng": {f"rank{self.rank}": _rng_state()},
        }
        if self.dataloader is not None:
            state["dataloader"] = self.dataloader.state_dict()
        for name, obj in self.stateful.items():
            state[name] = obj.state_dict()
        return state

    # ------------------------------------------------------------ collectives on the checkpoint group
    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _from_rank0(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _say(self, message: str, warning: bool = False) -> None:
        if self.rank == 0:
            print(("warning: " if warning else "") + message, file=sys.stderr if warning else sys.stdout, flush=True)

    # ------------------------------------------------------------ saving
    def _due(self, step: int, last: bool) -> tuple[bool, bool]:
        """(a checkpoint save, an HF export) due after `step`: on their intervals and at the last step."""
        c = self.config
        return (c.enable and (step % c.interval == 0 or last),
                bool(self.hf_export_root) and bool(last or (c.hf_export_interval and step % c.hf_export_interval == 0)))

    def due(self, step: int, last: bool = False) -> bool:
        """Whether maybe_save does anything after `step` (the trainer lengthens the collective timeout around it)."""
        return any(self._due(step, last))

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Called after every optimizer step: saves and exports when due."""
        save, export = self._due(step, last)
        if save:
            self.save(step)
        if export:
            self.export_hf(step)

    def save(self, step: int) -> None:
        self.wait()  # one save in flight at a time; the previous one is published first
        self.saved_step = step
        start = time.perf_counter()
        partial = files.step_dir(self.folder, step) + files.PARTIAL_SUFFIX
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier attempt
            os.makedirs(self.folder, exist_ok=True)
        self._barrier()
        state = self._state(step)
        writer = DiskErrorWriter(partial)  # a full disk's OSError survives DCP's gathering
        try:
            with quiet_single_process_dcp():
                if self._executor is None:
                    metadata = dcp.save(state, storage_writer=writer, process_group=self.group,
                                        no_dist=not self.distributed)
                    self._publish(step, metadata, start)
                else:  # async_save copies the state to CPU memory before it returns; the write happens behind
                    upload = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                            no_dist=not self.distributed)
                    self._pending = self._executor.submit(self._publish_when_written, step, upload, start)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise_if_disk_failure(e, step, self.folder, self.rank)  # no space, read-only, quota: one line
            raise

    def _publish_when_written(self, step: int, upload: Future, start: float) -> None:
        self._publish(step, upload.result(), start)

    def _publish(self, step: int, metadata, start: float) -> None:
        """Every rank checksums its share of the files; rank 0 writes the manifest and renames the folder."""
        final = files.step_dir(self.folder, step)
        partial = final + files.PARTIAL_SUFFIX
        storage = metadata.storage_data if metadata is not None else None
        if storage is None:  # torch < 2.13 returns the metadata without it; the .metadata file DCP wrote has it
            storage = FileSystemReader(partial).read_metadata().storage_data
        names = sorted({info.relative_path for info in storage.values()} | {".metadata"})
        described = {}
        for part in self._gather(files.describe_files(partial, names[self.rank::self.world_size])):
            described.update(part)
        if self.rank == 0:
            manifest = {"step": step, "files": described, "world_size": self.world_size, "mesh": self.description,
                        "model": dataclasses.asdict(self.model_config) if self.model_config is not None else None,
                        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__}
            files.write_json_atomically(os.path.join(partial, files.MANIFEST), manifest)
            files.publish(partial, final)
            removed = files.prune(self.folder, self.config.keep_latest_k)
            note = f", removed step(s) {removed}" if removed else ""
            self._say(f"checkpoint: saved step {step} to {final} in {time.perf_counter() - start:.2f} s{note}")
        self._barrier()

    def wait(self) -> None:
        """Blocks until an async save in flight is published; re-raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as e:
                raise_if_disk_failure(e, self.saved_step, self.folder, self.rank)
                raise RuntimeError(f"asynchronous checkpoint save failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def export_hf(self, step: int) -> None:
        """Hugging Face safetensors of the current weights in `<hf_export_folder>/step-<N>/`, published by rename."""
        self.wait()  # the export uses the checkpoint group too
        start = time.perf_counter()
        final = files.step_dir(self.hf_export_root, step)
        partial = final + files.PARTIAL_SUFFIX
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        extras = self.export_extras
        with quiet_single_process_dcp():
            save_hf(self.model_parts, partial, export_dtype(self.config), process_group=self.group, plain=plain_weights,
                    **(extras.model_config_fields if extras else {}))
        if self.rank == 0:
            if extras:
                write_export_extras(extras, partial)
            files.publish(partial, final)
            self._say(f"checkpoint: exported Hugging Face weights of step {step} to {final} "
                      f"in {time.perf_counter() - start:.2f} s")
        self._barrier()

    # ------------------------------------------------------------ loading
    def load(self) -> int:
        """Restores the newest complete checkpoint (or `load_step`) and returns its step; else, with
        `hf_load_path`, loads those weights; returns 0 when training starts fresh."""
        c = self.config
        step = self._choose() if c.enable and c.load_step != 0 else None
        if step is not None:
            self._load(step)
            return step
        if c.hf_load_path:
            start = time.perf_counter()
            with quiet_single_process_dcp():
                load_hf_weights(self.model_parts, c.hf_load_path, process_group=self.group)
            self._say(f"checkpoint: loaded Hugging Face weights from {c.hf_load_path} "
                      f"in {time.perf_counter() - start:.2f} s")
        return 0

    def _verify(self, step: int) -> str | None:
        """Collective: the first problem with checkpoint `step` (naming the file), or None. Sizes are checked by
        every rank, checksums split between the ranks."""
        directory = files.step_dir(self.folder, step)
        manifest, problem = files.read_manifest(directory)
        if problem is None:
            names = sorted(manifest["files"])
            problem = files.check_files(directory, manifest["files"], names[self.rank::self.world_size])
        problems = [p for p in self._gather(problem) if p]
        return min(problems) if problems else None

    def _choose(self) -> int | None:
        c = self.config
        steps = self._from_rank0(files.published_steps(self.folder))
        if c.load_step > 0 and c.load_step not in steps:
            raise RecipeError(f"checkpoint.load_step = {c.load_step}: '{files.step_dir(self.folder, c.load_step)}' "
                              f"does not exist or was never completed. Complete checkpoints: {steps or 'none'}.")
        candidates = [c.load_step] if c.load_step > 0 else list(reversed(steps))
        for step in candidates:
            problem = self._verify(step)
            if problem is None:
                newer = [s for s in steps if s > step]
                if newer:
                    self._say(f"resuming from step {step} although newer checkpoints exist: {newer}", warning=True)
                return step
            if c.load_step > 0:
                raise RecipeError(f"{problem}. Choose another checkpoint.load_step (complete: {steps}).")
            self._say(f"{problem}; falling back to the previous checkpoint", warning=True)
        if candidates:
            raise RecipeError(f"no usable checkpoint in '{self.folder}' (see the warnings above). Repair or move "
                              f"them, or set checkpoint.load_step = 0 to start fresh.")
        return None

    def _load(self, step: int) -> None:
        start = time.perf_counter()
        directory = files.step_dir(self.folder, step)
        reader = FileSystemReader(directory)
        stored = reader.read_metadata().state_dict_metadata
        if self.model_config is not None:
            check_model_shapes(stored, expected_model_shapes(self.model_config), directory)
        state = self._state(0)
        rng_key = f"rng.rank{self.rank}.cpu"
        if rng_key not in stored:  # saved by fewer ranks: keep this rank's seeded RNG
            del state["rng"]
        for name in list(state):
            if name in ("dataloader", *self.stateful) and not any(k.startswith(name + ".") or k == name
                                                                  for k in stored):
                raise RecipeError(f"checkpoint '{directory}' has no '{name}' state; it was written by another "
                                  f"trainer setup.")
        try:
            with quiet_single_process_dcp():
                dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=not self.distributed)
        except Exception as e:
            raise RuntimeError(f"loading checkpoint '{directory}' failed: {type(e).__name__}: {e}") from e
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=_OPTIMIZER_OPTIONS)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.dataloader is not None:
            self.dataloader.load_state_dict(state["dataloader"])
        for name, obj in self.stateful.items():
            obj.load_state_dict(state[name])
        if "rng" in state:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if state["train_state"]["step"] != step:
            raise RuntimeError(f"checkpoint '{directory}' holds step {state['train_state']['step']}, not {step}")
        self._say(f"checkpoint: resumed from {directory} (step {step}) in {time.perf_counter() - start:.2f} s")
