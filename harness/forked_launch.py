"""A one-host stand-in for `torchrun --standalone` that starts the interpreter once: the parity runs' launcher.

    python harness/forked_launch.py NPROC train.py [RECIPE] [--section.key value ...]

Importing torch and the trainer costs a few CPU seconds per process; torchrun pays it once for its agent and once per
rank, which made most of a short parity run's time on a 2-core box (a 16-rank run paid 17 imports for 5 steps of
a toy model). Here the trainer is imported once and each rank is a forked child with torchrun's environment
contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so it runs the same
train.main() from the same process-group set-up on. Nothing has run in the parent before the fork (no thread pool,
no process group). The first rank that fails stops the others as torchrun does (SIGTERM, then SIGKILL to those still
running STOP_GRACE_S later); the exit code is that rank's.
SIGTERM and SIGUSR1 to the launcher are forwarded to every rank, as torchrun forwards them.
Users and the launch tests keep torchrun (run_train.sh); this only makes the numeric comparisons cheaper.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_GRACE_S = 30.0
"""torchrun's grace between SIGTERM and SIGKILL for the ranks still running after one failed. A rank notes SIGTERM
and stops at its next step (training/preemption.py), so one blocked in a collective with the failed rank would wait
out its collective timeout (job.init_timeout_s: 600 s) without it, and the caller's limit first (seen in a CI)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, train_args: list[str]) -> list[str]:
    """The command line that runs train.py with `train_args` on `nproc` forked ranks (this interpreter)."""
    return [sys.executable, os.path.abspath(__file__), str(nproc), os.path.join(ROOT, "train.py"), *train_args]


def _die_with_parent() -> None:
    """A rank gets SIGKILL when the launcher dies (a caller's timeout kills only the launcher): no orphans."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_rank(train, rank: int, nproc: int, port: int, argv: list[str], before_rank=None,
              stacks_after: float | None = None) -> int:
    _die_with_parent()
    if stacks_after:  # a rank still running then writes every thread's stack to stderr: a hang says where it hangs
        faulthandler.dump_traceback_later(stacks_after, exit=False)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if before_rank is not None:
            before_rank()
        return train.main(argv)
    except BaseException as e:  # a rank's own error line first, as torchrun's children print it
        print(f"[rank{rank}]: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        return 1


def launch(nproc: int, argv: list[str], before_rank=None, stacks_after: float | None = None) -> int:
    """Forks `nproc` ranks of train.main(argv); returns the first failing rank's exit code, or 0. `before_rank()`
    runs first in each rank, its environment set (a test double that wraps the rank's process, say). `stacks_after`:
    seconds after which a rank still running prints every thread's stack to stderr (a caller's time limit near)."""
    sys.path.insert(0, ROOT)
    import torch._dynamo  # noqa: F401  (each rank imports it at its first weight initialisation: once here instead)
    import train  # the expensive imports, once for every rank

    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = _run_rank(train, rank, nproc, port, argv, before_rank, stacks_after)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # as train.py does: no interpreter teardown with gloo threads alive
        children[pid] = rank

    def forward(signum, _frame):  # as torchrun does: a preemption signal to the launcher reaches every rank
        for other in list(children):
            try:
                os.kill(other, signum)
            except ProcessLookupError:  # exited and reaped meanwhile
                pass
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    exit_code, kill_at = 0, None
    while children:
        pid, status = _wait_for_a_rank(kill_at)
        if pid == 0:  # the grace is over
            print(f"forked_launch: ranks {sorted(children.values())} still running {STOP_GRACE_S:.0f} s after SIGTERM; "
                  "SIGKILL", file=sys.stderr)
            for other in children:
                os.kill(other, signal.SIGKILL)
            kill_at = None
            continue
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and exit_code == 0:
            exit_code = code if code > 0 else 128 - code
            print(f"forked_launch: rank {rank} exited with {code}; stopping the other ranks", file=sys.stderr)
            for other in children:
                os.kill(other, signal.SIGTERM)
            kill_at = time.monotonic() + STOP_GRACE_S
    return exit_code


def _wait_for_a_rank(kill_at: float | None) -> tuple[int, int]:
    """os.wait(), or with a deadline (monotonic seconds) (0, 0) once it passes with no rank ended."""
    if kill_at is None:
        return os.wait()
    while time.monotonic() < kill_at:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            return pid, status
        time.sleep(0.05)
    return 0, 0


def run_as_child(nproc: int, train_args: list[str], environ: dict, cwd: str, out_path: str, err_path: str,
                 before_rank=None, stacks_after: float | None = None) -> None:
    """The body of a process forked from a server that imported the trainer (the tests' forkserver, the bench's dry
    runs): `train_args` on `nproc` forked ranks, or with `nproc` 0 `python train.py *train_args` in this very
    process (a dry run, a check), with the environment and working directory a subprocess would have had, stdout and
    stderr in the files a subprocess' pipes would have captured (one file for both when the paths are equal);
    `before_rank` and `stacks_after` as for launch. Exits with the run's code, as train.py does: no interpreter
    teardown with gloo threads alive."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    targets = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for path in {out_path, err_path}}
    os.dup2(targets[out_path], 1)
    os.dup2(targets[err_path], 2)
    for fd in targets.values():
        os.close(fd)
    code = 1
    try:
        if nproc:
            code = launch(nproc, train_args, before_rank, stacks_after)
        else:
            if stacks_after:
                faulthandler.dump_traceback_later(stacks_after, exit=False)
            sys.path.insert(0, ROOT)
            sys.argv = [os.path.join(ROOT, "train.py"), *train_args]
            import train

            code = train.main(train_args)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit() or os.path.basename(sys.argv[2]) != "train.py":
        sys.exit("usage: python harness/forked_launch.py NPROC train.py [RECIPE] [--section.key value ...]")
    sys.exit(launch(int(sys.argv[1]), sys.argv[3:]))
