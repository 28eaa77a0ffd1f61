"""The trainer on a weighted two-source mixture with a ramp whose second stage changes the mix: per-source tokens in
metrics.jsonl, and a resume in the middle of the new-mix stage that gives the uninterrupted losses (bit-identical on
the same mesh; on another data-parallel degree within the reduction-order noise the other reshard tests allow)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from data.corpus import pydoc_documents
from tests.trainer_runs import read_metrics, run_train

pytestmark = pytest.mark.slow


def write_mixture_recipe(tmp_path) -> str:
    docs = pydoc_documents()
    for name, part in (("even", docs[0::2]), ("odd", docs[1::2])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f"""
[training]
steps = 6
seq_len = 128
local_batch_size = 2
tokens_per_step = 1024
[data]
cache_dir = "{tmp_path / 'cache'}"
[[data.sources]]
name = "even"
path = "{tmp_path / 'even.jsonl'}"
weight = 0.75
[[data.sources]]
name = "odd"
path = ["{tmp_path / 'odd.jsonl'}"]
weight = 0.25
[[ramp]]
start_step = 0
seq_len = 128
[[ramp]]
start_step = 3
seq_len = 256
source_weights = {{even = 0.125, odd = 0.875}}
[checkpoint]
enable = true
interval = 2
keep_latest_k = 0
[metrics]
enable_tensorboard = false
""")
    return str(recipe)


@pytest.mark.timeout(900)
def test_mixture_ramp_reports_tokens_per_source_and_resumes_exactly_inside_the_new_mix(tmp_path):
    recipe = write_mixture_recipe(tmp_path)
    straight = str(tmp_path / "straight")
    # forked ranks (tests/trainer_runs.run_train(forked=True)): the mix and the resume are the subject, not the launch
    result = run_train(recipe, "--job.dump_folder", straight, "--parallelism.dp_shard", "2", nproc=2, timeout=400,
                       forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 source(s)" in result.stdout
    records = read_metrics(straight)
    # 8 rows of 128 per step in stage 0 (6 even, 2 odd of each 8: 0.75 / 0.25 exactly), 4 rows of 256 in stage 1.
    by_step = {r["step"]: r["source_tokens"] for r in records}
    assert by_step[3] == {"even": 3 * 6 * 128, "odd": 3 * 2 * 128}
    stage1 = {name: by_step[6][name] - by_step[3][name] for name in ("even", "odd")}
    assert sum(stage1.values()) == 3 * 1024 and abs(stage1["odd"] / 3072 - 0.875) < 0.1, stage1
    assert all(sum(r["source_tokens"].values()) == r["tokens_seen"] for r in records)

    for nproc, mesh in ((2, "2"), (1, "1")):
        resumed = str(tmp_path / f"resumed-dp{mesh}")
        shutil.copytree(os.path.join(straight, "checkpoints", "step-4"),
                        os.path.join(resumed, "checkpoints", "step-4"))
        result = run_train(recipe, "--job.dump_folder", resumed, "--parallelism.dp_shard", mesh, nproc=nproc,
                           timeout=400, forked=True)
        assert result.returncode == 0, result.stderr[-3000:]
        after = {r["step"]: r for r in read_metrics(resumed)}
        assert sorted(after) == [5, 6]
        for step in (5, 6):
            want = records[step - 1]
            assert after[step]["source_tokens"] == want["source_tokens"]
            if mesh == "2":
                assert after[step]["loss"] == want["loss"]  # bit-identical in fp32
            else:
                assert abs(after[step]["loss"] - want["loss"]) / want["loss"] < 1e-5
