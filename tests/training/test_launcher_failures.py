"""The launcher's last line names the right cause of a rank's death: a rank torchrun stopped after a peer failed (its
SIGTERM, then SIGKILL for a rank stuck in a hang) is said to be stopped by torchrun, and the OOM line stays for a
SIGKILL nobody in the job sent (training/launcher.py: failure_line, RankStops). A 2-rank run whose rank 1 froze
itself (SIGSTOP) gave this line, and the OOM line with the launcher's pid record removed (2026-12-02); that run is not
in the suite yet (tests/training/test_timeouts.py says why)."""
import os
import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

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
    assert line.startswith("error: rank 1 was killed by signal 9 (SIGKILL) from outside the run (the launcher "
                           "did not send it)"), line
    assert "OOM killer" in line and "./run_train.sh recipes/debug.toml --dry-run" in line, line


def test_a_plain_failure_leaves_torchrun_its_own_summary():
    assert failure_line({0: _failure(0, 100, 1)}, stopped_pids={101}, recipe="recipes/debug.toml") is None
