"""The checkpoint disk: how big one checkpoint is, whether the checkpoint folder's filesystem holds the checkpoints a
run keeps, and the one line a save that fails on the disk (no space, read-only, quota) stops the run with.

Why before the run: a full disk otherwise shows at the first save that does not fit, hours in, as a wall of DCP
traceback. The launch check (train.py --check) and the dry run compare `checkpoints_at_once` checkpoints (the
keep_latest_k kept plus the one being written before the oldest is pruned) with the free space: a warning when the
disk fills during the run, a refusal when not even one checkpoint fits.
"""
from __future__ import annotations

import os
import shutil

from torch.distributed.checkpoint import FileSystemWriter

from config import RecipeError
from training import checkpoint_files as files
from training.planning.workload import parameter_count

BYTES_PER_PARAMETER = 4 * 3
"""fp32 weights (the checkpoint's plain weights, whatever the compute dtype) and AdamW's two fp32 moments."""
METADATA_SHARE = 0.03
"""DCP's .metadata and per-tensor headers: 2.5% of the debug model's checkpoint, measured; rounded up."""
PER_RANK_BYTES = 1 << 20
"""Each rank's RNG states, the data-loader and scheduler state and its file's slack: well under 1 MiB."""
GIB = 1 << 30


def checkpoint_bytes(model_config, world: int) -> int:
    """One checkpoint of this model on `world` ranks, in all (every rank's files together)."""
    return int(parameter_count(model_config) * BYTES_PER_PARAMETER * (1 + METADATA_SHARE)) + world * PER_RANK_BYTES


def checkpoints_at_once(cfg) -> int:
    """The most checkpoints on disk during the run: keep_latest_k + 1 (the next one is written before the oldest is
    removed); every save of the run when keep_latest_k = 0 keeps them all."""
    c = cfg.checkpoint
    if c.keep_latest_k > 0:
        return c.keep_latest_k + 1
    return cfg.training.steps // c.interval + 1


def free_bytes(folder: str) -> int:
    """Free space of the filesystem that holds (or will hold) `folder`: its nearest existing ancestor's."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _existing_bytes(folder: str) -> int:
    """Bytes of the checkpoints already in the folder: they count among those kept, and are freed by pruning."""
    total = 0
    for step in files.published_steps(folder):
        for root, _, names in os.walk(files.step_dir(folder, step)):
            total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return total


def check_checkpoint_disk(cfg, model_config, world: int, nodes: int = 1) -> str | None:
    """Refuses (RecipeError) when not one checkpoint fits in the checkpoint folder's free space; returns a warning
    line when the checkpoints the run keeps at once do not, else None."""
    c = cfg.checkpoint
    if not c.enable:
        return None
    folder = os.path.join(cfg.job.dump_folder, c.folder)
    one, count = checkpoint_bytes(model_config, world), checkpoints_at_once(cfg)
    free = free_bytes(folder)
    room = free + _existing_bytes(folder)
    size = f"one checkpoint is {one / GIB:.2f} GiB ({one / nodes / GIB:.2f} GiB per node over {nodes} node(s))"
    if free < one:
        raise RecipeError(f"checkpoint.folder '{folder}' has {free / GIB:.2f} GiB free and {size}: not one save "
                          f"fits. Free space there or set checkpoint.folder (or job.dump_folder) on a larger disk.")
    if room < count * one:
        return (f"warning: checkpoint.folder '{folder}' holds {room / GIB:.2f} GiB (free and its checkpoints) and "
                f"{size}; keeping {count} at once (keep_latest_k + 1) needs {count * one / GIB:.2f} GiB, so the disk "
                f"fills during the run. Free space, lower checkpoint.keep_latest_k or use a larger disk.")
    return None


def disk_summary(cfg, model_config, world: int, nodes: int = 1) -> str:
    """The dry run's line: one checkpoint's size, the room the run needs and the folder's free space."""
    one, count = checkpoint_bytes(model_config, world), checkpoints_at_once(cfg)
    folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    return (f"checkpoints: {one / GIB:.2f} GiB each ({one / nodes / GIB:.2f} GiB per node over {nodes} node(s)), "
            f"{count} at once = {count * one / GIB:.2f} GiB; '{folder}' has {free_bytes(folder) / GIB:.2f} GiB free")


SAVE_GIB_PER_S_PER_NODE = 1.0
"""Write speed assumed for a save, per node: a parallel filesystem's share per node is often 1-5 GiB/s; 1 keeps
the lead on the safe side. Measure yours: the trainer prints each save's seconds ("checkpoint: saved step N ...")."""
LEAD_MARGIN_S = 30
"""Start-up of the save (state dicts, DCP's planning collectives) and the signal's way through srun and torchrun."""


def preemption_lead(step_s: float, model_config, world: int, nodes: int = 1) -> str:
    """The dry run's line: how long before the time limit SIGUSR1 must come for one more step and one save."""
    save_s = checkpoint_bytes(model_config, world) / nodes / GIB / SAVE_GIB_PER_S_PER_NODE
    lead = int(step_s + save_s + LEAD_MARGIN_S) + 1
    return (f"preemption: one step ({step_s:.1f} s) plus one save (~{save_s:.0f} s at {SAVE_GIB_PER_S_PER_NODE:g} GiB/s "
            f"per node) plus {LEAD_MARGIN_S} s: sbatch --signal=B:USR1@{max(lead, 60)} or more "
            f"(slurm/train.sbatch asks 300)")


def disk_error(error: BaseException) -> OSError | None:
    """The OSError under a failed save (DCP wraps each rank's in a CheckpointException, the async path in a
    RuntimeError), or None when the failure is not the disk's."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: exception or wrapped failure}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


class DiskErrorWriter(FileSystemWriter):
    """DCP's filesystem writer whose failed write raises the OSError under it (errno, strerror, file) itself.

    Why: on a really full disk torch.save reports the short write as a RuntimeError of its zip writer ("unexpected
    pos ..."), the OSError (ENOSPC) only its __context__; DCP pickles each rank's exception to gather them, which
    drops the context, and the one line would then have no OS error to name (a writer that raises ENOSPC itself
    never showed this: a real 120 MiB tmpfs did)."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            oserror = disk_error(e)
            if oserror is None or oserror is e:
                raise
            raise OSError(oserror.errno, oserror.strerror, oserror.filename) from e


DISK_EXIT_CODE = 74
"""A rank's exit code after a save failed on the disk (EX_IOERR); training/launcher.py exits with it quietly, the
one line printed (torchrun's failed-child report would bury it)."""


class CheckpointDiskError(RuntimeError):
    """A save failed on the disk; its message is the one line train.py prints."""


def raise_if_disk_failure(error: BaseException, step: int, folder: str, rank: int) -> None:
    """Raises the one-line CheckpointDiskError when `error` (from a save of `step`) is the disk's; rank 0 first
    removes the partial folder, so that its bytes are free again. Returns otherwise."""
    oserror = disk_error(error)
    if oserror is None:
        return
    if rank == 0:
        shutil.rmtree(files.step_dir(folder, step) + files.PARTIAL_SUFFIX, ignore_errors=True)
    raise save_failure(step, folder, oserror) from None


def save_failure(step: int, folder: str, error: OSError) -> CheckpointDiskError:
    steps = files.published_steps(folder)
    last = (f"the last complete checkpoint is step {steps[-1]} ({files.step_dir(folder, steps[-1])})" if steps
            else "there is no complete checkpoint yet")
    reason = error.strerror or str(error)
    return CheckpointDiskError(
        f"checkpoint: saving step {step} into '{folder}' failed: {reason} (errno {error.errno}); "
        f"{free_bytes(folder) / GIB:.2f} GiB free there; {last}. Free space there (or set checkpoint.folder on "
        f"another disk) and resume with the same command.")
