"""`training.cpu_offload` on a GPU: the parameters, gradients and AdamW state live in pinned host memory, so the
device holds less, and the losses follow the run without offload (the same weights, the host's fused AdamW instead
of the device's: rounding apart). A checkpoint and a Hugging Face export of the offloaded run are written, and the
checkpoint resumes without the offload. The CPU tiers prove the numerics on gloo ranks
(tests/training/test_cpu_offload_runs.py); this checks what only CUDA has: pinned shards, host/device copies and
NCCL next to host-resident tensors."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.gpu.devices import CUDA_ONLY, require
from tests.gpu.trainer_launch import SMALL, device_line, losses, metrics, train

RUN = (*SMALL, "--training.dtype", "float32", "--training.steps", "6", "--checkpoint.enable", "true",
       "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0", "--training.compile", "false")
"""Uncompiled: three launches within the GPU tier's per-test limit (the offload's copies are what is checked)."""
TOLERANCE = 5e-4
"""As tests/gpu/test_gpu_trainer.py's later steps: AdamW's first updates are about lr x sign(grad), so last-bit
differences between the host's and the device's fused AdamW move near-zero-gradient weights differently."""


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_offloaded_run_follows_the_plain_one_and_holds_less_on_the_device(tmp_path, device):
    require(device)
    plain = train(device, str(tmp_path / "plain"), *RUN)
    offloaded = train(device, str(tmp_path / "offloaded"), *RUN, "--training.cpu_offload", "true",
                      "--checkpoint.hf_export_folder", "hf")
    assert "cuda/nccl" in device_line(offloaded)
    a, b = losses(str(tmp_path / "plain")), losses(str(tmp_path / "offloaded"))
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    print(f"cpu_offload on CUDA: max relative loss difference {worst:.2e}; peak device GiB "
          f"{metrics(str(tmp_path / 'plain'))[-1]['memory']:.3f} -> {metrics(str(tmp_path / 'offloaded'))[-1]['memory']:.3f}")
    assert worst <= TOLERANCE, (a, b)
    assert metrics(str(tmp_path / "offloaded"))[-1]["memory"] < metrics(str(tmp_path / "plain"))[-1]["memory"]
    assert os.path.exists(tmp_path / "offloaded" / "hf" / "step-6" / "config.json")
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(tmp_path / "offloaded" / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    train(device, str(resumed), *RUN)
    c = losses(str(resumed))
    assert sorted(c) == [4, 5, 6]
    assert max(abs(c[s] - b[s]) / abs(b[s]) for s in c) <= TOLERANCE, (b, c)
