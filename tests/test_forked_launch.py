"""harness/forked_launch.py, the parity runs' one-interpreter launcher, when a rank fails: the others are stopped as
torchrun stops them, SIGTERM and then SIGKILL, so a run whose rank failed ends with that rank's exit code instead of
waiting on a peer blocked in a collective (the trainer notes SIGTERM and stops only at its next step)."""
from __future__ import annotations

import subprocess
import sys
import time

from tests.trainer_runs import ROOT


def fail_on_rank_1_and_carry_on_after_sigterm_on_rank_0() -> None:
    """forked_launch's before_rank: rank 1 fails at once; rank 0 ignores SIGTERM and waits, as a trainer rank blocked
    in a collective with the failed one would."""
    import os
    import signal

    if os.environ["RANK"] == "1":
        os._exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def test_a_rank_still_running_after_sigterm_is_killed_when_the_grace_ends():
    launch = ("import sys; from harness import forked_launch; forked_launch.STOP_GRACE_S = 2; "
              "from tests.test_forked_launch import fail_on_rank_1_and_carry_on_after_sigterm_on_rank_0 as hook; "
              "sys.exit(forked_launch.launch(2, ['--help'], hook))")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "rank 1 exited with 3; stopping the other ranks" in result.stderr, result.stderr[-2000:]
    assert "ranks [0] still running 2 s after SIGTERM; SIGKILL" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - start < 60
