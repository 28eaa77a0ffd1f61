"""Float8's one-line refusals before any process group (parallelisms/float8.check_float8): torchao missing, too old
or broken; a GPU without float8 GEMMs; and a run without float8 never imports torchao (the launch with torchao hidden).
Split from tests/training/test_float8.py, whose numeric tests need torchao: these run without it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from config import RecipeError
from config.recipe import load_config
from harness.launch_env import child_env, python_path
from tests.trainer_runs import ROOT, run_train

RECIPE = os.path.join(ROOT, "recipes", "debug.toml")


def _config(*overrides: str):
    return load_config(RECIPE, list(overrides))


def test_missing_old_or_broken_torchao_is_refused_in_one_line(monkeypatch):
    import importlib.metadata

    import parallelisms.float8 as float8

    cfg = _config("--training.float8", "rowwise")
    float8.check_float8(_config())  # off: nothing is checked

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    def broken():
        raise ImportError("cannot import name 'Float8LinearConfig'")

    for patch, cause in [(lambda m: m.setattr(importlib.metadata, "version", missing), "torchao is not installed"),
                         (lambda m: m.setattr(importlib.metadata, "version", lambda name: "0.14.1"),
                          "torchao 0.14.1 is older than 0.18"),
                         (lambda m: m.setattr(float8, "torchao", broken), "does not import with torch")]:
        with monkeypatch.context() as m:
            patch(m)
            with pytest.raises(RecipeError) as refused:
                float8.check_float8(cfg)
        message = str(refused.value)
        assert "\n" not in message and cause in message, message
        assert message.startswith(f"{RECIPE}: training.float8 = \"rowwise\" needs torchao 0.18.0"), message
        assert "pip install torchao==0.18.0" in message and 'training.float8 = "off"' in message, message


def test_a_gpu_without_float8_gemms_is_refused_in_one_line(monkeypatch):
    """An A100 (compute capability 8.0) has no float8 GEMM: the launch stops before any process group, naming the
    key, the recipe, the GPU and the fixes; with the GEMMs emulated it passes, and so does a Hopper GPU."""
    import torch

    import parallelisms.float8 as float8

    cfg = _config("--training.float8", "tensorwise")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    with pytest.raises(RecipeError) as refused:
        float8.check_float8(cfg)
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith(f'{RECIPE}: training.float8 = "tensorwise" cannot run here'), message
    assert "A100-SXM4-80GB, compute capability 8.0" in message and 'training.float8 = "off"' in message, message
    assert "training.float8_emulate = true" in message, message
    float8.check_float8(_config("--training.float8", "tensorwise", "--training.float8_emulate", "true"))  # emulated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    float8.check_float8(cfg)


@pytest.mark.slow
def test_launch_refuses_float8_without_torchao_and_runs_without_it_when_off(tmp_path):
    """With torchao hidden (a shadow package that fails to import, first on PYTHONPATH): float8 on stops in
    train.py's checks with one line before any process group; float8 off trains a step, so nothing imported it. Slow
    tier since issue 56 (the fast tier runs in minutes; CI runs both): launches through run_train.sh, one of them
    training, 37 s."""
    shadow = tmp_path / "shadow" / "torchao"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torchao hidden by the test')\n")
    env = child_env(str(tmp_path / "shadow"))
    refused = subprocess.run([sys.executable, "train.py", RECIPE, "--check", "--training.float8", "tensorwise"],
                             capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith(f"error: {RECIPE}: training.float8 = \"tensorwise\"") and "hidden" in lines[0]
    ran = run_train(RECIPE, "--training.steps", "1", "--training.seq_len", "64", "--parallelism.dp_shard", "1",
                    "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path / "out"), nproc=1,
                    forked=True, timeout=120, env={"PYTHONPATH": python_path(str(tmp_path / "shadow"))})
    assert ran.returncode == 0 and "float8" not in ran.stdout, ran.stderr[-2000:]
