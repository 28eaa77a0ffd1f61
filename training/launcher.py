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

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

from training.checkpoint_disk import DISK_EXIT_CODE
from training.preemption import EXIT_CODES, STOP_FILE_ENV


def main(argv: list[str]) -> int:
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
