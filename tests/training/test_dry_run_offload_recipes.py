"""The two cpu_offload recipes' dry runs (slow tier: the 8B one measures 512K-token blocks on fake tensors, about half
a minute): every stage fits, with the host line, and the host plan holds at least what an independent count says
must be on the host (16 bytes of fp32 master weight, gradient and two AdamW moments per parameter, Meta's published
parameter counts; for the 8B one also its offloaded block inputs: 512K tokens x 4,096 x 2 bytes x 32 blocks). And
--plan-ramp choosing the offload where nothing fits without it."""
from __future__ import annotations

import json

import pytest

from tests.trainer_runs import run_train

pytestmark = pytest.mark.slow
GIB = 2**30


def dry_run(recipe: str, folder) -> dict:
    done = run_train(recipe, "--dry-run", "--job.dump_folder", str(folder), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every stage fits" in done.stdout and "host memory (cuda run" in done.stdout, done.stdout[-3000:]
    with open(folder / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    assert stage["cpu_offload"] and stage["fits"] and stage["predicted_step_s"] > 0
    assert stage["host_peak_gib_per_node"] <= stage["host_memory_gib_per_node"]
    return stage


@pytest.mark.timeout(420)
def test_llama3_8b_512k_on_one_gpu_fits_with_its_state_and_activations_on_the_host(tmp_path):
    stage = dry_run("recipes/llama3_8b_500k_1gpu.toml", tmp_path)
    state = 16 * 8.03e9 / GIB
    block_inputs = 524288 * 4096 * 2 * 32 / GIB
    assert state + block_inputs <= stage["host_peak_gib_per_node"] <= 1.05 * (state + block_inputs) + 1, stage
    assert stage["peak_device_gib_per_rank"] <= 78


@pytest.mark.timeout(420)
def test_llama3_70b_128k_on_one_node_fits_with_its_state_on_the_host(tmp_path):
    stage = dry_run("recipes/llama3_70b_128k_8gpu.toml", tmp_path)
    state = 16 * 70.55e9 / GIB
    assert state <= stage["host_peak_gib_per_node"] <= 1.05 * state + 8, stage
    assert stage["peak_device_gib_per_rank"] < state / 8  # without the offload the state alone would not fit a GPU


@pytest.mark.timeout(300)
def test_plan_ramp_turns_cpu_offload_on_when_nothing_fits_without_it_and_says_so(tmp_path):
    """The debug model on one GPU of 0.1 GiB usable: its 0.09 GiB of training state leave no room for a 256-token
    stage, so the planner keeps the state on the host, says so, and the recipe it writes passes the dry run."""
    out = str(tmp_path / "planned.toml")
    small_gpu = ["--activation_checkpoint.mode", "full", "--hardware.device_memory_gib", "2.1",
                 "--training.seq_len", "256"]
    done = run_train("recipes/debug.toml", "--plan-ramp", "--gpus", "1", "--target-seq-len", "1024", "--out", out,
                     *small_gpu, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training.cpu_offload = true, chosen by the planner: 256 tokens fit no layout" in done.stdout, done.stdout
    with open(out) as f:
        assert "\ncpu_offload = true\n" in f.read()
    checked = run_train(out, "--dry-run", "--job.dump_folder", str(tmp_path / "dry"), env={"WORLD_SIZE": "1"},
                        forked=True, timeout=120)
    assert checked.returncode == 0 and "every stage fits" in checked.stdout, checked.stdout[-3000:]
