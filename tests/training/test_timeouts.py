"""Two collective timeouts (training/timeouts.py): the long job.init_timeout_s for set-up, each stage's warm-up
steps, checkpoints and evaluations; job.step_timeout_s (or 5x the measured warm-up step, at least 60 s) for the
training steps after those. The switching is checked against a recording stand-in for torch's `_set_pg_timeout`;
a real 2-rank run (slow tier) shows a rank slower than the step timeout in a warm-up step being waited for, and a
second, rank 1 frozen (SIGSTOP) after step 4, ends within the 20 s step timeout with the one line that names it
(training/rank_positions.py; its parts are tested in tests/training/test_rank_positions.py)."""
import os
import re
import time

import pytest

import training.timeouts as timeouts
from config import RecipeError
from config.recipe import load_config
from harness.launch_env import child_env
from tests.trainer_runs import ROOT, read_metrics, run_train
from tests.training.paced_runs import FREEZE_ITSELF, PACED_STEPS, TINY, hook_folder, wrap_on_import
from training.rank_positions import HANG_EXIT_CODE
from training.timeouts import CollectiveTimeouts, auto_step_timeout


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, timeout, group):
        self.calls.append((timeout.total_seconds(), group))

    def seconds(self) -> list[float]:
        return sorted({s for s, _ in self.calls})


@pytest.fixture
def recorded(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(timeouts.dist.distributed_c10d, "_set_pg_timeout", recorder)
    monkeypatch.setattr(timeouts.dist.distributed_c10d, "_get_default_group", lambda: "default")
    monkeypatch.setattr(timeouts, "mesh_groups", lambda mesh: {f"{mesh}:dp", f"{mesh}:cp"})
    return recorder


def test_long_until_the_warmup_steps_then_the_measured_step_timeout(recorded):
    lines = []
    t = CollectiveTimeouts(600, 0, log=lines.append)
    t.start_stage("stage0")
    assert recorded.calls and {s for s, _ in recorded.calls} == {600}
    assert {g for _, g in recorded.calls} == {"default", "stage0:dp", "stage0:cp"}
    recorded.calls.clear()
    t.step_done(40.0)  # step 1: builds, compiles; not a step's time
    assert recorded.calls == [] and t.current_s == 600
    t.step_done(20.0)
    assert t.current_s == 100.0 == auto_step_timeout([20.0]) and recorded.seconds() == [100.0]
    assert "collective timeout 100s from now on (5 x the warm-up step of 20.0s" in lines[0]
    recorded.calls.clear()
    t.step_done(500.0)  # later steps never move it
    assert recorded.calls == [] and t.current_s == 100.0
    with t.phase():  # a checkpoint save or an evaluation
        assert t.current_s == 600
    assert t.current_s == 100.0 and [s for s, _ in recorded.calls[::3]] == [600, 100.0]
    t.start_stage("stage1")  # a ramp's next stage: its own groups, long again, measured anew
    assert t.current_s == 600 and {g for _, g in recorded.calls[-3:]} == {"default", "stage1:dp", "stage1:cp"}
    t.step_done(1.0)
    t.step_done(1.0)
    assert t.current_s == 60.0  # the floor


def test_a_set_step_timeout_wins_and_phases_inside_the_warmup_stay_long(recorded):
    t = CollectiveTimeouts(900, 45, log=None)
    t.start_stage("s")
    with t.phase():
        pass
    assert t.current_s == 900
    t.step_done(1000.0)
    t.step_done(1000.0)
    assert t.current_s == 45
    with pytest.raises(RuntimeError), t.phase():  # a save's collective timed out: the hang line's timeout is 900
        raise RuntimeError("Timed out waiting 900000ms")
    assert t.current_s == 900


def test_the_old_key_and_bad_values_are_refused_in_one_line():
    recipe = os.path.join(ROOT, "recipes", "debug.toml")
    with pytest.raises(RecipeError, match=r"debug.toml\): job.collective_timeout_s was split in two: job.init_timeout_s"
                                          r".*job.step_timeout_s .*set those instead"):
        load_config(recipe, ["--job.collective_timeout_s", "30"])
    with pytest.raises(RecipeError, match="job.step_timeout_s must be >= 0"):
        load_config(recipe, ["--job.step_timeout_s", "-1"])
    with pytest.raises(RecipeError, match="job.init_timeout_s must be >= 1"):
        load_config(recipe, ["--job.init_timeout_s", "0"])
    cfg = load_config(recipe, [])
    assert (cfg.job.init_timeout_s, cfg.job.step_timeout_s) == (600, 0)


FREEZE_RANK_1 = wrap_on_import("training.step", "micro_step", """
    # FREEZE_AFTER_LINES / FREEZE_S: once FREEZE_METRICS holds that many records, a helper process freezes rank 1
    # (SIGSTOP, as a process the kernel or a debugger stopped) for FREEZE_S seconds. Started at the rank's first
    # micro-step, off its output pipes, in its process group (torchrun's kill of the rank's group ends it too).
    import subprocess, textwrap

    _FREEZER = '''
        import os, signal, sys, time
        rank, path, lines, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        alive = lambda: os.path.exists(f"/proc/{rank}")
        while alive() and not (os.path.exists(path) and open(path).read().count(chr(10)) >= lines):
            time.sleep(0.05)
        if alive():
            os.kill(rank, signal.SIGSTOP)
            end = time.monotonic() + seconds
            while alive() and time.monotonic() < end:
                time.sleep(0.2)
            if alive():
                os.kill(rank, signal.SIGCONT)
    '''


    def wrap(micro_step):
        started = []

        def freezing(*args, **kwargs):
            if not started:
                started.append(subprocess.Popen(
                    [sys.executable, "-c", textwrap.dedent(_FREEZER), str(os.getpid()), os.environ["FREEZE_METRICS"],
                     os.environ["FREEZE_AFTER_LINES"], os.environ["FREEZE_S"]],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            return micro_step(*args, **kwargs)
        return freezing
""", when='os.environ.get("RANK") == "1" and bool(os.environ.get("FREEZE_AFTER_LINES"))')
SLEEP_AT_MICRO_STEP = wrap_on_import("training.step", "micro_step", """
    def wrap(micro_step):
        calls = [0]

        def slow(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(os.environ["SLEEP_AT_MICRO_STEP"]):
                time.sleep(float(os.environ["SLEEP_S"]))
            return micro_step(*args, **kwargs)
        return slow
""", when='os.environ.get("RANK") == "1" and bool(os.environ.get("SLEEP_AT_MICRO_STEP"))')
"""Rank 1 sleeps SLEEP_S before its SLEEP_AT_MICRO_STEP-th micro-step: a slow rank that comes back (a SIGSTOPped one
that is continued can find a socket call interrupted)."""


def _run_with_rank_1(tmp_path, steps: int, *shape: str, **env):
    helper = hook_folder(tmp_path / "helper", FREEZE_RANK_1, SLEEP_AT_MICRO_STEP, PACED_STEPS)
    out = tmp_path / "run"
    result = run_train(os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", str(out),
                       "--job.init_timeout_s", "150", "--job.step_timeout_s", "20", "--training.steps", str(steps),
                       "--metrics.enable_tensorboard", "false", *shape, nproc=2, timeout=400,
                       env=child_env(str(helper), **{"FREEZE_METRICS": str(out / "metrics.jsonl"),
                                                     "STOP_GRACE_S": "5", **{k: str(v) for k, v in env.items()}}))
    return result, str(out)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_rank_slower_than_the_step_timeout_in_a_warmup_step_is_waited_for(tmp_path):
    """The same 20 s step timeout, rank 1 asleep for 45 s before its second step (the stage's last warm-up
    step): the warm-up steps run under the 150 s init timeout, so the run finishes all its steps. (20 s, not less:
    on a loaded 2-core CI box a healthy step's collective can wait several seconds for the other rank.) The tiny
    model (paced_runs.TINY): the subject is which timeout a collective waits under, and the sleep sets the pace."""
    result, out = _run_with_rank_1(tmp_path, 6, *TINY, SLEEP_AT_MICRO_STEP=2, SLEEP_S=45)
    assert "collective timeout 20s from now on (job.step_timeout_s)" in result.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_frozen_rank_is_named_in_one_line_within_the_step_timeout(tmp_path):
    """Rank 1 frozen (SIGSTOP) once step 4's record is written: rank 0 waits its 20 s step timeout and the run ends
    with one line naming rank 1, where it was and where rank 0 waited, never the OOM killer; rank 0's traceback is in
    the named folder; the frozen rank is killed after HANG_GRACE_S, not the save-on-signal grace (600 s here). The
    tiny model, its steps paced at 0.5 s (paced_runs.PACED_STEPS, after each step's record) so that the freezer, which
    reads the records every 0.05 s, stops rank 1 in step 4 or 5 as with the debug model's 1.5-s steps."""
    result, out = _run_with_rank_1(tmp_path, 12, *TINY, FREEZE_AFTER_LINES=4, FREEZE_S=400, STOP_GRACE_S="600",
                                   PACED_STEP_S="0.5")
    ended = time.time()
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    # Where exactly depends on when the freezer saw the 4th record: rank 1 in step 4's last collectives, or in step
    # 5's data or first micro-step (rank 0 can pass none of step 5's collectives without it).
    assert re.fullmatch(r"error: hang at step [45] \(.+\): rank 1 on \S+ \(last at step [45] \(.+\); heartbeat "
                        r"\d+s old\) never arrived; rank\(s\) 0 waited 20s \(the collective timeout\) and stopped "
                        r"the run; no checkpoint to resume from yet; tracebacks in .+", last), last
    assert "OOM" not in result.stderr and f"tracebacks in {out}/hang" in last, last
    with open(os.path.join(out, "hang", "rank_0.txt")) as f:
        assert "Timed out" in f.read()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert ended - os.path.getmtime(os.path.join(out, "metrics.jsonl")) <= 20 + 30  # step timeout + 30 s


HANG_LINE = (r"error: hang at step {step} \({phase}.*\): rank {rank} on \S+ \(last at step {step} \({where}.*\); "
             r"heartbeat \d+s old\) never arrived; rank\(s\) {waited} waited {timeout}s \(the collective timeout\) "
             r"and stopped the run; (no checkpoint to resume from yet|resume from \S+); tracebacks in .+")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("nproc, rank, at, step, phase, where, waited, timeout", [
    (4, 2, "micro_step:5", 5, "forward/backward", "forward/backward", "0-1, 3", 20),
    (2, 1, "data:6", "[56]", "forward/backward", "data", "0", 20),
    (2, 1, "save:2", 6, "checkpoint", "checkpoint", "0", 60),
], ids=["1 of 4 ranks mid-step", "in its data-loader worker", "in a checkpoint save"])
def test_a_rank_that_stops_itself_is_named_in_one_line(tmp_path, nproc, rank, at, step, phase, where, waited,
                                                       timeout):
    """Issue 58: one rank stops itself (SIGSTOP; tests/training/paced_runs.FREEZE_ITSELF) at a known place: rank 2 of
    4 before step 5's forward; rank 1's data-loader worker at step 6's plan (the rank waits for a batch, its
    heartbeat alive: named for being behind, at step 6's data, or step 5's when the worker stopped before its queue's
    feeder thread had sent batch 5); rank 1 in step 6's checkpoint save (checkpoint every
    3 steps), which runs under the long timeout (job.init_timeout_s, 60 s here). Each run ends within that timeout +
    30 s with the one line naming the stopped rank, its step and phase, never the OOM killer. The model is tiny
    (paced_runs.TINY): where a rank stopped shows at any size."""
    out = tmp_path / "run"
    env = {"FREEZE_RANK": str(rank), "FREEZE_AT": at, "STOP_GRACE_S": "600"}
    result = run_train(os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", str(out),
                       "--job.init_timeout_s", "60", "--job.step_timeout_s", "20", "--training.steps", "12",
                       "--training.seq_len", "128", "--training.local_batch_size", "2", "--checkpoint.enable", "true",
                       "--checkpoint.interval", "3", "--metrics.enable_tensorboard", "false",
                       "--parallelism.dp_shard", str(nproc), *TINY, nproc=nproc, timeout=300,
                       env=child_env(hook_folder(tmp_path / "hook", FREEZE_ITSELF), **env))
    ended = time.time()
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(HANG_LINE.format(step=step, phase=phase, rank=rank, where=where, waited=waited,
                                         timeout=timeout), last), last
    assert "OOM" not in result.stderr and f"tracebacks in {out}/hang" in last, last
    hung_at = int(last.split("hang at step ")[1].split()[0])
    logged = hung_at if phase == "checkpoint" else hung_at - 1  # a step's record is written before its save
    assert [r["step"] for r in read_metrics(str(out))] == list(range(1, logged + 1))
    assert ended - os.path.getmtime(os.path.join(out, "metrics.jsonl")) <= timeout + 30
