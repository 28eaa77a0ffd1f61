"""Surviving a dead rank (slow tier): with MAX_RESTARTS, torchrun restarts the job after a rank is SIGKILLed, and
the new job resumes from the newest complete checkpoint. The reference is the same recipe run without a kill (its ranks
forked, once per process: tests/training/paced_runs.py). The model is tiny (paced_runs.TINY): a restart's resume shows
at any size, and the debug model's steps were most of these runs' cost after the launches."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harness.launch_env import python_path
from harness.process_tree import rank_processes
from tests.trainer_runs import ROOT
from tests.training.paced_runs import (FREEZE_ITSELF, TINY, hook_folder, paced_hook, uninterrupted_losses,
                                       wrap_on_import)
from tests.training.test_checkpoint_runs import losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the module's uninterrupted run + a job allowed 400 s

ARGS = ["--training.steps", "20", "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "2",
        "--metrics.enable_tensorboard", "false", *TINY]

# Loaded by every Python process of the job through PYTHONPATH; only rank KILL_DURING_SAVE's first attempt acts on
# it: the rank dies once its file of the named checkpoint folder is written.
KILL_DURING_SAVE = wrap_on_import("torch.distributed.checkpoint.filesystem", "_FileSystemWriter.write_data", """
    _KDS_RANK, _, _KDS_FOLDER = os.environ.get("KILL_DURING_SAVE", "").partition(":")


    def wrap(original):
        def write_data(self, plan, planner):
            result = original(self, plan, planner)
            if str(self.path).endswith(_KDS_FOLDER):  # this rank's file is written; the others wait for it
                result.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return write_data
""", when='bool(_KDS_RANK) and os.environ.get("RANK") == _KDS_RANK and '
          'os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"')


def launch(folder: str, env_extra: dict | None = None, args: tuple = ()) -> subprocess.Popen:
    """ARGS (+ `args`, which must not change a number: timeouts, say) on 2 ranks with MAX_RESTARTS=1."""
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2", MAX_RESTARTS="1", **(env_extra or {}))
    return subprocess.Popen([os.path.join(ROOT, "run_train.sh"), *ARGS, *args, "--job.dump_folder", folder],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 400) -> tuple[str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"job did not finish in {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    assert process.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    return out, err


@pytest.fixture
def uninterrupted() -> dict[int, float]:
    return uninterrupted_losses(tuple(ARGS))


def worker_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The process of `rank` in the job of `launcher` (run_train.sh, which execs the launcher)."""
    return rank_processes(launcher.pid).get(rank)


def latest_step(folder: str) -> int:
    try:
        return max(losses(folder), default=0)
    except (FileNotFoundError, ValueError):  # not written yet, or a line caught half-written
        return 0


def test_sigkilled_rank_restarts_and_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    """The first attempt's steps sleep 0.5 s each (paced_runs.PACED_STEPS, a tiny step is too short for the test to
    kill rank 1 mid-run for sure), the restarted attempt runs at full speed."""
    folder = str(tmp_path / "run")
    hook = paced_hook(tmp_path / "hook")
    start = time.perf_counter()
    process = launch(folder, {"PYTHONPATH": python_path(hook), "PACED_STEP_S": "0.5",
                              "PACED_WHILE": "TORCHELASTIC_RESTART_COUNT=0"})
    while latest_step(folder) < 7:  # step 5's checkpoint is published before step 6 is logged
        assert process.poll() is None, "the job ended before the kill"
        time.sleep(0.05)
    pid = worker_pid(process, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed_at = latest_step(folder)
    killed_time = time.perf_counter()
    out, err = finish(process)
    total, after_kill = time.perf_counter() - start, time.perf_counter() - killed_time
    print(f"killed rank 1 after step {killed_at}; job finished {after_kill:.1f} s later ({total:.1f} s in all)")
    assert "resumed from" in out
    resumed = int(out.split("resumed from")[1].split("(step ")[1].split(")")[0])
    assert 5 <= resumed <= killed_at
    got = losses(folder)
    assert sorted(got) == list(range(1, 21))
    assert got == uninterrupted  # every step, those after the restart included, bit for bit


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    """Rank 1 dies after writing its part of step 10; the partial folder is ignored and step 5 is resumed."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_DURING_SAVE)
    folder = str(tmp_path / "run")
    start = time.perf_counter()
    process = launch(folder, {"KILL_DURING_SAVE": "1:step-10.partial",
                              "PYTHONPATH": python_path(str(hook))})
    out, err = finish(process)
    print(f"kill during the step-10 save: job finished in {time.perf_counter() - start:.1f} s")
    assert "saved step 10" in out  # by the restarted job: the first attempt died before publishing it
    assert out.index("saved step 5") < out.index("resumed from") < out.index("saved step 10")
    assert "(step 5)" in out.split("resumed from")[1].splitlines()[0]
    assert losses(folder) == uninterrupted
    assert sorted(os.listdir(os.path.join(folder, "checkpoints"))) == ["step-15", "step-20"]


def test_a_hung_rank_ends_the_attempt_and_the_restart_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    """Issue 58 item 5: rank 1 of the first attempt stops itself (SIGSTOP) before step 8's forward; rank 0's step
    collective times out (job.step_timeout_s 20), its hang line names rank 1 and says torchrun restarts, and the
    restart resumes from step 5's checkpoint and ends bit for bit as the uninterrupted run."""
    folder = str(tmp_path / "run")
    hook = hook_folder(tmp_path / "hook", FREEZE_ITSELF)
    start = time.perf_counter()
    process = launch(folder, {"PYTHONPATH": python_path(hook), "FREEZE_RANK": "1", "FREEZE_AT": "micro_step:8",
                              "FREEZE_WHILE": "TORCHELASTIC_RESTART_COUNT=0"},
                     args=("--job.init_timeout_s", "150", "--job.step_timeout_s", "20"))
    out, err = finish(process)
    print(f"rank 1 frozen at step 8: job finished in {time.perf_counter() - start:.1f} s")
    hang = [line for line in err.splitlines() if line.startswith("error: hang at step 8")]
    assert len(hang) == 1 and "rank 1 on " in hang[0] and "never arrived" in hang[0], err[-3000:]
    assert hang[0].endswith("; torchrun restarts the job (restart 1 of 1: MAX_RESTARTS)"), hang[0]
    assert "resume from " in hang[0] and "step-5" in hang[0], hang[0]
    assert "(step 5)" in out.split("resumed from")[1].splitlines()[0]
    assert losses(folder) == uninterrupted  # steps 1-7 of the first attempt, 6-20 of the restart: every one equal
