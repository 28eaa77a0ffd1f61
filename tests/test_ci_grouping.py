"""CI's work units hold: under `--dist loadgroup` every test of a file runs on one xdist worker (tests/conftest.py marks
each file as one xdist group), so a module fixture or a module's cache is computed once, not once per worker.

Why a test: with pytest 9.2.0 and pytest-xdist 3.8.0 the group marks were silently ignored (pytest 9.2 keeps node ids
structured, and xdist still writes the group into the old string field: pytest-xdist#1386). Every file was handed out
test by test for the whole life of this suite: in 7740542's clean-clone CI, test_fake_cuda_step_syncs' module fixture
(five fake-CUDA probes, ~72 CPU-s) ran on all three workers, 216 CPU-s instead of 72. Nothing failed; only the CI got
longer. This runs a small suite the way CI does (tests/conftest.py's own hook, two workers) and checks where its tests
ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONFTEST = f"""import sys
sys.path.insert(0, {ROOT!r})
from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook CI runs under)
"""
_TESTS = """import json, os, time
import pytest

@pytest.mark.parametrize("i", range(4))
def test_where(i):
    time.sleep(0.05)  # long enough that an idle worker would take the next test if the file were not one unit
    with open(os.environ["WHERE_FILE"], "a") as f:
        f.write(json.dumps([__name__, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_every_test_of_a_file_runs_on_one_worker(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(_CONFTEST)
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (suite / name).write_text(_TESTS)
    where = tmp_path / "where.jsonl"
    env = {**os.environ, "WHERE_FILE": str(where), "PYTEST_ADDOPTS": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--no-loadscope-reorder", "-c", os.devnull, "--rootdir", str(suite),
                           str(suite)], capture_output=True, text=True, timeout=120, cwd=str(suite), env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers: dict[str, set] = {}
    for line in where.read_text().splitlines():
        module, worker = json.loads(line)
        workers.setdefault(module, set()).add(worker)
    assert sorted(workers) == ["test_a", "test_b", "test_c"], workers
    assert all(len(w) == 1 for w in workers.values()), f"a file's tests ran on several workers: {workers}"
    assert len(set().union(*workers.values())) == 2, workers  # and the files still spread over the workers
