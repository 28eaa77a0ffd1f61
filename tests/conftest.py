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

