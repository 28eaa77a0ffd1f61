"""bench/bench_predictions.py: measuring (here on the CPU, tiny shapes) writes what predicting reads, a run that
outlives its limit is stopped with its worker, and the H100 measurement shipped in bench/measurements/ stays
predicted within issue 37's 15% by the dry run with the shipped rates file (step time) and within 2% (peak memory)
for every run that the model prices as it runs: plain causal attention, eager or compiled."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_predictions.py")
SHIPPED = os.path.join(ROOT, "bench", "measurements", "h100-sxm_bench-shape_2026-11-27.json")
TINY = ["--device", "cpu", "--seqs", "256", "--dim", "128", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1"]


def _bench(*args, timeout=600, **env):
    return subprocess.run([sys.executable, BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=child_env(OMP_NUM_THREADS="1", **env))


@pytest.mark.slow
def test_measuring_writes_what_predicting_reads(tmp_path):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the bench's trainer runs and dry runs, 70
    s."""
    measured = tmp_path / "measured.json"
    done = _bench(*TINY, "--ac", "none,full", "--measured", str(measured), "--profile-step", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(measured.read_text())
    assert data["device_name"] == "cpu" and [r["ac"] for r in data["runs"]] == ["none", "full"]
    for run in data["runs"]:
        assert run["measured_step_s"] > 0 and run["measured_peak_gib"] > 0
        assert run["timed_steps"] == 6  # 10 steps, 3 of warm-up, the profiled step 5 left out
        assert run["profile"]["by_kind"]["gemm"] > 0
    done = _bench("--predict", str(measured), "--accelerator", "h100-sxm")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| dim 128 x 2 layers, 256, AC ")]
    assert len(rows) == 2 and all(len(row.split("|")) == 9 for row in rows)
    assert done.stdout.splitlines()[-1].endswith("of 2 predicted step times within 15% of the measured ones")


def test_a_run_past_its_limit_is_stopped_with_its_worker(tmp_path):
    measured = tmp_path / "measured.json"
    # the run's dump folder, on every process's command line, lies under tmp_path: pgrep finds what is left of it
    done = _bench(*TINY, "--ac", "none", "--measured", str(measured), "--timeout", "2", timeout=120,
                  TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(measured.read_text())["runs"]
    assert run["error"] == "no result within 2 s"
    workers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert workers.stdout.strip() == ""  # torchrun's worker (its own session) went with it


@pytest.mark.slow
def test_the_shipped_h100_runs_stay_predicted_within_15_percent(tmp_path):
    """Measured on one H100 SXM (torch 2.11) by `python bench/bench_predictions.py` (bench/measurements/). The runs
    with documents masked are not held to the bound, so not predicted here (CI time; the bench prints them): they
    ran the earlier documents path (the CP machinery at CP 1), which the H200 files below measure again."""
    with open(SHIPPED) as f:
        shipped = json.load(f)
    shipped["runs"] = [run for run in shipped["runs"] if not run["documents"]]
    held_runs = tmp_path / "held.json"
    held_runs.write_text(json.dumps(shipped))
    done = _bench("--predict", str(held_runs), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and "K, AC" in line}
    assert len(rows) >= 7 and not any("documents" in name for name in rows), rows
    dim = {run["dim"] for run in shipped["runs"]}.pop()
    for name in rows:
        step_ratio, measured_gib, predicted_gib = float(rows[name][2]), float(rows[name][3]), float(rows[name][4])
        assert abs(step_ratio - 1) <= 0.15, (name, rows[name])
        if "compiled" not in name:  # compiled regions keep fewer activations than the eager probe counts
            # These runs were measured before the chunked loss stopped holding the hidden states' gradient through
            # the whole backward (models/chunked_loss.py): the code predicted now holds up to that bf16 (tokens x
            # dim) gradient less than the code measured then. The next GPU run of bench_predictions measures again.
            released_gib = int(name.split("K")[0]) * 1024 * dim * 2 / 2**30
            assert -0.02 * measured_gib <= measured_gib - predicted_gib <= released_gib + 0.02 * measured_gib, (
                name, rows[name], released_gib)


H200 = os.path.join(ROOT, "bench", "measurements", "h200_documents_2026-11-28")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["predictions_64k.json", os.path.join("thd_recheck", "predictions_thd.json")])
def test_the_h200_documents_runs_stay_predicted_within_15_percent(name):
    """Issue 46: packed documents priced on the recipe's own documents (here Python's pydoc corpus, tokenized with
    the run's tokenizer) at the kernel each run took (cuDNN THD or FlashAttention-2 varlen: the measured file names
    it), piece by piece (training/planning/documents_cost.py), eager and compiled, at 8K and 64K."""
    done = _bench("--predict", os.path.join(H200, name), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and "documents" in line}
    assert len(rows) >= 3, done.stdout
    for name, cells in rows.items():
        assert abs(float(cells[2]) - 1) <= 0.15, (name, cells)
