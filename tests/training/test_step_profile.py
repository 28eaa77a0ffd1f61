"""A profiled step (training/step_profile.py): its device seconds attributed to the dry run's classes of work, and
`[metrics] profile_step` writing them from a real trainer run with that step marked in metrics.jsonl."""
from __future__ import annotations

import json
import os

import pytest
import torch

from config import RecipeError
from config.recipe import load_config
from tests.trainer_runs import ROOT, read_metrics, run_train
from training.planning.fake.counter import kind_of, kind_of_name
from training.step_profile import profile_line, profiled_step

FIELDS = {"step", "rank", "device_type", "wall_s", "by_kind", "device_total_s", "unattributed_s", "top_ops"}


@pytest.mark.parametrize("op, kind", [
    (torch.ops.aten.mm.default, "gemm"), (torch.ops.aten.add.Tensor, "elementwise/other"),
    (torch.ops.aten._to_copy.default, "copy/cast"), (torch.ops.aten._foreach_add.List, "optimizer"),
    (torch.ops.aten.view.default, "no kernel")])
def test_kind_of_name_agrees_with_kind_of(op, kind):
    assert kind_of(op) == kind
    assert kind_of_name(op.namespace, op._opname, op.is_view) == kind


def test_a_profiled_cpu_workload_writes_its_gemm_seconds(tmp_path):
    path = str(tmp_path / "profile_step3_rank0.json")
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profiled_step(path, "cpu", 3, 0) as profile:
        for _ in range(4):
            c = torch.mm(a, b)
            a = a + c * 1e-3
    with open(path) as f:
        written = json.load(f)
    assert FIELDS <= set(written) and written == profile.summary
    assert (written["step"], written["rank"], written["device_type"]) == (3, 0, "cpu")
    assert written["by_kind"]["gemm"] > 0 and written["by_kind"]["elementwise/other"] > 0
    assert written["by_kind"]["gemm"] <= written["device_total_s"] + 1e-12
    assert written["wall_s"] > 0
    top = {name: (kind, calls) for name, kind, _, calls in written["top_ops"]}
    assert top["aten::mm"] == ("gemm", 4)
    line = profile_line(written, path)
    assert line.startswith("profile of step 3: ") and "gemm" in line and path in line


def test_a_failing_summary_warns_and_training_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with profiled_step(str(blocker / "profile.json"), "cpu", 1, 0) as profile:  # a folder that cannot be made
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    assert profile.summary is None
    assert "warning: step profile not written (" in capsys.readouterr().out


def test_the_trainer_profiles_the_asked_step(tmp_path):
    out = str(tmp_path / "run")
    result = run_train(os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", out,
                       "--training.steps", "3", "--metrics.profile_step", "2", "--parallelism.dp_shard", "1",
                       "--training.seq_len", "128", "--metrics.enable_tensorboard", "false",
                       nproc=1, forked=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with open(os.path.join(out, "profile_step2_rank0.json")) as f:
        written = json.load(f)
    assert written["step"] == 2 and written["by_kind"]["gemm"] > 0
    assert not os.path.exists(os.path.join(out, "profile_step1_rank0.json"))
    assert "profile of step 2: " in result.stdout
    profiled = {r["step"]: r.get("profiled", False) for r in read_metrics(out)}
    assert profiled == {1: False, 2: True, 3: False}


def test_a_negative_profile_step_is_refused():
    with pytest.raises(RecipeError, match=r"metrics\.profile_step must be >= 0"):
        load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--metrics.profile_step", "-1"])
