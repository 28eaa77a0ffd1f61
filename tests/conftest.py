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


LONGEST_FILES = ("tests/training/test_passkey_training.py", "tests/training/test_chat_sft.py",
                 "tests/training/test_dry_run.py", "tests/parallelisms/test_parity.py",
                 "tests/training/test_checkpoint_runs.py", "tests/training/test_ramp.py", "tests/test_slurm.py",
                 "tests/parallelisms/test_documents_layout_training.py", "tests/training/test_compile.py",
                 "tests/training/test_nccl_device_rule.py")
"""The test files that took longest in CI (`.ci/run` prints the 40 slowest tests: passkey 401 s, SFT 293 s, the dry
runs ~350 s together, ...), longest first. A stale list only costs CI minutes, never a test."""


def pytest_collection_modifyitems(config, items):
    """Longest files first, each file's tests kept together and in order (a stable sort by file). CI runs the tiers on
    two pytest-xdist workers that keep this order (`-n 2 --dist worksteal`: each starts on its half of the list, an
    idle one takes half of the other's remaining queue): a six-minute learning run that starts last keeps CI waiting
    on one worker while the other sits idle (it did: the passkey and SFT runs, last in path order and again under
    `--dist loadfile`, which sorts files by their number of tests, ran alone for the final 8 minutes: CI 36.3 min).
    After `LONGEST_FILES`, the other files with slow-tier tests by their longest time limit (`pytest.mark.timeout`,
    which a test sets from what it needs), then the fast tier's one-process files fill in around them."""
    default = float(config.getini("timeout") or 0)
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    longest_limit: dict = {}
    for item in items:
        if item.get_closest_marker("slow"):
            marker = item.get_closest_marker("timeout")
            limit = float(marker.args[0]) if marker and marker.args else default
            longest_limit[item.path] = max(longest_limit.get(item.path, 0.0), limit)

    def order(item) -> tuple:
        path = item.path.relative_to(config.rootpath).as_posix()
        return (rank.get(path, len(rank)), -longest_limit.get(item.path, 0.0))

    items.sort(key=order)
