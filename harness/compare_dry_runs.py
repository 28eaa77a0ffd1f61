"""Every recipe's dry run, kept as a baseline and compared field by field with a later one.

Why: the planning code is refactored (one workload, one fake world, one accelerator table) on the promise that no
dry-run figure moves unless a named bug was fixed. This script is how that promise is checked: `--save DIR` runs
`./run_train.sh RECIPE --dry-run` for every recipe in recipes/ and recipes/planned/ and keeps each dry_run.json;
`--compare DIR` runs them again and prints every field that differs (recipe, stage, field, before, after), so each
change can be named with the bug that made it. Fields that read this machine's state at the time (the memory free
now, for a CPU run) are left out: they differ between two runs of the same code.

    python harness/compare_dry_runs.py --save /tmp/before        # on the old commit
    python harness/compare_dry_runs.py --compare /tmp/before     # on the new one; exit 1 when a field moved
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINE_STATE_FIELDS = {"host_memory_gib_per_node"}
"""Read from this box's available memory when a recipe runs on CPU: not a planning figure."""
REL_TOL = 1e-9
NOISY_FIELDS = {"host_peak_gib_per_rank": 1e-3, "host_peak_gib_per_node": 1e-3}
"""Relative tolerances of figures that include the planning process's own resident memory at its start (the host
plan): two runs of one commit differ by a few hundred KiB in them."""


def recipes() -> list[str]:
    found = sorted(glob.glob(os.path.join(REPO, "recipes", "*.toml")))
    found += sorted(glob.glob(os.path.join(REPO, "recipes", "planned", "*.toml")))
    return [os.path.relpath(p, REPO) for p in found]


def run_all(out_dir: str) -> dict[str, dict]:
    """recipe -> its dry_run.json (or {"error": last lines} when the dry run failed)."""
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for recipe in recipes():
        dump = tempfile.mkdtemp(prefix="dry_run_", dir=out_dir)
        proc = subprocess.run([os.path.join(REPO, "run_train.sh"), recipe, "--dry-run", f"--job.dump_folder={dump}"],
                              cwd=REPO, env=env, capture_output=True, text=True)
        path = os.path.join(dump, "dry_run.json")
        if os.path.exists(path):
            with open(path) as f:
                results[recipe] = json.load(f)
        else:
            results[recipe] = {"error": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}
        print(f"{recipe}: {'ok' if 'error' not in results[recipe] else 'FAILED'} (exit {proc.returncode})",
              flush=True)
    return results


def differences(before, after, where: str = "", tol: float = REL_TOL) -> list[tuple[str, object, object]]:
    """(path, before, after) for every leaf that differs; floats compared to REL_TOL (NOISY_FIELDS to theirs)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after)):
            if key in MACHINE_STATE_FIELDS:
                continue
            out += differences(before.get(key), after.get(key), f"{where}.{key}" if where else key,
                               NOISY_FIELDS.get(key, tol))
        return out
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in differences(b, a, f"{where}[{i}]", tol)]
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and not isinstance(before, bool):
        same = math.isclose(before, after, rel_tol=tol, abs_tol=1e-12)
        return [] if same else [(where, before, after)]
    return [] if before == after else [(where, before, after)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="DIR", help="run every recipe's dry run and keep the results in DIR")
    mode.add_argument("--compare", metavar="DIR", help="run them again and compare with DIR's baseline")
    args = parser.parse_args(argv)
    folder = args.save or args.compare
    os.makedirs(folder, exist_ok=True)
    baseline_path = os.path.join(folder, "baseline.json")
    now = run_all(folder)
    if args.save:
        with open(baseline_path, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
        print(f"wrote {baseline_path} ({len(now)} recipes)")
        return 0
    with open(baseline_path) as f:
        before = json.load(f)
    changed = differences(before, now)
    for path, old, new in changed:
        print(f"changed {path}: {old!r} -> {new!r}")
    print(f"{len(changed)} field(s) changed over {len(now)} recipes")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
