"""Preemption and the time limit (slow tier): SIGTERM or SIGUSR1, sent to torchrun, to one rank or to every process
of the run at once (as Slurm signals a job step), makes a 2-rank run save the step in progress and stop in one line;
resuming with the same command gives every step's loss bit for bit as the same run uninterrupted.

The runs are of a tiny model (tests/training/paced_runs.py: the properties show at any size, and the debug model's
steps were most of the cost after the launches); the runs that are signalled after a given step sleep PACED_STEP_S
after each step, so that the signal falls in the step the test aims at without a core spent on it. The signal tests
launch through run_train.sh (torchrun: the signals' way through the launcher is their subject); the SIGKILL test,
whose subject is what a killed run leaves on disk, forks its ranks from one interpreter (harness/forked_launch.py):
one import per launch instead of four processes' (~10 CPU s a launch on a 2-core box)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from harness.launch_env import child_env
from harness.process_tree import finish as finish_run, group_processes, trainer_ranks
from harness import forked_launch
from tests.trainer_runs import ROOT, read_metrics, short_documents_recipe
from tests.training.paced_runs import TINY, hook_folder, paced_hook, uninterrupted_losses, wrap_on_import
from tests.training.test_checkpoint_runs import losses

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 20  # one uninterrupted reference serves the full-disk and SIGKILL tests' plain runs; the signal test: CP 2
ARGS = ["--training.steps", str(STEPS), "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--metrics.enable_tensorboard", "false",
        *TINY]
CP2_DOCUMENTS = ["--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--data.document_masking", "true",
                 "--parallelism.cp_load_balancer", "documents", "--training.local_batch_size", "1"]
ASYNC = ("--checkpoint.interval", "2", "--checkpoint.async_mode", "async")
TARGETS = ("torchrun", "one rank", "every process")
EXIT = {signal.SIGTERM: 0, signal.SIGUSR1: 75}  # a clean stop; "requeue me" (EX_TEMPFAIL)
PACED_STEP_S = "0.5"
"""The sleep after each step of a signalled run: the test, polling metrics.jsonl every 50 ms, signals well within
it, and a slow reaction on a loaded box only moves the save a step later (STEPS leaves room for that)."""


def launch(folder: str, *extra: str, recipe: tuple = (), first: tuple = (), paced: bool = False) -> subprocess.Popen:
    """run_train.sh on 2 ranks; `first`: folders ahead on PYTHONPATH (a test's sitecustomize.py hook); `paced`:
    each step sleeps PACED_STEP_S (tests/training/paced_runs.py's hook, which `first` then must hold)."""
    env = child_env(*first, base=dict(os.environ, PYTHON=sys.executable, NPROC="2",
                                      PACED_STEP_S=PACED_STEP_S if paced else "0"))
    return subprocess.Popen([os.path.join(ROOT, "run_train.sh"), *recipe, *ARGS, *extra, "--job.dump_folder", folder],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def forked(folder: str, *extra: str) -> subprocess.Popen:
    """The same run on 2 ranks forked from one interpreter (harness/forked_launch.py), in a session of its own."""
    return subprocess.Popen(forked_launch.command(2, [*ARGS, *extra, "--job.dump_folder", folder]), cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    return finish_run(process, timeout)


def logged_step(folder: str) -> int:
    try:
        return max(losses(folder), default=0)
    except (FileNotFoundError, ValueError):  # not written yet, or a line caught half-written
        return 0


def ranks(process: subprocess.Popen) -> list[int]:
    """The trainer ranks (the rank starter's children, or torchrun's with RANK_START=exec)."""
    return trainer_ranks(process.pid)


def uninterrupted(extra: tuple = (), recipe: tuple = ()) -> dict[int, float]:
    """A configuration's losses without a signal (forked ranks, once per process: tests/training/paced_runs.py)."""
    return uninterrupted_losses((*recipe, *ARGS, *extra))


@pytest.fixture(scope="module")
def hook(tmp_path_factory) -> tuple[str]:
    """PYTHONPATH's first folder for the paced runs."""
    return (paced_hook(tmp_path_factory.mktemp("paced")),)


def assert_published(folder: str, step: int) -> None:
    """`checkpoints/step-<step>/` is there under its final name, with a manifest listing DCP's .metadata and every
    file it lists at its written size, and no partial folder of that step is left."""
    final = os.path.join(folder, "checkpoints", f"step-{step}")
    with open(os.path.join(final, "checkpoint.json")) as f:
        files = json.load(f)["files"]
    assert ".metadata" in files and len(files) > 1, files
    assert all(os.path.getsize(os.path.join(final, name)) == entry["bytes"] for name, entry in files.items())
    assert not os.path.exists(final + ".partial")


def interrupt(folder: str, sig: signal.Signals, target: str, *extra: str, after: int, hook: tuple, recipe: tuple = (),
              resumed: int = 0) -> int:
    """One case: launch (resuming from step `resumed` when it is not 0), send `sig` to `target` once step `after`
    is logged, and check what a signal must give: exit code, under 30 s, the one line, the step in progress published
    and the last one logged, no traceback. Returns the step saved."""
    case = f"{sig.name} to {target}"
    process = launch(folder, *extra, recipe=recipe, first=hook, paced=True)
    while logged_step(folder) < after:
        assert process.poll() is None, f"{case}: the run ended before the signal:\n" + process.communicate()[1][-3000:]
        time.sleep(0.05)
    pids = {"torchrun": [process.pid], "one rank": ranks(process)[-1:],
            "every process": sorted(group_processes(process.pid))}[target]
    assert pids, case
    sent = time.perf_counter()
    for pid in pids:
        os.kill(pid, sig)
    code, out, err = finish(process, timeout=60)
    took = time.perf_counter() - sent
    said = f"{case} ({len(pids)} process(es)) after step {after}: exit {code} after {took:.1f} s"
    print(said)
    assert code == EXIT[sig], f"{said}\n{out[-2000:]}{err[-3000:]}"
    assert took < 30, said
    if resumed:
        assert f"(step {resumed})" in out, f"{case}: not resumed from step {resumed}:\n{out[-2000:]}"
    lines = [line for line in out.splitlines() if "; resume with the same command" in line]
    assert len(lines) == 1, f"{case}:\n{out[-3000:]}"
    step = int(lines[0].split("saved step ")[1].split(" ")[0])
    assert lines[0] == f"checkpoint: saved step {step} on {sig.name}; resume with the same command"
    assert after <= step < STEPS, (case, after, step)
    assert_published(folder, step)
    assert [r["step"] for r in read_metrics(folder)][-1] == step, case  # the step saved is the last one logged
    assert "Traceback" not in err, f"{case}:\n{err[-3000:]}"
    return step


def resume_to_the_end(folder: str, step: int, *extra: str, recipe: tuple = ()) -> dict[int, float]:
    code, out, err = finish(launch(folder, *extra, recipe=recipe))
    assert code == 0, out[-2000:] + err[-3000:]
    assert f"(step {step})" in out, out[-2000:]
    return losses(folder)


def test_sigterm_and_sigusr1_to_torchrun_one_rank_and_every_process_save_and_resume_bit_identically(tmp_path, hook):
    """The six cases (two signals x three targets) on ONE run, one after another: each relaunch resumes from the
    checkpoint the previous signal saved (a resume is checked six times over) and is itself signalled by the next
    case, a step or more after its resume; the last case's run saves asynchronously at intervals (every 2 steps),
    one of which may be in flight at the signal: it is published first. Each segment's losses equal the uninterrupted
    run's as it goes; the last relaunch finishes, and every step's loss is the uninterrupted run's, bit for bit.
    The run is CP 2 with documents (its sequences split by the documents layout), so this test also holds what
    test_cp2_with_documents_saves_on_either_signal_and_resumes_bit_identically checked (SIGTERM to every process and
    SIGUSR1 to torchrun on that run, resumed bit for bit), merged here: that test's three torchrun launches and its
    reference repeated these cases. The seventh launch of its own the asynchronous saves had is the sixth case's."""
    recipe = (short_documents_recipe(str(tmp_path)),)
    reference = uninterrupted(tuple(CP2_DOCUMENTS), recipe)
    folder = str(tmp_path / "run")
    cases = [(sig, target) for sig in EXIT for target in TARGETS]
    step = 0
    for sig, target in cases:
        extra = (*CP2_DOCUMENTS, *(ASYNC if (sig, target) == cases[-1] else ()))
        step = interrupt(folder, sig, target, *extra, after=max(step + 1, 3), hook=hook, recipe=recipe, resumed=step)
        assert losses(folder) == {s: reference[s] for s in range(1, step + 1)}, f"{sig.name} to {target}"
    assert resume_to_the_end(folder, step, *CP2_DOCUMENTS, recipe=recipe) == reference


# Loaded by every Python process of the run through PYTHONPATH: rank 1's write of the step-4 checkpoint fails as a
# full disk does (the same OSError an ENOSPC write raises), after the step-2 checkpoint was saved.
DISK_FULL_AT_STEP_4 = wrap_on_import("torch.distributed.checkpoint.filesystem", "_FileSystemWriter.write_data", """
    import errno


    def wrap(original):
        def write_data(self, plan, planner):
            if str(self.path).endswith("step-4.partial"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return original(self, plan, planner)
        return write_data
""", when='os.environ.get("RANK") == "1"')


TMPFS_MIB = 9
"""One checkpoint of the tiny model on 2 ranks is 5.3 MB on disk (the launch check's estimate, 7.4 MB, fits too, so
the check warns and does not refuse): the step-2 save fits, step 4's beside it does not."""


def may_mount_tmpfs(probe: str) -> bool:
    """Whether this test may mount a tmpfs in a mount namespace of its own (root with unshare: not every container)."""
    if not shutil.which("unshare"):
        return False
    os.makedirs(probe, exist_ok=True)
    return subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=1m",
                           "tmpfs", probe], capture_output=True).returncode == 0


def full_tmpfs_runs(tmp_path, folder: str) -> tuple[str, tuple, list, tuple]:
    """In a mount namespace of the test's own: a TMPFS_MIB tmpfs as checkpoint.folder, the run saving every 2 steps
    into it; then (the disk grown as a user would free space) the same command again. The tmpfs lives as long as the
    namespace, so both runs and a listing of the folder between them happen in one shell."""
    disk, said = str(tmp_path / "disk"), tmp_path / "said"
    os.makedirs(disk)
    said.mkdir()
    command = shlex.join([os.path.join(ROOT, "run_train.sh"), *ARGS, "--checkpoint.interval", "2",
                          "--checkpoint.folder", disk, "--job.dump_folder", folder])
    to = {name: shlex.quote(str(said / name)) for name in ("1.out", "1.err", "1.code", "ls", "2.out", "2.err",
                                                          "2.code")}
    script = (f"mount -t tmpfs -o size={TMPFS_MIB}m tmpfs {shlex.quote(disk)} || exit 99\n"
              f"{command} >{to['1.out']} 2>{to['1.err']}; echo $? >{to['1.code']}\n"
              f"ls {shlex.quote(disk)} >{to['ls']}\n"
              f"mount -o remount,size=1g {shlex.quote(disk)} || exit 98\n"
              f"{command} >{to['2.out']} 2>{to['2.err']}; echo $? >{to['2.code']}\n")
    env = child_env(base=dict(os.environ, PYTHON=sys.executable, NPROC="2"))
    shell = subprocess.Popen(["unshare", "-m", "--propagation", "private", "bash", "-c", script], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    code, out, err = finish(shell, timeout=600)
    assert code == 0, f"the tmpfs shell: exit {code}\n{out[-2000:]}{err[-2000:]}"
    read = {name: (said / name).read_text() for name in to}
    return (disk, (int(read["1.code"]), read["1.out"], read["1.err"]), read["ls"].split(),
            (int(read["2.code"]), read["2.out"], read["2.err"]))


def hooked_disk_runs(tmp_path, folder: str) -> tuple[str, tuple, list, tuple]:
    """Where no tmpfs may be mounted: rank 1's step-4 write raises ENOSPC (DISK_FULL_AT_STEP_4), then the same
    command again without the hook."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DISK_FULL_AT_STEP_4)
    first = finish(launch(folder, "--checkpoint.interval", "2", first=(str(hook),)), timeout=300)
    disk = os.path.join(folder, "checkpoints")
    listing = os.listdir(disk)
    return disk, first, listing, finish(launch(folder, "--checkpoint.interval", "2"))


def test_a_save_on_a_full_disk_stops_in_one_line_and_the_earlier_checkpoint_resumes(tmp_path):
    """A real full filesystem (a small tmpfs) where the test may mount one, else a writer that raises ENOSPC: the
    launch check warned (tmpfs: its real free space), the save of step 4 stops the run in one line, the partial
    folder is gone, and the same command (with room again) resumes from step 2 with the uninterrupted losses."""
    reference = uninterrupted()
    folder = str(tmp_path / "run")
    tmpfs = may_mount_tmpfs(str(tmp_path / "probe"))
    disk, (code, out, err), listing, (code2, out2, err2) = (full_tmpfs_runs if tmpfs else hooked_disk_runs)(
        tmp_path, folder)
    print(f"full disk: {'a ' + str(TMPFS_MIB) + ' MiB tmpfs' if tmpfs else 'ENOSPC raised by a hook'}")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 74 and len(errors) == 1, out[-2000:] + err[-4000:]
    assert errors[0].startswith(f"error: checkpoint: saving step 4 into '{disk}' failed: No space left on device "
                                f"(errno 28); "), errors[0]
    assert f"the last complete checkpoint is step 2 ({disk}/step-2)" in errors[0]
    assert "Traceback" not in err and "CheckpointException" not in err, err[-4000:]
    assert sorted(listing) == ["step-2"]  # the partial one removed
    if tmpfs:  # 9 MiB cannot hold keep_latest_k + 1 = 4 checkpoints
        assert f"warning: checkpoint.folder '{disk}' holds {TMPFS_MIB / 1024:.2f} GiB" in out + err, (out + err)[-3000:]

    assert code2 == 0, out2[-2000:] + err2[-3000:]
    assert "(step 2)" in out2
    assert losses(folder) == reference


KILLS = 4
"""Kills of the random-instant test: two at a random instant, two in the middle of a save. What the test proves (a
torn metrics line and a half-written checkpoint are both met and survived, the losses bit-identical at the end)
needs each kind more than once, not five times: each kill is a relaunch (ten cost CI ~170 s, six ~100 s)."""


def saving(folder: str) -> bool:
    """A save is under way: its `step-<N>.partial/` folder exists (it is renamed when complete)."""
    try:
        return any(name.endswith(".partial") for name in os.listdir(os.path.join(folder, "checkpoints")))
    except FileNotFoundError:
        return False


def test_a_run_sigkilled_at_random_instants_resumes_every_time_and_matches(tmp_path):
    """Every process of the run SIGKILLed (as a node dies) KILLS times after the relaunched run logged its first new
    step: the odd kills at a random instant of the step cycle that follows (with a save and a log write every step
    they fall in steps, saves and log writes; the cycle is timed first, as the step's length differs by machine and
    load), the even ones as soon as the next save's partial folder appears (in the middle of a save, for sure).
    Every relaunch must resume (a torn metrics line, a half-written checkpoint left behind) and the losses at the end
    equal an uninterrupted run's bit for bit. The ranks are forked from one interpreter (what a killed run leaves is
    the subject, not torchrun: the signal tests above cover the launcher)."""
    import random

    reference = uninterrupted()
    folder = str(tmp_path / "run")
    every_step = ("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2")
    chance = random.Random(49)
    kills, said = [], ""
    for kill in range(KILLS):
        before = logged_step(folder)
        process = forked(folder, *every_step)
        while logged_step(folder) <= before:
            assert process.poll() is None, f"relaunch {kill} ended:\n" + process.communicate()[1][-3000:]
            time.sleep(0.005)
        delay = 0.0
        if kill % 2:  # one step-save-log cycle timed, then a random instant of the next
            first, start = logged_step(folder), time.perf_counter()
            while logged_step(folder) <= first:
                assert process.poll() is None, "the run finished before its kill: raise STEPS"
                time.sleep(0.005)
            delay = chance.uniform(0, time.perf_counter() - start)
            time.sleep(delay)
        while not (kill % 2 or saving(folder)):
            assert process.poll() is None, "the run finished before its kill: raise STEPS"
            time.sleep(0.005)
        assert process.poll() is None, "the run finished before its kill: raise STEPS"
        in_save = saving(folder)
        for pid in group_processes(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # a rank gone with its parent already (forked_launch's parent-death signal)
                pass
        said += process.communicate()[1]
        kills.append((logged_step(folder), round(delay, 2), "save" if in_save else "step/log"))
    code, out, err = finish(forked(folder, *every_step))
    said += err
    print(f"killed after (logged step, delay s, in): {kills}; torn metrics lines dropped: "
          f"{said.count('dropped its torn last line')}, checkpoints skipped: {said.count('falling back')}")
    assert sum(where == "save" for *_, where in kills) >= KILLS // 2, kills
    assert code == 0, out[-2000:] + err[-3000:]
    assert sorted(losses(folder)) == list(range(1, STEPS + 1))
    assert losses(folder) == reference


KILL_AFTER_SAVE = wrap_on_import("training.checkpoint", "Checkpointer.save", """
    def wrap(save):
        def save_then_die(self, step):
            save(self, step)
            if step == int(os.environ["KILL_AFTER_SAVE_STEP"]) and os.environ.get("RANK") == "0":
                os.killpg(os.getpgid(0), signal.SIGKILL)  # the whole run, as a node dies
        return save_then_die
""", when='bool(os.environ.get("KILL_AFTER_SAVE_STEP"))')


def test_a_run_killed_right_after_a_save_is_published_keeps_that_steps_record(tmp_path):
    """Every process SIGKILLed the moment step 6's checkpoint is published (rank 0, after Checkpointer.save returns;
    the run has a session of its own): the relaunch resumes at step 6 and the records of steps 1-20 are all there,
    bit for bit the uninterrupted run's. The step's record is written before its checkpoint (training/trainer.py):
    the other order lost step 6's record for good, which the random-instant test above met once in a CI."""
    reference = uninterrupted()
    folder, hook_dir = str(tmp_path / "run"), hook_folder(tmp_path / "hook", KILL_AFTER_SAVE)
    every_step = ("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2")
    killed = subprocess.Popen(forked_launch.command(2, [*ARGS, *every_step, "--job.dump_folder", folder]), cwd=ROOT,
                              env=child_env(hook_dir, KILL_AFTER_SAVE_STEP="6"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    code, _, err = finish(killed)
    assert code == -signal.SIGKILL, err[-3000:]
    assert_published(folder, 6)
    code, out, err = finish(forked(folder, *every_step))
    assert code == 0, out[-2000:] + err[-3000:]
    assert "(step 6)" in out.split("resumed from")[1].splitlines()[0], out[-2000:]
    assert sorted(losses(folder)) == list(range(1, STEPS + 1))
    assert losses(folder) == reference
