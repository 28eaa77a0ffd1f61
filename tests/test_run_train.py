"""The launcher as a user meets it: bad input fails in one line, and a real multi-rank run leaves its outputs."""
import os

import pytest

from harness.process_tree import trainer_ranks
from tests.trainer_runs import read_metrics, run_train, run_until


@pytest.mark.parametrize("args, nproc, expect", [
    (["missing.toml"], None, "'missing.toml' does not exist"),
    (["--traning.steps", "3"], None, "Did you mean 'training'"),
    (["--training.stepz", "3"], None, "Did you mean 'steps'"),
    (["--training.steps", "three"], None, "training.steps: expected an integer"),
    (["--parallelism.dp_shard", "2"], 3, "but 3 ranks were launched"),
    (["--data.corpus", "no/such/corpus.txt"], None, "no/such/corpus.txt"),
    (["--training.seq_len", "1"], None, "training.seq_len must be >= 2"),
    (["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--training.seq_len", "510"], None, "Use 512"),
    (["--parallelism.cp", "3", "--parallelism.dp_shard", "1", "--parallelism.cp_impl", "ulysses",
      "--training.seq_len", "516"], None, 'cp_impl = "ulysses" with cp 3'),
    (["--parallelism.cp_impl", "ulyses"], None, "parallelism.cp_impl"),
    (["--parallelism.attention_kernel", "cudnn"], None, 'parallelism.attention_kernel = "cudnn" cannot run here'),
    (["--parallelism.attention_kernel", "fa4"], None, "runs on CUDA GPUs and this run is on cpu"),
])
def test_bad_input_is_one_line(args, nproc, expect):
    result = run_train(*args, nproc=nproc, timeout=60)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def test_a_recipe_that_does_not_load_is_refused_before_torch_is_imported():
    """run_train.sh's first check (config/command_line.py): the recipe and its overrides loaded in a process that never
    imports torch, so a typo costs ~0.1 s instead of the ~2.5 s of importing torch and the trainer for the launcher's
    check; the line is train.py's own. Degrees against ranks, devices and data are still the launcher's check."""
    import subprocess
    import sys

    from harness.launch_env import ROOT, child_env

    code = ("import sys, config.command_line as c; code = c.main(sys.argv[1:]); print(code, 'torch' in sys.modules)")
    for args, expect in ((["missing.toml"], "error: recipe file 'missing.toml' does not exist"),
                         (["recipes/debug.toml", "--training.stepz", "3"], "Did you mean 'steps'")):
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                              env=child_env(), timeout=60)
        assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
        assert done.stderr.startswith("error: ") and expect in done.stderr and done.stderr.count("\n") == 1


def test_two_rank_run_writes_metrics_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the launcher sets it, so torchrun prints no banner
    out = str(tmp_path / "run")
    result = run_train("--training.steps", "3", "--training.seq_len", "128", "--training.local_batch_size", "2",
                       "--job.dump_folder", out, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    contract = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "seq_len", "cp", "global_batch_size",
                "memory"}
    assert contract <= set(records[0])
    assert records[0]["global_batch_size"] == 4 and records[0]["seq_len"] == 128
    assert records[0]["attention_kernel"] == "flash"  # "auto" on CPU: the flash-CPU op
    assert "attention kernel flash" in result.stdout
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in records)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out, "tb")))
    assert "step     3/3" in result.stdout
    assert "OMP_NUM_THREADS" not in result.stderr, result.stderr


LEARNED = 2.0
"""Nats the debug recipe's loss falls by (test_debug_recipe_learns)."""


@pytest.mark.slow
@pytest.mark.timeout(720)  # the run is allowed 600 s
def test_debug_recipe_learns(tmp_path):
    """Acceptance of the foundation: the default recipe on 2 ranks learns, its loss falling by at least LEARNED (the
    first step's loss against the mean of the last three logged) within the recipe's 20 steps. The run stops at the
    first step where that holds (a learning run that ends when its criterion is met): step 9 here, of 20, with
    LEARNED = 2.0 (the first version of this test asked 1.0 after all 20 steps; a run of all 20 fell by 2.97, and by
    2.0 or more from step 9 on: 8.21 at step 1, 5.69 / 5.87 / 6.00 at steps 8-10). The ranks are forked from one
    interpreter (harness/forked_launch.py, torchrun's environment): what the recipe learns is the subject; the launch
    through run_train.sh and torchrun is test_two_rank_run_writes_metrics_and_tensorboard's. Its CPU is mostly the
    steps themselves, ~3.5 CPU-s each for the two ranks: a profiled step is 93% kernels (matmuls 53%, the CPU flash
    attention 32%); TensorBoard's writes are not measurable (2026-12-05)."""
    out = str(tmp_path / "debug")

    def drop() -> float:
        try:
            losses = [r["loss"] for r in read_metrics(out)]
        except (FileNotFoundError, ValueError):  # not written yet, or a line caught half-written
            return 0.0
        return losses[0] - sum(losses[-3:]) / 3 if len(losses) >= 4 else 0.0

    stopped, code, output = run_until(["--job.dump_folder", out], lambda: drop() >= LEARNED, nproc=2, timeout=600,
                                      forked=True)
    assert stopped or code == 0, output[-3000:]
    losses = [r["loss"] for r in read_metrics(out)]
    assert drop() >= LEARNED and len(losses) <= 20, losses


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_killed_like_the_oom_killer_leaves_one_line(tmp_path):
    """SIGKILL, the OOM killer's signal, sent to one rank of a 2-rank run: the launcher's last stderr line names the
    signal, the rank and the dry run to try."""
    import signal
    import subprocess
    import sys
    import time

    from tests.trainer_runs import ROOT

    out = str(tmp_path / "run")
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2")
    launcher = subprocess.Popen([os.path.join(ROOT, "run_train.sh"), "--training.steps", "100000", "--job.dump_folder",
                                 out, "--training.seq_len", "128", "--metrics.enable_tensorboard", "false"], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.5)  # training has started when the first step is logged
        pids = trainer_ranks(launcher.pid)  # run_train.sh execs the launcher: same pid
        assert len(pids) == 2, pids
        os.kill(max(pids), signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: rank ") and "signal 9 (SIGKILL) from outside the run" in last, last
    assert "OOM killer" in last, last
    assert "./run_train.sh recipes/debug.toml --dry-run" in last, last


def test_the_tests_fork_exactly_the_modes_run_train_sh_execs_in_one_process():
    """tests/trainer_runs.run_train forks ONE_PROCESS_FLAGS' runs from the forkserver instead of running run_train.sh:
    right only while they are the flags for which run_train.sh execs `train.py "$@"` as it is."""
    from tests.trainer_runs import ONE_PROCESS_FLAGS, ROOT

    with open(os.path.join(ROOT, "run_train.sh")) as f:
        (line,) = [line for line in f if line.strip().startswith("case \"$arg\" in --help")]
    assert set(line.split(" in ", 1)[1].split(")", 1)[0].strip().split("|")) == ONE_PROCESS_FLAGS, line
