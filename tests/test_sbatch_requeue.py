"""slurm/train.sbatch's decision once its job step has ended, by the launcher's exit code: 75 (the ranks saved their
step on USR1) requeues; 76 (a collective timed out and no restart was left: training/rank_positions.HANG_EXIT_CODE)
requeues up to MAX_HANG_REQUEUES times per job, then ends the job; anything else ends it. The script runs as
written, with `srun` and `scontrol` replaced by stubs on PATH (the step's exit code is the test's; `scontrol
requeue` is written down): the real-cluster tests (tests/test_slurm.py, slow tier) cover the USR1 and hang paths end
to end."""
from __future__ import annotations

import os
import subprocess

import pytest

from training.rank_positions import HANG_EXIT_CODE
from training.preemption import EXIT_CODES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUBS = {
    "srun": """#!/usr/bin/env bash
case " $* " in *" hostname "*) echo 127.0.0.1; exit 0;; esac
exit "$STEP_STATUS"
""",
    "scontrol": """#!/usr/bin/env bash
if [ "$1" = show ]; then echo node1; exit 0; fi
echo "$*" >> "$SCONTROL_LOG"
""",
}


def _submit(tmp_path, status: int, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    """One allocation of job 42: the script with the step ending in `status`; (its result, scontrol's calls)."""
    stubs, repo = tmp_path / "bin", tmp_path / "repo"
    stubs.mkdir(exist_ok=True)
    (repo / "slurm" / "logs").mkdir(parents=True, exist_ok=True)
    (repo / "run_train.sh").write_text("#!/usr/bin/env bash\n")
    (repo / "run_train.sh").chmod(0o755)
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    log = tmp_path / "scontrol.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(["bash", os.path.join(ROOT, "slurm", "train.sbatch"), "recipes/debug.toml"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", REPO=str(repo),
                                   SLURM_JOB_ID="42", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1",
                                   STEP_STATUS=str(status), SCONTROL_LOG=str(log), **env))
    return done, log.read_text().splitlines() if log.exists() else []


def test_a_hang_requeues_up_to_max_hang_requeues_then_ends_the_job(tmp_path):
    assert HANG_EXIT_CODE == 76  # the code the script tests for
    for attempt in (1, 2):
        done, calls = _submit(tmp_path, HANG_EXIT_CODE)
        assert done.returncode == HANG_EXIT_CODE and calls == ["requeue 42"], (done.stdout, done.stderr)
        assert f"(hang requeue {attempt} of 2)" in done.stdout, done.stdout
    done, calls = _submit(tmp_path, HANG_EXIT_CODE)
    assert done.returncode == HANG_EXIT_CODE and calls == [], done.stdout
    assert "after 2 hang requeue(s) (MAX_HANG_REQUEUES): the job ends" in done.stdout, done.stdout
    assert not _hang_counter(tmp_path).exists()  # the job ended for good: its count goes with it


def _hang_counter(tmp_path):
    return tmp_path / "repo" / "slurm" / "logs" / ".hang-requeues-42"


def test_a_job_that_ends_after_a_hang_requeue_leaves_no_count_behind(tmp_path):
    """Job ids come round again (a cluster's counter reset, the tests' own clusters): a count left by an ended job
    would cut a later job's hang requeues short."""
    _submit(tmp_path, HANG_EXIT_CODE)
    assert _hang_counter(tmp_path).read_text().strip() == "1"
    _submit(tmp_path, EXIT_CODES["SIGUSR1"])  # requeued on the time limit: the job goes on, so does its count
    assert _hang_counter(tmp_path).exists()
    _submit(tmp_path, 0)
    assert not _hang_counter(tmp_path).exists()


@pytest.mark.parametrize("status, requeued", [(EXIT_CODES["SIGUSR1"], True), (0, False), (1, False), (74, False)])
def test_only_a_saved_step_or_a_hang_requeues(tmp_path, status, requeued):
    done, calls = _submit(tmp_path, status)
    assert done.returncode == status and calls == (["requeue 42"] if requeued else []), (done.stdout, done.stderr)


def test_max_hang_requeues_0_never_requeues_a_hang(tmp_path):
    done, calls = _submit(tmp_path, HANG_EXIT_CODE, MAX_HANG_REQUEUES="0")
    assert calls == [] and "after 0 hang requeue(s)" in done.stdout, done.stdout
