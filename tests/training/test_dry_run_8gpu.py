"""The 8-GPU recipe's dry runs at 1M (bf16 and float8) and 4M tokens (slow tier): the longest dry runs, in a file of
their own so CI starts them early, beside the learning runs (tests/conftest.py), instead of after the rest of
tests/training/test_dry_run.py on one worker."""
import json
import os
import re

import pytest

from tests.training.test_dry_run import ROOT, _run_train, table_rows


RECIPE_8GPU = os.path.join(ROOT, "recipes/llama3_8b_1m_8gpu.toml")
LIMIT_S = 1600
"""Each dry run's own limit (a hang guard, not a speed target): the 4M run passed 540 s in 4937939's clean-clone CI
with two other workers on the 2 cores, where the file's three runs took 1,186 s together; in 77b4ae0's (2026-12-02)
every dry run took 1.6-2x as long (the 1M run 435 s against 219, code unchanged) and the 4M run passed 1,000 s."""


def _recipe_parts() -> tuple[str, list[str]]:
    """The 8-GPU recipe split into what comes before its [[ramp]] tables, and each table."""
    with open(RECIPE_8GPU) as f:
        head, *stages = f.read().split("\n[[ramp]]")
    return head, ["\n[[ramp]]" + stage for stage in stages]


def _last_stage_only(tmp_path) -> str:
    """The 8-GPU recipe with its last [[ramp]] stage (1M tokens, cp 8) alone, from step 0: the stage issue 15 is
    about, measured as the whole ramp's dry run measures it, without the three shorter stages (CI time)."""
    head, stages = _recipe_parts()
    path = tmp_path / "llama3_8b_1m_8gpu_last_stage.toml"
    path.write_text(head + re.sub(r"start_step = \d+", "start_step = 0", stages[-1]))
    return str(path)


def _check_float8(done, stages, float8: str) -> None:
    assert all(s["fits"] and s["predicted_step_s"] > 0 and s["float8"] == float8 for s in stages), stages
    assert all(("float8_gemm" in s["predicted_parts_s"]) == (float8 != "off") for s in stages)
    assert ("float8: tensorwise (training.float8)" in done.stdout) == (float8 != "off")


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
def test_1m_tokens_fit_one_8_gpu_node(tmp_path):
    """Issue 15: Llama 3.1 8B at 1,048,576 tokens on 8 H100-80GB (cp 8, bf16, full AC) peaks <= 75 GiB per rank."""
    done, _ = _run_train(_last_stage_only(tmp_path), "--dry-run", "--job.dump_folder", str(tmp_path / "out"),
                         timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (row,) = table_rows(done.stdout)
    assert row["seq_len"] == "1,048,576" and row["cp"] == "8" and float(row["peak GiB"]) <= 75, row
    with open(tmp_path / "out" / "dry_run.json") as f:
        stages = json.load(f)["stages"]
    _check_float8(done, stages, "off")
    print(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
def test_1m_tokens_with_float8_fit_one_8_gpu_node_in_every_stage(tmp_path):
    """Issue 38: with float8 linear layers, every stage of the 8-GPU recipe's ramp predicted (step time and memory,
    measured on fake tensors with torchao's Float8Linear in the model) and fitting, the 1M stage within 75 GiB; the
    header says what runs in float8."""
    done, _ = _run_train(RECIPE_8GPU, "--dry-run", "--training.float8", "tensorwise",
                         "--job.dump_folder", str(tmp_path), timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = table_rows(done.stdout)
    (last,) = [r for r in rows if r["seq_len"] == "1,048,576"]
    assert last["cp"] == "8" and float(last["peak GiB"]) <= 75, rows
    with open(tmp_path / "dry_run.json") as f:
        stages = json.load(f)["stages"]
    assert len(stages) == 4, stages
    _check_float8(done, stages, "tensorwise")
    print(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
def test_4m_tokens_fit_one_8_gpu_node_with_activation_offload(tmp_path):
    """Issue 28: Llama 3.1 8B at 4,194,304 tokens on 8 x 80 GB (cp 8, 512K tokens per GPU, block inputs offloaded,
    norms tiled, attention in K/V head groups by size) peaks within 78 GiB per GPU, on the CPU kernels and on the
    CUDA path, with the node's pinned host memory within hardware.host_memory_gib: the last stage of
    recipes/planned/llama3_8b_4m_8gpu.toml."""
    single_stage = tmp_path / "llama3_8b_4m_8gpu.toml"  # the 8-GPU recipe without its ramp, one 4M stage
    single_stage.write_text(_recipe_parts()[0] + "\n")
    done, _ = _run_train(str(single_stage), "--dry-run", "--training.seq_len", "4194304", "--parallelism.cp", "8",
                         "--parallelism.dp_shard", "1", "--training.tokens_per_step", "4194304",
                         "--activation_checkpoint.offload", "true", "--job.dump_folder", str(tmp_path / "out"),
                         timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    with open(tmp_path / "out" / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    print(done.stdout)
    assert stage["seq_len"] == 4194304 and stage["cp"] == 8 and stage["fits"]
    assert stage["peak_device_gib_per_rank"] <= 78 and stage["peak_device_gib_per_rank_cuda_path"] <= 78, stage
    assert 0 < stage["host_gib_per_node"] <= stage["host_memory_gib_per_node"] == 2048, stage  # h100-sxm's node


PLANNED_8M = os.path.join(ROOT, "recipes/planned/llama3_8b_8m_8gpu.toml")


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
def test_8m_tokens_fit_one_8_gpu_node_on_the_planners_recipe(tmp_path):
    """Issue 59: Llama 3.1 8B at 8,388,608 tokens on 8 x H100 80 GB (cp 8: 1M tokens per GPU) fits the device
    (<= 78 GiB on the CPU kernels and on the CUDA path) and the node's 2,048 GiB of host memory, on the last stage of
    the recipe --plan-ramp wrote (recipes/planned/llama3_8b_8m_8gpu.toml: the attention sublayer in 8 head groups,
    block inputs offloaded without prefetch but the last two, the training state on the host). The last stage alone,
    from step 0 (CI time: the whole ramp's dry run is ~80 s here), with activation offload on as the ramp has it
    there (a stage's table names offload only where it changes: on since the 2M stage)."""
    with open(PLANNED_8M) as f:
        head, *stages = f.read().split("\n[[ramp]]")
    last = tmp_path / "llama3_8b_8m_8gpu_last_stage.toml"
    last.write_text(head + re.sub(r"start_step = \d+", "start_step = 0", "\n[[ramp]]" + stages[-1]))
    assert "offload = true" in stages[-2] and "offload" not in stages[-1], stages[-2:]
    done, _ = _run_train(str(last), "--dry-run", "--activation_checkpoint.offload", "true", "--job.dump_folder",
                         str(tmp_path / "out"), timeout=LIMIT_S)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    with open(tmp_path / "out" / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    print(done.stdout)
    assert stage["seq_len"] == 8388608 and stage["cp"] == 8 and stage["fits"], stage
    assert stage["peak_device_gib_per_rank"] <= 78 and stage["peak_device_gib_per_rank_cuda_path"] <= 78, stage
    assert 0 < stage["host_gib_per_node"] <= stage["host_memory_gib_per_node"] == 2048, stage
