"""Preemption and the time limit: a signal (SIGTERM from Slurm's preemption, scancel or time limit; SIGUSR1 from
`--signal=B:USR1@N` ahead of the limit) makes every rank finish the step it is in, save a checkpoint of that step
and stop, so that a requeued or relaunched run loses no step.

Why the ranks agree at the step boundary: a signal reaches the ranks at different instants (or only one rank, when
it is sent to one process), and a rank that stopped on its own would leave its peers blocked in the next step's
collectives. So each rank only notes the signal in its handler; after every step the note is all-reduced (max) over
all ranks, on the run's device as every bookkeeping collective (NCCL has no CPU tensors), and all ranks stop after
the same step.

How the launch learns why the run stopped: the ranks exit 0 (torchrun reports anything else as a failed child),
and rank 0 writes the signal's name into the file named by `STOP_FILE_ENV`, which training/launcher.py (torchrun in
one process, for run_train.sh) reads to exit with `EXIT_CODES[name]`: a clean stop for SIGTERM, "requeue me" for
SIGUSR1 (slurm/train.sbatch requeues on it).
"""
from __future__ import annotations

import os
import signal
import threading

import torch


STOP_FILE_ENV = "TRAIN_STOP_FILE"
"""Environment variable naming the file that rank 0 writes the stopping signal's name into."""

EXIT_CODES = {"SIGTERM": 0, "SIGUSR1": 75}  # every name of config.schema.StopSignal
"""run_train.sh's exit code after a checkpoint saved on a signal: SIGTERM is a clean stop (0); SIGUSR1 asks for a
requeue (75, EX_TEMPFAIL: "try again later"), which slurm/train.sbatch turns into `scontrol requeue`."""

_PRIORITY = ("SIGUSR1", "SIGTERM")
"""Ranks that saw different signals stop on the later one here: a stop wins over a requeue."""


def ignore_stop_signals(worker_id: int) -> None:
    """A data-loader worker's first act: ignore the stop signals. torch's worker loop installs a handler that dies on
    SIGTERM, and torchrun signals each rank's whole process group (Slurm every process of the step), so a worker
    would die under its rank mid-step. The worker still ends with its rank (torch's parent watchdog)."""
    for name in EXIT_CODES:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def start_compile_workers_deaf_to(names: list[str], triton: bool | None = None) -> bool:
    """Start inductor's compile workers now, with the stop signals blocked, so that they never see one. torchrun
    signals each rank's whole process group, which holds the workers (a sidecar process started by subprocess from
    the rank, and its pool; they ignore only SIGINT), so the first signal killed them, and a compile between the
    signal and the save (step 1's lazy backward, a ramp stage's new shapes, an evaluation) failed instead of saving.

    A blocked signal stays blocked across fork and exec, so the workers keep it pending, never delivered; the rank
    unblocks it right after, and its handler notes anything that arrived meanwhile (ignoring it for the window
    instead could lose one). The workers still end with the rank (their parent watchdog). That pool compiles
    Triton kernels only (`triton`: whether the triton package is installed, as torch decides when it warms the pool
    at the first compile); CPU kernels are built by g++ from the rank's own threads, so without triton nothing is
    started. Returns whether a pool was started."""
    from torch._inductor import async_compile
    from torch.utils._triton import has_triton_package

    if triton is None:
        triton = has_triton_package()
    if (not triton or async_compile.get_compile_threads() <= 1
            or threading.current_thread() is not threading.main_thread()):
        return False
    numbers = {getattr(signal, name) for name in names}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        async_compile.AsyncCompile.process_pool()  # once per process (cached): every later compile submits to it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return True


class StopSignals:
    """This rank's signal handlers and what they saw (the data loader's workers ignore the signals instead:
    `ignore_stop_signals`)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.received: str | None = None  # the first signal seen by this process
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread (a forked test rank runs there too)
        for name in self.names:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._note)

    def _note(self, number: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(number).name

    def agreed(self, comm, device: torch.device) -> str | None:
        """Collective over all ranks, after a step: the signal to stop on if any rank saw one, else None. SIGTERM
        wins over SIGUSR1 (a stop over a requeue) when ranks saw different ones."""
        if not self.names:
            return None
        flag = torch.tensor([_PRIORITY.index(self.received) + 1 if self.received else 0], dtype=torch.int32,
                            device=device)
        code = int(comm.all_reduce_(flag, op="max").item())  # all_reduce_ skips the collective on one rank
        return _PRIORITY[code - 1] if code else None

    def report(self, name: str, step: int, rank: int) -> None:
        """Rank 0: the one line, and the signal's name for the launcher."""
        if rank != 0:
            return
        print(f"checkpoint: saved step {step} on {name}; resume with the same command", flush=True)
        path = os.environ.get(STOP_FILE_ENV)
        if path:
            with open(path, "w") as f:
                f.write(name)

    def close(self) -> None:
        """The handlers that were there before (a test running several trainers in one process)."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}
