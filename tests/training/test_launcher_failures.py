"""The launcher's last line names the right cause of a rank's death: a rank torchrun stopped after a peer failed (its
SIGTERM, then SIGKILL for a rank stuck in a hang) is said to be stopped by torchrun, and the OOM line stays for a
SIGKILL nobody in the job sent (training/launcher.py: failure_line, RankStops)."""
import os
import signal
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.trainer_runs import ROOT, run_train
from training.launcher import failure_line


def _failure(rank: int, pid: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file=os.devnull)


def test_a_rank_torchrun_stopped_is_not_blamed_on_memory():
    failures = {0: _failure(0, 100, 1), 1: _failure(1, 101, -signal.SIGKILL)}
    line = failure_line(failures, stopped_pids={101}, recipe="recipes/debug.toml")
    assert "rank 0 failed first (exit code 1" in line and "rank 1 (SIGKILL)" in line, line
    assert "torchrun stopped" in line and "OOM" not in line, line


def test_a_sigkill_nobody_in_the_job_sent_keeps_the_oom_line():
    failures = {0: _failure(0, 100, -signal.SIGTERM), 1: _failure(1, 101, -signal.SIGKILL)}
    line = failure_line(failures, stopped_pids={100}, recipe="recipes/debug.toml")
    assert line.startswith("error: rank 1 was killed by signal 9 (SIGKILL), which the launcher did not send"), line
    assert "OOM killer" in line and "./run_train.sh recipes/debug.toml --dry-run" in line, line


def test_a_plain_failure_leaves_torchrun_its_own_summary():
    assert failure_line({0: _failure(0, 100, 1)}, stopped_pids={101}, recipe="recipes/debug.toml") is None


STOP_RANK_1 = textwrap.dedent("""
    # Test helper, on PYTHONPATH: rank 1 stops itself (SIGSTOP, as a process the kernel or a debugger froze) once
    # rank 0 has logged its first step, so rank 0 waits in its next collective until the collective timeout.
    import os, signal, threading, time
    if os.environ.get("RANK") == "1" and os.environ.get("STOP_AFTER_METRICS"):
        def _stop(path=os.environ["STOP_AFTER_METRICS"]):
            while not (os.path.exists(path) and os.path.getsize(path) > 0):
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Thread(target=_stop, daemon=True).start()
""")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hung_rank_is_reported_as_stopped_by_torchrun_not_as_oom(tmp_path):
    """Issue 58's case: rank 1 stops at step 2 of a 2-rank run; rank 0's collective times out (10 s), torchrun
    SIGTERMs the stopped rank and SIGKILLs it after the grace period. The last line names rank 0 as the first
    failure and rank 1 as stopped by torchrun; before the launcher told the two apart it blamed the OOM killer."""
    helper = tmp_path / "helper"
    helper.mkdir()
    (helper / "sitecustomize.py").write_text(STOP_RANK_1)
    out = tmp_path / "run"
    result = run_train(os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", str(out),
                       "--job.collective_timeout_s", "10", "--training.steps", "50",
                       "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable",
                       "false", nproc=2, timeout=360,
                       env={"PYTHONPATH": str(helper), "STOP_AFTER_METRICS": str(out / "metrics.jsonl"),
                            "STOP_GRACE_S": "5"})
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr[-3000:]
    assert last.startswith("error: rank 0 failed first") and "rank 1 (SIGKILL)" in last, result.stderr[-3000:]
    assert "OOM" not in last, last
