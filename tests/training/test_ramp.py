"""Context-length ramps: stage resolution, one-line errors before launch, and a real 4-rank ramp with exact resume."""
import os
import shutil

import pytest

from tests.trainer_runs import read_metrics, run_train
from tests.training.paced_runs import TINY
from config import RecipeError
from training.launch_checks.preflight import preflight_stages
from config.recipe import load_config

SMALL_RAMP = """
[job]
seed = 0
[model]
name = "debug"
[training]
steps = {steps}
seq_len = 128
local_batch_size = 4
tokens_per_step = 2048
[lr_scheduler]
warmup_steps = 1
[parallelism]
dp_shard = 4
[metrics]
enable_tensorboard = false
[checkpoint]
enable = {checkpoint}
interval = 1
keep_latest_k = 0
{stages}
"""

STAGES = [(0, 128, 1, 10000.0), (2, 256, 2, 40000.0), (4, 512, 4, 160000.0)]


def ramp_tables(stages):
    return "\n".join(f"[[ramp]]\nstart_step = {s}\nseq_len = {n}\ncp = {c}\nrope_theta = {t}\n" for s, n, c, t in stages)


def write_recipe(tmp_path, stages=STAGES, steps=6, checkpoint=False, name="ramp.toml"):
    path = tmp_path / name
    path.write_text(SMALL_RAMP.format(steps=steps, checkpoint=str(checkpoint).lower(), stages=ramp_tables(stages)))
    return str(path)


def test_debug_ramp_recipe_resolves_to_three_stages():
    stages = preflight_stages(load_config("recipes/debug_ramp.toml"), world_size=4)
    assert [(s.start_step, s.end_step) for s in stages] == [(0, 4), (4, 8), (8, 12)]
    assert [s.cfg.training.seq_len for s in stages] == [512, 2048, 8192]
    assert [(s.cfg.parallelism.cp, s.cfg.parallelism.dp_shard) for s in stages] == [(1, 4), (2, 2), (4, 1)]
    assert [s.cfg.model.rope_theta for s in stages] == [10000.0, 40000.0, 160000.0]
    assert [(s.cfg.training.global_batch_size, s.cfg.training.local_batch_size) for s in stages] == \
        [(32, 8), (8, 4), (2, 2)]
    assert {s.tokens_per_step for s in stages} == {16384}


@pytest.mark.parametrize("stages, steps, expect", [
    ([(0, 128, 1, 1e4), (0, 256, 2, 1e4)], 6, "ramp[1] (start_step 0): start_step must increase"),
    ([(0, 128, 1, 1e4), (2, 4, 4, 1e4)], 6, "training.seq_len 4 is not divisible by 8"),
    ([(0, 128, 1, 1e4), (2, 192, 3, 1e4)], 6, "cp 3 cannot be traded against dp_shard"),
    ([(0, 128, 1, 1e4), (6, 256, 2, 1e4)], 6, "starts at or after the last step"),
    ([(1, 128, 1, 1e4)], 6, "the first stage must start at step 0"),
    ([(0, 128, 1, 1e4), (2, 384, 2, 1e4)], 6, "not a multiple of seq_len 384"),
])
def test_bad_ramps_are_one_line_errors(tmp_path, stages, steps, expect):
    with pytest.raises(RecipeError) as err:
        preflight_stages(load_config(write_recipe(tmp_path, stages, steps)), world_size=4)
    assert expect in str(err.value) and "\n" not in str(err.value)


def test_bad_ramp_is_refused_before_launch(tmp_path):
    result = run_train(write_recipe(tmp_path, [(0, 128, 1, 1e4), (2, 192, 3, 1e4)]), nproc=4, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "cp 3 cannot be traded" in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1320)  # two 4-rank runs allowed 600 s each
def test_ramp_switches_stages_and_resumes_exactly_mid_stage(tmp_path):
    """Three stages (seq 128 / 256 / 512, cp 1 / 2 / 4, rope theta growing) on 4 ranks, then a resume from the
    checkpoint in the middle of stage 1. A tiny model (tests/training/paced_runs.TINY: switching stages and resuming
    exactly show at any size; the debug model's 512-token steps were most of the cost), its ranks forked from one
    interpreter (the ramp is the subject, not the launch: test_bad_ramp_is_refused_before_launch goes through
    run_train.sh)."""
    recipe = write_recipe(tmp_path, checkpoint=True)
    straight = str(tmp_path / "straight")
    result = run_train(recipe, *TINY, "--job.dump_folder", straight, nproc=4, timeout=600, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(straight)
    assert [(r["step"], r["seq_len"], r["cp"], r["rope_theta"]) for r in records] == [
        (1, 128, 1, 1e4), (2, 128, 1, 1e4), (3, 256, 2, 4e4), (4, 256, 2, 4e4), (5, 512, 4, 1.6e5), (6, 512, 4, 1.6e5)]
    assert {r["global_batch_size"] * r["seq_len"] for r in records} == {2048}
    assert [r["tokens_seen"] for r in records] == [2048 * s for s in range(1, 7)]

    # Stop in the middle of stage 1 (after step 3 of its steps 3-4): a fresh run folder holding only that checkpoint.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(straight, "checkpoints", "step-3"), os.path.join(resumed, "checkpoints", "step-3"))
    result = run_train(recipe, *TINY, "--job.dump_folder", resumed, nproc=4, timeout=600, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    after = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(after) == [4, 5, 6]
    assert [after[s] for s in (4, 5, 6)] == [r["loss"] for r in records[3:]]  # bit-identical in fp32
