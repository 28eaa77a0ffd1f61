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


def main(argv: list[str]) -> int:
    argv = grace_on_any_torch(argv)
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
            killed = [rank for rank, f in sorted(e.failures.items()) if f.exitcode == -signal.SIGKILL]
            if killed:  # torchrun's failure summary is printed; this line comes last
                print(f"error: rank {killed[0]} was killed by signal 9 (SIGKILL), as the kernel's OOM killer stops a "
                      f"process when the host runs out of memory: ./run_train.sh {_recipe(argv)} --dry-run shows each "
                      f"stage's host memory per node.", file=sys.stderr)
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
