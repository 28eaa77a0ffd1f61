"""The GPU tier's entry point as a user meets it on a machine without GPUs: `./run_tests.sh --gpu` (and
`./run_tests.sh --gpu --report [DIR]`, harness/gpu_report.py) prints one line, runs nothing and exits 0; and the tier's
cuda variants exist for every area it checks (they are collected in every tier, and only --gpu selects them)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_tier_without_a_visible_gpu_is_one_line_and_exit_0():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([os.path.join(ROOT, "run_tests.sh"), "--gpu"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no GPU visible" in done.stdout, done.stdout
    assert "nothing ran" in done.stdout


def test_gpu_report_without_a_visible_gpu_is_one_line_and_exit_0(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", WHEELS=str(tmp_path / "no-wheels-here"))
    done = subprocess.run([os.path.join(ROOT, "run_tests.sh"), "--gpu", "--report", str(tmp_path / "report")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no GPU visible" in done.stdout, done.stdout
    assert not (tmp_path / "report").exists()  # nothing ran, nothing was installed, nothing written


def test_gpu_report_with_no_folder_named_without_a_visible_gpu_is_one_line_and_exit_0():
    """With no OUTDIR the report would go to bench/measurements/<gpu>_gpu_report_<date>: without a GPU nothing is
    written there either."""
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    before = set(os.listdir(os.path.join(ROOT, "bench", "measurements")))
    done = subprocess.run([os.path.join(ROOT, "run_tests.sh"), "--gpu", "--report"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no GPU visible" in done.stdout, done.stdout
    assert set(os.listdir(os.path.join(ROOT, "bench", "measurements"))) == before


def test_report_goes_with_gpu_alone():
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    for args in (["--report", "out"], ["--report"], ["--gpu", "--report", "out", "-k", "x"]):
        done = subprocess.run([os.path.join(ROOT, "run_tests.sh"), *args], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and not done.stdout, (args, done.stdout, done.stderr)
        assert done.stderr.splitlines() == [done.stderr.strip()] and "./run_tests.sh --gpu --report [OUTDIR]" in \
            done.stderr, done.stderr


@pytest.mark.slow
def test_the_gpu_marker_selects_a_cuda_variant_of_every_check():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a collection of the whole suite, 17 s."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env())
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert selected and all("[cuda" in line for line in selected), done.stdout[-2000:]
    for area in ("test_gpu_block_kernels", "test_gpu_cp", "learns_with_document_masking", "test_trainer_fp32", "test_resume",
                 "test_dry_run_peak"):
        assert any(area in line for line in selected), (area, selected)


def _fake_tool(folder, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def _gpu_tier(folder, python: str, *args: str, cwd: str = ROOT, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHON=python, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}", **env)
    full.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([os.path.join(ROOT, "run_tests.sh"), "--gpu", *args], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_gpu_tier_with_gpus_listed_but_a_cpu_torch_fails_in_one_line(tmp_path):
    """The false pass: the driver lists a GPU (a faked nvidia-smi) while torch is this CPU build."""
    _fake_tool(tmp_path, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    done = _gpu_tier(tmp_path, sys.executable)
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stdout.strip()
    assert done.stdout.splitlines() == [line], done.stdout
    assert "nvidia-smi lists 1 GPU(s)" in line and "has no CUDA" in line and "TORCH_SPEC=" in line, line


def test_gpu_tier_with_no_gpu_listed_still_exits_0(tmp_path):
    _fake_tool(tmp_path, "nvidia-smi", "echo 'No devices were found'\nexit 6\n")
    done = _gpu_tier(tmp_path, sys.executable)
    assert done.returncode == 0 and "nothing ran" in done.stdout, done.stdout + done.stderr


def test_gpu_tier_prints_device_torch_and_cuda_before_it_runs(tmp_path):
    """With a CUDA torch (a stand-in interpreter answering as one would) the tier names what it runs on."""
    _fake_tool(tmp_path, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    _fake_tool(tmp_path, "cuda-python", 'if [ "$1" = "-c" ]; then echo "1 2.13.0+cu128 12.8 NVIDIA H100 80GB HBM3"; '
                                       'else echo "pytest $*"; fi\n')
    done = _gpu_tier(tmp_path, str(tmp_path / "cuda-python"))
    assert done.returncode == 0, done.stdout + done.stderr
    first, ran = done.stdout.splitlines()
    assert first == "GPU tier: 1 x NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8"
    assert ran == "pytest -m pytest -m gpu"


def test_gpu_report_runs_the_report_after_the_device_line_on_the_callers_folder(tmp_path):
    """With a CUDA torch (the same stand-in) the report starts with the caller's folders: run_tests.sh changes into
    the repository before it runs anything, so a relative OUTDIR and WHEELS are resolved first."""
    _fake_tool(tmp_path, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    _fake_tool(tmp_path, "cuda-python", 'if [ "$1" = "-c" ]; then echo "1 2.11.0+cu128 12.8 NVIDIA H100 80GB HBM3"; '
                                       'else echo "python $* WHEELS=$WHEELS"; fi\n')
    done = _gpu_tier(tmp_path, str(tmp_path / "cuda-python"), "--report", "out", cwd=str(tmp_path), WHEELS="wheels")
    assert done.returncode == 0, done.stdout + done.stderr
    first, ran = done.stdout.splitlines()
    assert first == "GPU tier: 1 x NVIDIA H100 80GB HBM3, torch 2.11.0+cu128, CUDA 12.8"
    assert ran == f"python -m harness.gpu_report {tmp_path / 'out'} WHEELS={tmp_path / 'wheels'}"
