"""Host syncs (issue 27): the counter sees what it must, and the trainer's micro-step at cp 2 x dp 2 with documents
and placement by work makes none (its plans come made from the loader's workers; nothing in the step reads a tensor
back to the host). The CPU run stands in for the GPU one: every host read of a tensor is counted, as it would be a
device-to-host copy there."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from harness.launch_env import child_env
from tests.trainer_runs import ROOT, short_documents_recipe
from training.planning.fake.counter import DispatchCounter

pytestmark = pytest.mark.timeout(300)


def test_counter_sees_scalar_reads_host_reads_and_device_to_host_copies():
    t = torch.arange(5)
    with DispatchCounter(strict=True) as syncs:
        t.tolist(), t.numpy(), t.cpu(), t[0].item(), bool(t[1] > 0), t + 1
    assert syncs.counts == {"_local_scalar_dense": 2, "host_read:tolist": 1, "host_read:numpy": 1,
                            "host_read:cpu": 1}
    with FakeTensorMode():
        x = torch.empty(4, device="cuda")
        with DispatchCounter() as syncs:
            x.cpu(), x.to("cpu", non_blocking=True), x.sum()
    assert syncs.counts == {"device_to_host": 2}


@pytest.mark.slow
def test_trainer_micro_step_at_cp2_dp2_with_documents_and_placement_makes_no_host_sync(tmp_path):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a 4-rank trainer micro-step, 29 s."""
    recipe = short_documents_recipe(str(tmp_path))
    out = tmp_path / "syncs"
    out.mkdir()
    args = [recipe, "--training.steps", "2", "--training.seq_len", "128", "--training.local_batch_size", "1",
            "--training.global_batch_size", "4", "--parallelism.dp_shard", "2", "--parallelism.cp", "2",
            "--data.document_masking", "true", "--data.placement", "work", "--parallelism.cp_load_balancer",
            "documents", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path / "run")]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "training", "host_sync_ranks.py"), "4", *args],
                            capture_output=True, text=True, timeout=240, cwd=ROOT,
                            env=child_env(HOST_SYNC_OUT=str(out)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    print(f"host syncs per rank over 2 steps x 2 micro-steps: {[r['syncs'] for r in per_rank]}")
    for record in per_rank:
        assert record["calls"] == {"micro_step": 4, "move_batch": 4}
        assert record["syncs"] == {}, record


def test_a_sync_anywhere_in_the_repository_is_named_by_its_file():
    """Issue 50, bug 1: the repository root was taken as training/ after host_syncs.py moved to training/planning/,
    so a `.item()` under parallelisms/ was reported as "outside the repository"."""
    import os

    import torch

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    namespace: dict = {}
    exec(compile("def read(x):\n    return x.sum().item()\n", os.path.join(root, "parallelisms", "cp", "rows.py"),
                 "exec"), namespace)  # a function whose frame lies in parallelisms/cp/rows.py
    with DispatchCounter(strict=True, where=True) as syncs:
        namespace["read"](torch.ones(2))
    assert syncs.places and all(place.startswith("_local_scalar_dense at parallelisms/cp/rows.py:2 read")
                                for place in syncs.places), syncs.places
