"""What the kill, signal and restart tests share (test_preemption, test_checkpoint_restart, tests/test_slurm.py): a
tiny model, steps paced by a sleep instead of by compute, and the uninterrupted reference run once per process. The
tiny model also serves the checkpoint, ramp and offload runs whose property shows at any size (test_checkpoint_runs,
test_ramp, test_cpu_offload_runs).

Why tiny: what these tests prove (a save on a signal, a resume bit for bit, a torn file survived) shows at any model
size, and on a 2-core box the debug model's steps (~1.3 CPU s each on 2 ranks) were most of their cost after the
launches themselves. Why paced: a tiny step takes tens of milliseconds, too short for a test that signals a run
after step N is logged to be sure the run has not finished meanwhile; a sleep holds each step without using a core.
"""
from __future__ import annotations

import functools
import os
import tempfile
import textwrap

TINY_SHAPE = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
TINY = tuple(item for key, value in TINY_SHAPE.items() for item in (f"--model.{key}", str(value)))
"""Two blocks (several blocks' shards in each checkpoint), grouped-query attention (4 query, 2 key/value heads):
~0.4M parameters, a 5 MB checkpoint on 2 ranks. The vocabulary stays the debug recipe's (its cached tokenizer)."""

_WRAP_ON_IMPORT = """
import importlib.util, os, signal, sys, time


class _WrapOnImport:
    def __init__(self, module, attr, source, when):
        self.module, self.attr, self.source, self.when = module, attr, source, when

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            owner, _, attr = self.attr.rpartition(".")
            holder = getattr(module, owner) if owner else module
            setattr(holder, attr, self.decided_per_process(getattr(holder, attr)))
        spec.loader.exec_module = exec_module
        return spec

    def decided_per_process(self, original):
        chosen = {}  # pid -> what this process calls

        def call(*args, **kwargs):
            if os.getpid() not in chosen:
                scope = dict(globals())
                exec(self.source, scope)
                chosen[os.getpid()] = scope["wrap"](original) if eval(self.when, scope) else original
            return chosen[os.getpid()](*args, **kwargs)
        return call

"""


def wrap_on_import(module: str, attr: str, wrapper: str, when: str) -> str:
    """sitecustomize.py source (for every Python process of a run, through PYTHONPATH) that replaces `attr` of
    `module` ("function" or "Class.method") by `wrap(original)` when the module is first imported. `wrapper` is
    source defining `wrap` (and what it reads; names with a prefix of their own, as several hooks may share one
    file); `when`, a Python expression over those names, says whether to hook. Both are evaluated in the process
    that first calls `attr`, on its own environment, not at start-up: a rank forked from the launcher's imports
    (training/warm_ranks.py) never ran start-up code of its own, and its RANK and restart count are not the
    launcher's; a data-loader worker forked from a rank decides for itself too."""
    return (_WRAP_ON_IMPORT + f"\nsys.meta_path.insert(0, _WrapOnImport({module!r}, {attr!r}, "
            f"{textwrap.dedent(wrapper)!r}, {when!r}))\n")


PACED_STEPS = wrap_on_import("training.preemption", "StopSignals.agreed", """
    _PACED_S = float(os.environ.get("PACED_STEP_S", "0"))
    _PACED_KEY, _, _PACED_WANT = os.environ.get("PACED_WHILE", "").partition("=")


    def wrap(agreed):
        def paced(self, *args, **kwargs):
            time.sleep(_PACED_S)
            return agreed(self, *args, **kwargs)
        return paced
""", when='_PACED_S > 0 and (not _PACED_KEY or os.environ.get(_PACED_KEY, "0") == _PACED_WANT)')
"""Each step sleeps PACED_STEP_S seconds after it is logged and before the ranks agree on a signal
(training/preemption.py's StopSignals.agreed), which a signal during the sleep only notes; with
PACED_WHILE=NAME=VALUE only while that variable (unset counts as "0") has that value, e.g. the first attempt of a
torchrun job (TORCHELASTIC_RESTART_COUNT=0) or of a Slurm job (SLURM_RESTART_COUNT=0)."""

_FREEZE_AT = """
    _FREEZE_WHERE, _, _FREEZE_NTH = os.environ.get("FREEZE_AT", "").partition(":")
    _FREEZE_KEY, _, _FREEZE_WANT = os.environ.get("FREEZE_WHILE", "").partition("=")
    _FREEZE = (os.environ.get("FREEZE_RANK") is not None and os.environ.get("RANK") == os.environ.get("FREEZE_RANK")
               and (not _FREEZE_KEY or os.environ.get(_FREEZE_KEY, "0") == _FREEZE_WANT))


    def wrap(original):
        calls = [0]

        def freezing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(_FREEZE_NTH):
                os.kill(os.getpid(), signal.SIGSTOP)
            return original(*args, **kwargs)
        return freezing
"""
FREEZE_ITSELF = "".join(
    wrap_on_import(module, attr, _FREEZE_AT, when=f"_FREEZE and _FREEZE_WHERE == {where!r}")
    for where, (module, attr) in {"micro_step": ("training.step", "micro_step"),
                                  "save": ("training.checkpoint", "Checkpointer.save"),
                                  "data": ("training.batch_plans", "StepPlanner.__call__")}.items())
"""The process of rank FREEZE_RANK stops itself (SIGSTOP, as a process the kernel or a debugger stopped: no thread of
it runs, its heartbeat included) at the Nth call of FREEZE_AT=WHERE:N, WHERE one of `micro_step` (training/step.py:
the Nth micro-step's forward), `save` (Checkpointer.save, before its first collective) or `data` (the step planner in
the rank's data-loader worker, which is forked with the rank's environment: the worker stops, the rank waits for its
batch); with FREEZE_WHILE=NAME=VALUE only while that variable has that value (as PACED_WHILE). Nothing continues it:
the launcher kills the stuck rank (torchrun signals each rank's process group, the worker included)."""


def hook_folder(folder, *sources: str) -> str:
    """Writes `sources` (PACED_STEPS, FREEZE_ITSELF) as `folder`/sitecustomize.py; returns the folder to put first on
    PYTHONPATH."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write("\n".join(sources))
    return str(folder)


def paced_hook(folder) -> str:
    """Writes PACED_STEPS as `folder`/sitecustomize.py; returns the folder to put first on PYTHONPATH."""
    return hook_folder(folder, PACED_STEPS)


def uninterrupted_losses(args: tuple, nproc: int = 2) -> dict[int, float]:
    """{step: loss} of `args` on `nproc` ranks without a signal or a kill: the reference of the resumed runs. Its
    ranks are forked (tests/trainer_runs.run_train(forked=True)): the reference's subject is the numbers, which are
    torchrun's bit for bit, not the launch. Run once per process and set of arguments; each caller gets a copy."""
    return dict(_uninterrupted(tuple(args), nproc))


@functools.cache
def _uninterrupted(args: tuple, nproc: int) -> dict[int, float]:
    from tests.trainer_runs import read_metrics, run_train

    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        result = run_train(*args, "--job.dump_folder", folder, nproc=nproc, timeout=300, forked=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return {record["step"]: record["loss"] for record in read_metrics(folder)}
