"""The checkpoint disk (training/checkpoint_disk.py): the launch check warns when the folder cannot hold
keep_latest_k + 1 checkpoints and refuses when not one fits; a failed save's OSError is found under DCP's wrapping
and becomes one line naming the step, the folder, the error, the free space and the checkpoint to resume from. The
2-rank run whose save hits a full disk is in tests/training/test_preemption.py (slow tier)."""
import errno
import os
import pickle

import pytest

from config import RecipeError
from config.recipe import load_config
from models.llama import recipe_model_config
from training import checkpoint_disk
from training.checkpoint_disk import (GIB, DiskErrorWriter, check_checkpoint_disk, checkpoint_bytes,
                                      disk_error, raise_if_disk_failure)


def recipe(tmp_path, *overrides):
    cfg = load_config("recipes/debug.toml", ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true",
                                             *overrides])
    return cfg, recipe_model_config(cfg)


def test_the_launch_check_warns_when_keep_latest_k_plus_one_do_not_fit_and_refuses_when_none_does(tmp_path,
                                                                                                   monkeypatch):
    cfg, model = recipe(tmp_path, "--checkpoint.keep_latest_k", "2")
    one = checkpoint_bytes(model, 2)
    assert 0.07 * GIB < one < 0.08 * GIB  # 6.2 M parameters x 12 bytes, and DCP's metadata
    monkeypatch.setattr(checkpoint_disk, "free_bytes", lambda folder: 3 * one)
    assert check_checkpoint_disk(cfg, model, 2) is None  # keep 2 + the one being written
    monkeypatch.setattr(checkpoint_disk, "free_bytes", lambda folder: 3 * one - 1)
    warning = check_checkpoint_disk(cfg, model, 2)
    assert warning.startswith(f"warning: checkpoint.folder '{tmp_path}/checkpoints' holds ")
    assert "keeping 3 at once (keep_latest_k + 1) needs" in warning and "the disk fills during the run" in warning
    monkeypatch.setattr(checkpoint_disk, "free_bytes", lambda folder: one - 1)
    with pytest.raises(RecipeError, match=r"has 0\.07 GiB free and one checkpoint is 0\.07 GiB .*not one save fits"):
        check_checkpoint_disk(cfg, model, 2)
    cfg.checkpoint.enable = False
    assert check_checkpoint_disk(cfg, model, 2) is None


def test_keep_all_counts_every_save_of_the_run(tmp_path, monkeypatch):
    cfg, model = recipe(tmp_path, "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "5")
    one = checkpoint_bytes(model, 2)
    monkeypatch.setattr(checkpoint_disk, "free_bytes", lambda folder: 4 * one)  # 20 steps: 5 saves at once
    assert "keeping 5 at once" in check_checkpoint_disk(cfg, model, 2)


class FakeCheckpointException(BaseException):
    """DCP's shape: a BaseException with {rank: (exception, stack summary)}."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:" + str(failures.keys()))
        self.failures = failures


def test_the_oserror_under_a_failed_save_becomes_one_line(tmp_path):
    folder = str(tmp_path / "checkpoints")
    os.makedirs(os.path.join(folder, "step-4.partial"))
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = FakeCheckpointException({1: (full, None)})
    assert disk_error(wrapped) is full and disk_error(RuntimeError("x")) is None
    with pytest.raises(Exception) as raised:
        raise_if_disk_failure(wrapped, 4, folder, rank=0)
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint: saving step 4 into '{folder}' failed: No space left on device (errno 28); ")
    assert "GiB free there; there is no complete checkpoint yet. Free space there" in line
    assert not os.path.exists(os.path.join(folder, "step-4.partial"))  # its bytes are free again
    raise_if_disk_failure(RuntimeError("not the disk"), 4, folder, rank=0)  # returns: the caller re-raises


def _short_write(self, plan, planner):
    """What torch.save raised on a really full disk (a 120 MiB tmpfs, tests/training/test_preemption.py): its zip
    writer's RuntimeError, the OSError only as its context."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def test_a_full_disk_under_torch_saves_runtimeerror_still_names_its_oserror_after_dcp_gathers_it(tmp_path,
                                                                                                monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "write_data", _short_write)
    for writer, found in ((FileSystemWriter, None), (DiskErrorWriter, errno.ENOSPC)):
        with pytest.raises(Exception) as raised:
            writer(str(tmp_path)).write_data(None, None)
        gathered = pickle.loads(pickle.dumps(raised.value))  # DCP gathers each rank's failure pickled: no context
        assert getattr(disk_error(gathered), "errno", None) == found, writer.__name__
