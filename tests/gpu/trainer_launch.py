"""Launch the real trainer (train.py under torchrun) on a chosen device for the GPU tier, and read what it wrote.

The device is the trainer's own run-time choice (CUDA + NCCL when a GPU is visible, else CPU + gloo); a CPU run hides
the GPUs (CUDA_VISIBLE_DEVICES=""), which is also how the GPU tier gets its CPU reference runs on a GPU machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_RECIPE = os.path.join(ROOT, "recipes", "debug.toml")
SMALL = ("--model.n_layers", "2", "--training.seq_len", "256", "--training.local_batch_size", "4",
         "--parallelism.dp_shard", "1", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2")
"""A 2-layer debug Llama at 256 tokens: seconds per run on a CPU, and still every kernel path on a GPU."""


def train(device: str, out: str, *overrides: str, nproc: int = 1, deterministic: bool = False,
          timeout: float = 600, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs train.py (debug recipe + `overrides`) on `nproc` ranks; fails the test with the log tail on an error.
    `wrapper`: what torchrun starts in each rank instead, with train.py as its first argument (a script, or
    "-m", MODULE), as `deterministic` starts tests/gpu/deterministic_run.py."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if deterministic:
        cmd.append(os.path.join(ROOT, "tests", "gpu", "deterministic_run.py"))
    cmd += wrapper
    cmd += [os.path.join(ROOT, "train.py"), DEBUG_RECIPE, "--job.dump_folder", out, *overrides]
    env = child_env()
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out: str) -> dict[int, float]:
    """step -> loss (a step logged twice keeps the last)."""
    return {record["step"]: record["loss"] for record in metrics(out)}


def device_line(result: subprocess.CompletedProcess) -> str:
    """The trainer's announcement of where it ran, e.g. '(cuda/nccl)'."""
    return next((line for line in result.stdout.splitlines() if "training " in line and " rank(s) (" in line), "")
