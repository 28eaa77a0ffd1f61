"""The GPU tier's entry point as a user meets it on a machine without GPUs: `./run_tests.sh --gpu` prints one line,
runs nothing and exits 0; and the tier's cuda variants exist for every area it checks (they are collected in every
tier, and only --gpu selects them)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_tier_without_a_visible_gpu_is_one_line_and_exit_0():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([os.path.join(ROOT, "run_tests.sh"), "--gpu"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no GPU visible" in done.stdout, done.stdout
    assert "nothing ran" in done.stdout


def test_the_gpu_marker_selects_a_cuda_variant_of_every_check():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert selected and all("[cuda" in line for line in selected), done.stdout[-2000:]
    for area in ("test_gpu_block_kernels", "test_gpu_cp", "learns_with_document_masking", "test_trainer_fp32", "test_resume",
                 "test_dry_run_peak"):
        assert any(area in line for line in selected), (area, selected)
