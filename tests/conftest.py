"""Shared pytest setup: the repo root on sys.path, and fewer torch threads so several ranks fit on 2 cores."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path set-up above)

from tests.cpu_accounting import CpuAccounting  # noqa: E402
from tests.pinned_requirements import as_failure  # noqa: E402


def pytest_configure(config):
    """Each test's CPU seconds in the junit XML and the terminal summary (tests/cpu_accounting.py)."""
    config.pluginmanager.register(CpuAccounting(), "cpu_accounting")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at import because a pinned requirement is missing fails instead."""
    report = yield
    as_failure(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The same for a test that calls `pytest.importorskip` of a pinned requirement inside its body."""
    report = yield
    as_failure(report)
    return report


LEARNING_RUNS_FIRST = ("tests/training/test_passkey_training.py", "tests/training/test_chat_sft.py",
                       "tests/test_slurm.py", "tests/training/test_timeouts.py",
                       "tests/training/test_dry_run_8gpu.py", "tests/training/test_float8_runs.py")
"""The longest files start CI: the two learning runs (2-rank trainings of several minutes), then the files that
mostly wait (a real Slurm time limit and requeue, collective timeouts that must expire: minutes of wall time at a few
CPU seconds), so that their waits overlap the learning runs' compute instead of idling the cores later (in the
clean-clone CI of 219aaa6 the timeouts tests left 67 CPU-s idle at minute 17 and the Slurm time limit ran alone for
the last two minutes), then the 8-GPU recipe's dry runs and float8's long runs. After them the files with the most
tests first. With xdist's own order the learning runs started last, 26 minutes into a 34-minute CI, and the passkey
run finished alone with the cores partly idle."""


SPREAD_TEST_BY_TEST = ("tests/parallelisms/test_parity.py", "tests/training/test_float8.py")
"""Files of many independent trainer runs that CI hands out one test at a time, with nothing to share but the
one-process references, which each worker memoizes once (tests/loss_reference.py): test_parity alone was 3,508
test-seconds of a 23,106 in a clean-clone CI. The 8-GPU dry runs and float8's long runs stay whole: spread, they ran
at once with the learning runs on three workers of a 2-core box, and all five timed out (a819d79's CI). Every other file goes to one worker whole: its tests may share module fixtures or module
caches (tests/parallelisms/test_context_parallel.py's runs per CP degree), and most take seconds."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """CI runs `-n 3 --dist loadgroup --no-loadscope-reorder`, which hands out work units in this collection order:
    the learning runs first, then files by their number of tests, most first (a stable sort: tests keep their order).
    Each file is one unit, but for SPREAD_TEST_BY_TEST, whose tests are units of their own: a file of many slow
    independent tests (the mesh parity runs: ~40 trainer runs) spreads over the workers instead of running on one
    while the others idle."""
    counts: dict = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
    spread = {config.rootpath / path for path in SPREAD_TEST_BY_TEST}
    for item in items:
        if item.path not in spread:
            item.add_marker(pytest.mark.xdist_group(str(item.path.relative_to(config.rootpath))))
    first = {config.rootpath / path: i for i, path in enumerate(LEARNING_RUNS_FIRST)}
    items.sort(key=lambda item: (first.get(item.path, len(first)), -counts[item.path]))
