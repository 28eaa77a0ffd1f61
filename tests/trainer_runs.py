"""Launch the real trainer the way a user does (run_train.sh -> torchrun), or forked for numeric comparisons, and
read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import forked_launch
from harness.launch_env import child_env
from tests.distributed import forked_train
from training.metrics import read_metrics  # noqa: F401  (the one metrics.jsonl reader; tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ONE_PROCESS_FLAGS = {"--help", "-h", "--print-config", "--dry-run", "--prepare-data", "--show-rows", "--plan-ramp"}
"""The arguments for which run_train.sh execs `train.py "$@"` in one process (no launcher, no torchrun)."""


def run_train(*args, nproc: int | None = None, timeout: float = 180, env: dict | None = None, forked: bool = False):
    """Runs ./run_train.sh with this interpreter (no bootstrap) and returns the CompletedProcess. `forked`: the same
    train.py arguments on `nproc` ranks forked from one interpreter (harness/forked_launch.py) instead, for tests whose
    subject is what the trainer computes or saves, not the launch: no preflight process, one import for all ranks.
    A one-process mode (ONE_PROCESS_FLAGS: a dry run, --plan-ramp, --show-rows, ...; with no `nproc`, and no `env`
    unless `forked`) is forked from the forkserver too: run_train.sh execs `train.py` for those as they are, so only
    the imports, done once there, are saved. A test that measures the process itself (its resident set) passes `env`
    without `forked` and gets a process of its own."""
    full_env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    full_env.pop("NPROC", None)
    if ONE_PROCESS_FLAGS.intersection(args) and not nproc and (env is None or forked):  # run_train.sh execs train.py
        return forked_train(0, list(args), child_env(base=full_env), ROOT, timeout)
    if forked and env is None:  # the launcher forked from the test process' forkserver: no imports again
        return forked_train(nproc, list(args), child_env(base=full_env), ROOT, timeout)
    if forked:
        return subprocess.run(forked_launch.command(nproc, list(args)), capture_output=True, text=True,
                              env=child_env(base=full_env),
                              timeout=timeout, cwd=ROOT)
    if nproc:
        full_env["NPROC"] = str(nproc)
    return subprocess.run([os.path.join(ROOT, "run_train.sh"), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT)




def run_until(args: list[str], until, *, nproc: int, timeout: float, forked: bool = False) -> tuple[bool, int, str]:
    """Launches the trainer on `nproc` ranks (run_train.sh, or forked from one interpreter: harness/forked_launch.py)
    in a session of its own, calls `until()` every second while it runs, and ends the run the first time `until()`
    is true: for learning runs that stop as soon as their criterion holds, whatever machine and step that is. The
    launcher gets SIGTERM and forwards it to the ranks, as torchrun does (the ranks stay its waited-for children, so
    tests/cpu_accounting.py counts them); every process of the session gets SIGTERM, then SIGKILL, only if it has
    not ended 60 s later. Returns (stopped by `until`, exit code, stdout with stderr). Past `timeout` the run is
    ended and the test fails with its output."""
    import tempfile
    import time

    from harness.process_tree import end_process_group

    command = (forked_launch.command(nproc, list(args)) if forked
               else [os.path.join(ROOT, "run_train.sh"), *args])
    env = child_env(base=dict(os.environ, PYTHON=sys.executable, NPROC=str(nproc)))
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: nothing blocks the run while `until` works
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline, stopped = time.monotonic() + timeout, False
        try:
            while process.poll() is None and time.monotonic() < deadline:
                if until():
                    stopped = True
                    break
                time.sleep(1)
        finally:
            if process.poll() is None:  # as a scheduler stops a job: SIGTERM to the launcher, which tells the ranks
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    end_process_group(process.pid)
            process.wait(timeout=60)
        log.seek(0)
        output = log.read()
    assert stopped or time.monotonic() < deadline, f"the run did not end in {timeout} s:\n{output[-3000:]}"
    return stopped, process.returncode, output


def train_losses(out: str, *args, nproc: int, timeout: float = 300) -> list[float]:
    """Per-step losses of the trainer on `nproc` forked ranks: its callers compare numbers between meshes."""
    result = run_train("--job.dump_folder", out, *args, nproc=nproc, timeout=timeout, forked=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [r["loss"] for r in read_metrics(out)]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def short_documents_recipe(folder) -> str:
    """The debug recipe on short documents (pydoc topics cut at blank lines, written under `folder`), so that rows
    hold several of them: on whole pydoc topics a short row is one document and every layout is zigzag's."""
    from pydoc_data.topics import topics

    corpus = os.path.join(folder, "paragraphs.jsonl")
    with open(corpus, "w") as f:
        for name in sorted(topics):
            for paragraph in topics[name].split("\n\n"):
                if paragraph.strip():
                    f.write(json.dumps({"text": paragraph.strip()}) + "\n")
    with open(os.path.join(ROOT, "recipes", "debug.toml")) as f:
        text = f.read().replace('corpus = ["pydoc"]', f"corpus = [{json.dumps(str(corpus))}]")
    path = os.path.join(folder, "recipe.toml")
    with open(path, "w") as f:
        f.write(text)
    return path
