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
rank that failed first and the ones torchrun stopped, never the OOM killer.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, main as torchrun

from training.checkpoint_disk import DISK_EXIT_CODE
from training.preemption import EXIT_CODES, STOP_FILE_ENV


GRACE_FLAG = "--shutdown-timeout"


def grace_on_any_torch(argv: list[str], parser=None) -> list[str]:
    """torchrun's arguments for this torch. torch 2.11 has no `--shutdown-timeout` (2.12 added it; 2.11 is what GPU
    images ship): there torchrun, after forwarding a signal, gives the ranks a fixed 30 s before it kills them, too
    short for a large model's step plus its save, and it refuses the unknown flag. On such a torch the flag leaves
    the arguments and its value becomes the least timeout of torchrun's own close of the ranks (PContext.close, which
    its signal path calls with the 30 s default), patched in this process only: it exists to run torchrun once."""
    parser = parser or get_args_parser()
    script = next((i for i, arg in enumerate(argv) if not arg.startswith("-") and arg.endswith(".py")), len(argv))
    if GRACE_FLAG in parser._option_string_actions or GRACE_FLAG not in argv[:script]:
        return argv
    i = argv.index(GRACE_FLAG)
    seconds = int(float(argv[i + 1]))
    close = PContext.close

    def close_with_grace(self, death_sig=None, timeout: int = 30):
        return close(self, death_sig, max(timeout, seconds))

    PContext.close = close_with_grace
    return argv[:i] + argv[i + 2:]


class RankStops:
    """The pids of the ranks still running each time torchrun closes its process context (after a failure, a signal
    or the end): a rank that then dies of SIGTERM or SIGKILL was stopped by torchrun, not by the kernel. Installed by
    wrapping PContext.close in this process only (it exists to run torchrun once)."""

    def __init__(self):
        self.pids: set[int] = set()

    def install(self) -> None:
        close = PContext.close
        stops = self

        def recording_close(pcontext, *args, **kwargs):
            handlers = getattr(pcontext, "subprocess_handlers", {}) or {}
            stops.pids.update(h.proc.pid for h in handlers.values() if h.proc.poll() is None)
            return close(pcontext, *args, **kwargs)

        PContext.close = recording_close


def failure_line(failures: dict, stopped_pids: set[int], recipe: str) -> str | None:
    """The last line for torchrun's failures {global rank: ProcessFailure} when a rank died of a signal; None when
    none did (torchrun's own summary says it all)."""
    signalled = {rank: f for rank, f in sorted(failures.items()) if f.exitcode in (-signal.SIGKILL, -signal.SIGTERM)}
    if not signalled:
        return None
    outside = [rank for rank, f in signalled.items() if f.exitcode == -signal.SIGKILL and f.pid not in stopped_pids]
    if outside:  # nobody in this job sent it: the kernel's OOM killer is the usual sender
        return (f"error: rank {outside[0]} was killed by signal 9 (SIGKILL), which the launcher did not send; the "
                f"kernel's OOM killer stops a process that way when the host runs out of memory: ./run_train.sh "
                f"{recipe} --dry-run shows each stage's host memory per node.")
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


def main(argv: list[str]) -> int:
    argv = grace_on_any_torch(argv)
    stops = RankStops()
    stops.install()
    fd, path = tempfile.mkstemp(prefix="train-stop-")
    os.close(fd)
    os.environ[STOP_FILE_ENV] = path  # the ranks inherit it
    signalled = None
    try:
        try:
            torchrun(argv)
        except SignalException as e:
            signalled = e.sigval
        except ChildFailedError as e:  # a save failed on the disk: rank 0 said so in one line
            if any(f.exitcode == DISK_EXIT_CODE for f in e.failures.values()):
                return DISK_EXIT_CODE
            line = failure_line(e.failures, stops.pids, _recipe(argv))
            if line:  # torchrun's failure summary is printed; this line comes last
                print(line, file=sys.stderr)
                return 1
            raise
        with open(path) as f:
            saved_on = f.read().strip()
    finally:
        os.unlink(path)
    if saved_on:
        return EXIT_CODES[saved_on]
    if signalled is not None:
        print(f"error: torchrun got {signalled.name} before the ranks saved a checkpoint (they were starting, or "
              f"save_on_signal is off); resume with the same command from the last checkpoint.", file=sys.stderr)
        return 128 + int(signalled)
    return 0


def _recipe(argv: list[str]) -> str:
    """The recipe train.py was given (its first argument unless that is an override), for the one-line hints."""
    after = next((argv[i + 1:] for i, arg in enumerate(argv) if arg.endswith("train.py")), [])
    return after[0] if after and not after[0].startswith("--") else "recipes/debug.toml"


if __name__ == "__main__":
    sys.stdout.flush()
    sys.exit(main(sys.argv[1:]))
