"""Shared pytest setup: the repo root on sys.path, and fewer torch threads so several ranks fit on 2 cores."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path set-up above)

from tests.pinned_requirements import as_failure  # noqa: E402


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
                       "tests/training/test_dry_run_8gpu.py", "tests/training/test_float8_runs.py")
"""The longest files start CI, beside the other files: the two learning runs (2-rank trainings of 4-7 minutes), the
8-GPU recipe's dry runs (about 3 minutes each under CI's load) and float8's long runs. After them the files with
the most tests first, as pytest-xdist's own `loadfile` order. With xdist's order the learning runs started last, 26
minutes into a 34-minute CI, and the passkey run finished alone with the cores partly idle."""


def pytest_collection_modifyitems(config, items):
    """CI runs `-n 3 --dist loadfile --no-loadscope-reorder`, which hands out files in this collection order: the
    learning runs first, then files by their number of tests, most first (a stable sort: tests keep their order)."""
    counts: dict = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
    first = {config.rootpath / path: i for i, path in enumerate(LEARNING_RUNS_FIRST)}
    items.sort(key=lambda item: (first.get(item.path, len(first)), -counts[item.path]))
