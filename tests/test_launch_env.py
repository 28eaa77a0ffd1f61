"""Launched processes keep the caller's PYTHONPATH (harness/launch_env.py): the repository root goes first, the
caller's folders stay after it. On the first GPU machine torchdata lived in a folder on PYTHONPATH, and every trainer
process the GPU tier started died with `ModuleNotFoundError: torchdata`, because each launcher replaced PYTHONPATH
with the root. Here a module that only an outside folder on the caller's PYTHONPATH holds must be importable by a
real trainer launch (tests/gpu/trainer_launch.py, the GPU tier's launcher, on the CPU), and no launcher in tests/
or bench/ may set PYTHONPATH by hand."""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

from harness.launch_env import ROOT, child_env, python_path
from tests.gpu.trainer_launch import SMALL, metrics, train

MARKER = '''"""Only on the caller's PYTHONPATH: torchrun starts it in the rank, and it runs train.py."""
import runpy
import sys

print("outside_marker imported", flush=True)
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''


def test_the_root_goes_first_and_the_callers_folders_stay():
    inherited = os.pathsep.join(["/site/a", "", ROOT, "/site/b"])
    assert python_path(inherited=inherited) == os.pathsep.join([ROOT, "/site/a", "/site/b"])
    assert python_path("/shadow", inherited="/site/a") == os.pathsep.join(["/shadow", ROOT, "/site/a"])
    assert python_path(inherited="") == ROOT


def test_child_env_keeps_the_rest_of_the_environment_and_refuses_a_pythonpath_by_hand():
    env = child_env(base={"PYTHONPATH": "/site/a", "HOME": "/h"}, OMP_NUM_THREADS="1")
    assert env == {"PYTHONPATH": os.pathsep.join([ROOT, "/site/a"]), "HOME": "/h", "OMP_NUM_THREADS": "1"}
    with pytest.raises(TypeError, match="positional"):
        child_env(PYTHONPATH="/x")


@pytest.mark.slow
def test_a_trainer_launch_imports_a_module_only_the_callers_pythonpath_holds(tmp_path, monkeypatch):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a real trainer launch, 18 s."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "outside_marker.py").write_text(MARKER)
    monkeypatch.setenv("PYTHONPATH", str(outside))
    out = str(tmp_path / "run")
    result = train("cpu", out, *SMALL, "--training.steps", "1", wrapper=("-m", "outside_marker"), timeout=300)
    assert "outside_marker imported" in result.stdout, result.stdout[-2000:]
    assert [record["step"] for record in metrics(out)] == [1]


def _pythonpath_set_by_hand(path: pathlib.Path) -> list[int]:
    """Lines that set PYTHONPATH other than through python_path(): a keyword argument, a dict key or an item
    assignment."""
    def by_shared_function(value) -> bool:
        name = getattr(value, "func", None)
        return isinstance(value, ast.Call) and getattr(name, "id", getattr(name, "attr", "")) == "python_path"

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.keyword) and node.arg == "PYTHONPATH":
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            lines += [key.lineno for key, value in zip(node.keys, node.values) if isinstance(key, ast.Constant)
                      and key.value == "PYTHONPATH" and not by_shared_function(value)]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [t.lineno for t in targets if isinstance(t, ast.Subscript)
                      and isinstance(t.slice, ast.Constant) and t.slice.value == "PYTHONPATH"]
    return lines


def test_every_launcher_in_tests_and_bench_goes_through_the_shared_function():
    root = pathlib.Path(ROOT)
    own = {root / "harness" / "launch_env.py", pathlib.Path(__file__).resolve()}  # the function and its own cases
    files = [p for folder in ("tests", "bench", "harness") for p in sorted((root / folder).rglob("*.py"))
             if p.resolve() not in own]
    assert len(files) > 50
    found = {str(p.relative_to(root)): lines for p in files if (lines := _pythonpath_set_by_hand(p))}
    assert not found, f"set PYTHONPATH through harness.launch_env.child_env / python_path instead: {found}"
