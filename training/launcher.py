"""torchrun, run in this process by run_train.sh, so that a run stopped by a signal exits with a code that says so.

torchrun (torch.distributed.run) forwards the signals it handles (`--signals-to-handle`; run_train.sh adds SIGUSR1
to its default SIGTERM, SIGINT, SIGHUP, SIGQUIT) to the ranks, waits `--shutdown-timeout` seconds for them to exit
and only then kills them; but after that it raises its SignalException, a traceback and exit code 1 whatever the
ranks did. Here that exception is caught and the exit code is the one training/preemption.py gives the signal the
ranks saved on (rank 0 names it in the file of TRAIN_STOP_FILE): 0 for SIGTERM, 75 (requeue) for SIGUSR1. A signal
that came before the ranks could save (still starting, say) exits 128 + its number, in one line. Every other
outcome (success, a failed rank) is torchrun's own, unchanged, but for a save that failed on the disk
(training/checkpoint_disk.py): its ranks' exit code, quietly, after rank 0's one line; and a rank SIGKILLed (the
kernel's OOM killer), which leaves no word of its own: one last line naming the signal, the rank and the dry run.
A rank torchrun itself stopped after a peer failed (it sends SIGTERM to the ranks still running, then SIGKILL to
those that did not exit within the grace period: a rank stuck in a hang) is told apart by its pid: the launcher
records which ranks were still running when torchrun began to close them (RankStops), and its last line names the
rank that failed first and the ones torchrun stopped, never the OOM killer. A rank whose collective timed out leaves
its line naming the ranks that never arrived (training/rank_positions.py) in a file this launcher makes
(HANG_FILE_ENV); the ranks still running then get HANG_GRACE_S instead of the save-on-signal grace, and that line
comes last, and the exit code is HANG_EXIT_CODE. With MAX_RESTARTS, an attempt that torchrun restarts after a hang
prints its line when it is closed (the restart resumes from the newest intact checkpoint, as after a dead rank).

torchrun's ranks are forked from this process' imports (training/warm_ranks.py: a starter forked right after them,
before the check; torchrun runs training/warm_rank_client.py for each rank, which stands in for it), instead of each
importing torch and the trainer again; RANK_START=exec leaves torchrun to start them as fresh interpreters.

Before torchrun starts, the launch check (train.py --check: bad input in one line, before any rank) runs here, in
this process (check_then_size): run_train.sh once ran it as a process of its own, which imported torch and the
trainer a second time for every launch (~4 CPU-s, as much as a rank's start-up).
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import tempfile

from config.torch_support import exit_if_unsupported_torch

exit_if_unsupported_torch(warn=False)  # before torch.distributed's imports: an old torch stops in one line

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, main as torchrun  # noqa: E402

from training.checkpoint_disk import DISK_EXIT_CODE  # noqa: E402
from training.preemption import EXIT_CODES, STOP_FILE_ENV  # noqa: E402
from training.rank_positions import HANG_EXIT_CODE, HANG_FILE_ENV, reported_hang  # noqa: E402
from training.warm_ranks import WarmRanks  # noqa: E402

_TORCH_CLOSE = PContext.close
HANG_GRACE_S = 5
"""After a rank reported a hang (training/rank_positions.py), the ranks still running get this long between SIGTERM
and SIGKILL instead of the save-on-signal grace: the rank that never arrived cannot save, nor can its waiters."""


GRACE_FLAG = "--shutdown-timeout"
NPROC_FLAG = "--nproc-per-node"
CHECK_WORLD_ENV = "TRAIN_CHECK_WORLD_SIZE"
"""The world size run_train.sh asks for (nodes x NPROC), empty when NPROC is unset: the check then takes the
recipe's own degrees and says how many ranks to start (`--nproc-per-node auto`)."""


def _script_at(argv: list[str]) -> int:
    return next((i for i, arg in enumerate(argv) if not arg.startswith("-") and arg.endswith(".py")), len(argv))


def _load_script(path: str):
    """The script torchrun will run (run_train.sh passes train.py), loaded as a module of this process: its `--check`
    mode is the launch check. Loaded by the path on the command line, as torchrun runs it, not imported by name: the
    training package never imports the entry point (tests/test_import_direction.py)."""
    import importlib.util

    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def check_then_size(argv: list[str], entry=None) -> list[str] | int:
    """train.py --check on the script's arguments, in this process: an exit code when it refuses (its one line is
    printed), else torchrun's arguments with `--nproc-per-node auto` replaced by the ranks the check asks for, and
    OMP_NUM_THREADS (unless set) the cores split between them, so torchrun prints no thread banner. `entry`: the
    script, loaded already (loaded here when None)."""
    script = _script_at(argv)
    entry = entry or _load_script(argv[script])
    world = os.environ.pop(CHECK_WORLD_ENV, "")
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = world  # what the check reads as the launch's world size ("" = the recipe's)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = entry.main([*argv[script + 1:], "--check"])
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved
    *lines, ranks = printed.getvalue().splitlines() or [""]
    if lines:
        print("\n".join(lines), flush=True)
    if code != 0:
        return code
    argv = list(argv)
    at = argv.index(NPROC_FLAG, 0, script) + 1
    if argv[at] == "auto":
        argv[at] = ranks.strip()
    nproc = int(argv[at])
    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    return argv


def grace_on_any_torch(argv: list[str], parser=None) -> list[str]:
    """torchrun's arguments for this torch. torch 2.11 has no `--shutdown-timeout` (2.12 added it; 2.11 is what GPU
    images ship): there torchrun, after forwarding a signal, gives the ranks a fixed 30 s before it kills them, too
    short for a large model's step plus its save, and it refuses the unknown flag. On such a torch the flag leaves
    the arguments and its value becomes the least timeout of torchrun's own close of the ranks on its signal path
    (PContext.close with the 30 s default, called while the agent handles the SignalException its signal handler
    raised), patched in this process only: it exists to run torchrun once. Every other close keeps its own timeout:
    a restart's (after a rank failed, with MAX_RESTARTS > 0) and the end's, where waiting the grace would only keep
    survivors stuck in a collective alive longer before the restart."""
    parser = parser or get_args_parser()
    script = _script_at(argv)
    if GRACE_FLAG in parser._option_string_actions or GRACE_FLAG not in argv[:script]:
        return argv
    i = argv.index(GRACE_FLAG)
    seconds = int(float(argv[i + 1]))
    close = PContext.close

    def close_with_grace(self, death_sig=None, timeout: int = 30):
        signalled = isinstance(sys.exc_info()[1], SignalException)  # inside the agent's `except SignalException`
        return close(self, death_sig, max(timeout, seconds) if signalled else timeout)

    PContext.close = close_with_grace
    return argv[:i] + argv[i + 2:]


class RankStops:
    """The pids of the ranks still running each time torchrun closes its process context (after a failure, a signal
    or the end): a rank that then dies of SIGTERM or SIGKILL was stopped by torchrun, not by the kernel. And, from
    `hang_file`, the line of a rank whose collective timed out in the attempt being closed (`hang`; the file is
    emptied for a restart's next attempt, and a later attempt's close forgets it): then the ranks still running get
    HANG_GRACE_S, and when torchrun will restart (attempts closed <= `max_restarts`) the line is printed at once.
    Installed by wrapping PContext.close in this process only (it exists to run torchrun once)."""

    def __init__(self, hang_file: str | None = None, max_restarts: int = 0):
        self.pids: set[int] = set()
        self.hang_file = hang_file
        self.max_restarts = max_restarts
        self._hang: tuple[object, str] | None = None  # (the attempt's process context, the line)
        self._closed: object | None = None
        self._attempts: list[object] = []  # each attempt's process context, in the order torchrun closed them

    @property
    def hang(self) -> str | None:
        """The hang line of the last attempt torchrun closed, if a rank of it reported one."""
        return self._hang[1] if self._hang is not None and self._hang[0] is self._closed else None

    def install(self) -> None:
        close = PContext.close
        stops = self

        def recording_close(pcontext, death_sig=None, timeout: int = 30):
            handlers = getattr(pcontext, "subprocess_handlers", {}) or {}
            stops.pids.update(h.proc.pid for h in handlers.values() if h.proc.poll() is None)
            stops._closed = pcontext  # torchrun may close one attempt twice (on failure, then in a finally)
            if not any(a is pcontext for a in stops._attempts):
                stops._attempts.append(pcontext)
            line = reported_hang(stops.hang_file) if stops.hang_file else None
            if line is not None:
                stops._hang = (pcontext, line)
                open(stops.hang_file, "w").close()
                restart = len(stops._attempts)
                if restart <= stops.max_restarts:  # torchrun restarts after this close: say why now
                    print(f"{line}; torchrun restarts the job (restart {restart} of {stops.max_restarts}: "
                          f"MAX_RESTARTS)", file=sys.stderr, flush=True)
            if stops.hang is not None:
                return _TORCH_CLOSE(pcontext, death_sig, min(timeout, HANG_GRACE_S))
            return close(pcontext, death_sig, timeout)

        PContext.close = recording_close


def failure_line(failures: dict, stopped_pids: set[int], recipe: str) -> str | None:
    """The last line for torchrun's failures {global rank: ProcessFailure} when a rank died of a signal; None when
    none did (torchrun's own summary says it all)."""
    signalled = {rank: f for rank, f in sorted(failures.items()) if f.exitcode in (-signal.SIGKILL, -signal.SIGTERM)}
    if not signalled:
        return None
    outside = [rank for rank, f in signalled.items() if f.exitcode == -signal.SIGKILL and f.pid not in stopped_pids]
    if outside:  # nobody in this job sent it: the kernel's OOM killer is the usual sender
        return (f"error: rank {outside[0]} was killed by signal 9 (SIGKILL) from outside the run (the launcher did "
                f"not send it); the kernel's OOM killer stops a process that way when the host runs out of memory: "
                f"./run_train.sh {recipe} --dry-run shows each stage's host memory per node.")
    stopped = [rank for rank, f in signalled.items() if f.pid in stopped_pids]
    first = [rank for rank, f in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
             if f.pid not in stopped_pids]
    if not stopped:
        return None
    how = ", ".join(f"rank {rank} ({signal.Signals(-failures[rank].exitcode).name})" for rank in stopped)
    cause = (f"rank {first[0]} failed first (exit code {failures[first[0]].exitcode}; its error is above)" if first
             else "a rank failed")
    return (f"error: {cause}, and torchrun stopped the ranks still running: {how}; SIGKILL means the rank did not "
            f"exit on SIGTERM within the grace period, so it was stuck (waiting in a collective for the failed rank, "
            f"or hung itself), not killed for memory.")


def _drop_rendezvous_timer_race(unraisable) -> None:
    """sys.unraisablehook for this process: torch's rendezvous keep-alive timer stops its thread from a weakref
    finalizer (elastic/rendezvous/utils.py `_stop_thread`); when the garbage collector runs that finalizer on the
    timer's own thread, join() raises "cannot join current thread" and Python prints it as an ignored exception: a
    traceback after a clean save on SIGTERM (seen once in CI). That one is dropped; every other goes to Python's hook."""
    frames, tb = [], unraisable.exc_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if isinstance(unraisable.exc_value, RuntimeError) and "_stop_thread" in frames \
            and str(unraisable.exc_value) == "cannot join current thread":
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str]) -> int:
    sys.unraisablehook = _drop_rendezvous_timer_race
    entry = _load_script(argv[_script_at(argv)])  # torch and the trainer, imported once here
    starter = WarmRanks.start(entry, argv[_script_at(argv)])  # forked now, before the check can touch a device
    try:
        return _check_and_run(argv, entry, starter)
    finally:
        if starter is not None:
            starter.stop()


def _check_and_run(argv: list[str], entry, starter: WarmRanks | None) -> int:
    checked = check_then_size(argv, entry)
    if isinstance(checked, int):
        return checked
    argv = grace_on_any_torch(checked)
    fd, hang_path = tempfile.mkstemp(prefix="train-hang-")
    os.close(fd)
    os.environ[HANG_FILE_ENV] = hang_path  # the ranks inherit it
    stops = RankStops(hang_path, max_restarts(argv))
    stops.install()
    fd, path = tempfile.mkstemp(prefix="train-stop-")
    os.close(fd)
    os.environ[STOP_FILE_ENV] = path  # the ranks inherit it
    signalled = None
    try:
        try:
            torchrun(starter.route(argv, _script_at(argv)) if starter is not None else argv)
        except SignalException as e:
            signalled = e.sigval
        except ChildFailedError as e:  # a save failed on the disk: rank 0 said so in one line
            if any(f.exitcode == DISK_EXIT_CODE for f in e.failures.values()):
                return DISK_EXIT_CODE
            if stops.hang is not None:  # a collective timed out: who never arrived, after torchrun's summary
                print(stops.hang, file=sys.stderr)
                return HANG_EXIT_CODE
            line = failure_line(e.failures, stops.pids, _recipe(argv))
            if line:  # torchrun's failure summary is printed; this line comes last
                print(line, file=sys.stderr)
                return 1
            raise
        with open(path) as f:
            saved_on = f.read().strip()
    finally:
        os.unlink(path)
        os.unlink(hang_path)
    if saved_on:
        return EXIT_CODES[saved_on]
    if signalled is not None:
        print(f"error: torchrun got {signalled.name} before the ranks saved a checkpoint (they were starting, or "
              f"save_on_signal is off); resume with the same command from the last checkpoint.", file=sys.stderr)
        return 128 + int(signalled)
    return 0


def max_restarts(argv: list[str]) -> int:
    """torchrun's --max-restarts (either spelling, `--flag N` or `--flag=N`) before the script, else its default 0."""
    for i, arg in enumerate(argv):
        if arg.endswith("train.py"):
            break
        name, _, value = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            return int(value or argv[i + 1])
    return 0


def _recipe(argv: list[str]) -> str:
    """The recipe train.py was given (its first argument unless that is an override), for the one-line hints."""
    after = next((argv[i + 1:] for i, arg in enumerate(argv) if arg.endswith("train.py")), [])
    return after[0] if after and not after[0].startswith("--") else "recipes/debug.toml"


if __name__ == "__main__":
    sys.stdout.flush()
    sys.exit(main(sys.argv[1:]))
