"""Two collective timeouts: a long one while ranks legitimately wait on each other, a short one for training steps.

Why: one timeout for every collective has to cover the slowest wait a healthy run has (the communicator set-up, a
checkpoint load, the first step's lazy initialisation and compile, an evaluation), so a rank that hangs in step 5,000
keeps the whole job waiting that long too. As TorchTitan does (`comm.init_timeout_seconds`, then
`comm.train_timeout_seconds` after the first step), the process groups start with `job.init_timeout_s`; once a stage
has run its warm-up steps they switch to `job.step_timeout_s`, or, at 0 (the default), to
STEP_TIMEOUT_FACTOR x the slowest measured warm-up step with a floor of STEP_TIMEOUT_FLOOR_S. Checkpoint saves,
evaluations and stage switches (new shapes, new groups, new compiles) run under the long timeout again.

The timeout of an existing group changes in place (torch.distributed's `_set_pg_timeout`, on gloo and NCCL alike),
for the default group and every group of the stage's mesh; a collective already in flight keeps the timeout it
started with.
"""
from __future__ import annotations

import contextlib
import datetime

import torch.distributed as dist

from parallelisms.stage_meshes import mesh_groups

WARMUP_STEPS = 2  # step 1 builds (lazy init, compile, first all-gathers); step 2 is the stage's steady state
STEP_TIMEOUT_FACTOR = 5.0
STEP_TIMEOUT_FLOOR_S = 60.0


def auto_step_timeout(step_times: list[float]) -> float:
    """The step timeout job.step_timeout_s = 0 stands for: FACTOR x the slowest warm-up step, at least the floor."""
    return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * max(step_times))


class CollectiveTimeouts:
    """The timeout every process group of the current stage runs under: `long` (job.init_timeout_s) until the stage
    has run WARMUP_STEPS steps, then the step timeout; `phase()` puts the long one back around a checkpoint save or
    an evaluation."""

    def __init__(self, init_timeout_s: float, step_timeout_s: float, log=None):
        self.long_s = float(init_timeout_s)
        self.step_setting_s = float(step_timeout_s)  # 0: measured (auto_step_timeout)
        self.step_s: float | None = None  # the stage's step timeout once it is known
        self.current_s = self.long_s
        self.warmup_times: list[float] = []
        self.groups: set = set()
        self.log = log

    def start_stage(self, mesh) -> None:
        """A new stage (and the first): its groups, back on the long timeout, and its warm-up steps measured anew
        (a ramp's later stage steps several times longer)."""
        self.groups = mesh_groups(mesh) | {dist.distributed_c10d._get_default_group()}
        self.step_s = None
        self.warmup_times = []
        self._set(self.long_s)

    def step_done(self, step_time: float) -> None:
        """After each training step: the stage's warm-up steps measured, then the step timeout set once."""
        if self.step_s is not None:
            return
        self.warmup_times.append(step_time)
        if len(self.warmup_times) < WARMUP_STEPS:
            return
        measured = self.warmup_times[1:] or self.warmup_times  # step 1's build time is not a step's
        self.step_s = self.step_setting_s or auto_step_timeout(measured)
        self._set(self.step_s)
        if self.log is not None:
            how = "job.step_timeout_s" if self.step_setting_s else (
                f"{STEP_TIMEOUT_FACTOR:g} x the warm-up step of {max(measured):.1f}s, at least "
                f"{STEP_TIMEOUT_FLOOR_S:g}s; job.step_timeout_s sets it")
            self.log(f"collective timeout {self.step_s:.0f}s from now on ({how}); {self.long_s:.0f}s for set-up, "
                     f"checkpoints and evaluations (job.init_timeout_s)")

    @contextlib.contextmanager
    def phase(self):
        """A checkpoint save, an evaluation: the long timeout inside, the step timeout (if set) after. After an error
        inside (a collective that timed out, say) the long one stays: the run is ending, and its hang line names the
        timeout that expired (current_s), not the step's."""
        before = self.current_s
        self._set(self.long_s)
        yield
        self._set(before)

    def _set(self, seconds: float) -> None:
        timeout = datetime.timedelta(seconds=seconds)
        for group in self.groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        self.current_s = seconds
