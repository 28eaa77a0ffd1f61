"""The environment of a Python child that a test, a bench or a tool starts (train.py under torchrun, a probe, pytest):
the caller's environment with the repository root first on PYTHONPATH and the caller's own PYTHONPATH kept after it.

Why keep the caller's entries: a machine without network often gets its missing pure-Python packages installed
into a folder named on PYTHONPATH (`pip install --target DIR`). A child whose PYTHONPATH is replaced by the root
cannot import them: on the first GPU machine every trainer process the GPU tier started died with
`ModuleNotFoundError: torchdata`. Every launch in tests/ and bench/ goes through `child_env`, so the rule lives in
one place (tests/test_launch_env.py checks that, and that a launched trainer finds a module on the outer path).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_path(*first: str, inherited: str | None = None) -> str:
    """PYTHONPATH for a child: `first` (folders that must win, e.g. a test's shadow package), the repository root,
    then `inherited` (default: this process's PYTHONPATH). Repeats and empty entries are dropped: an empty entry
    would put the child's working directory on its path."""
    if inherited is None:
        inherited = os.environ.get("PYTHONPATH", "")
    entries = [*first, ROOT, *inherited.split(os.pathsep)]
    kept: list[str] = []
    for entry in entries:
        if entry and entry not in kept:
            kept.append(entry)
    return os.pathsep.join(kept)


def child_env(*first: str, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """A copy of `base` (default: os.environ) with `extra` set and PYTHONPATH from `python_path(*first)` over base's
    own PYTHONPATH. `extra` cannot name PYTHONPATH: pass folders that must come first as `first`."""
    if "PYTHONPATH" in extra:
        raise TypeError("child_env sets PYTHONPATH itself: pass folders that must come first as positional arguments")
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env["PYTHONPATH"] = python_path(*first, inherited=env.get("PYTHONPATH", ""))
    return env
