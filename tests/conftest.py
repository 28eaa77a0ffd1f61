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


def pytest_collection_modifyitems(config, items):
    """Files holding slow-tier tests run first, each file's tests kept together and in order (a stable sort by file).
    CI runs the tiers on two pytest-xdist workers, one file at a time each (`-n 2 --dist loadfile`): the minutes-long
    multi-rank files start first and the many short one-process files fill the other core around them, instead of a
    six-minute learning run starting last while the other worker sits idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
