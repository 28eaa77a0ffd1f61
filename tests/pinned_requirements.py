"""A missing pinned requirement is a broken install, not a reason to skip: `pytest.importorskip` of a package that
requirements.txt or requirements-test.txt pins is turned into a failure (tests/conftest.py calls `as_failure`), so
eight modules cannot silently stop testing the HF path when transformers is absent."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENT_FILES = ("requirements.txt", "requirements-test.txt")
_IMPORT_SKIP = re.compile(r"could not import '([A-Za-z0-9_.]+)'")


def pinned_packages() -> set[str]:
    """Top-level import names of the pinned requirements (the distribution name, '-' read as '_')."""
    names = set()
    for name in REQUIREMENT_FILES:
        with open(os.path.join(ROOT, name)) as f:
            for line in f:
                spec = line.split("#")[0].strip()
                if spec and not spec.startswith("-"):
                    names.add(re.split(r"[=<>!~\[ ;]", spec)[0].lower().replace("-", "_"))
    return names


def missing_pinned(report) -> str | None:
    """The pinned package whose failed import skipped this report, or None."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    found = _IMPORT_SKIP.search(str(report.longrepr[2]))
    package = found.group(1).split(".")[0].lower() if found else None
    return package if package in pinned_packages() else None


def as_failure(report) -> None:
    """Rewrites a skip caused by a missing pinned package into a failure that says how to fix the install."""
    package = missing_pinned(report)
    if package:
        reason = report.longrepr[2]
        report.outcome = "failed"
        report.longrepr = (f"{reason}\n'{package}' is pinned in {' / '.join(REQUIREMENT_FILES)}: a test that needs "
                           f"it fails instead of skipping. Install the pins: pip install -r requirements-test.txt")
