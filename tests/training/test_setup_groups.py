"""Every process group is made at setup, by every rank (parallelisms/stage_meshes.py): hybrid CP under a pipeline
trains as one process does, and no group is created once training starts, across a ramp whose CP changes too."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from tests.distributed import run_ranks
from tests.trainer_runs import ROOT, max_rel_diff, read_metrics, train_losses
from tests.training.paced_runs import TINY

SMALL = ("--training.seq_len", "256", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
         "--lr_scheduler.warmup_steps", "1", "--data.document_masking", "false", *TINY)
"""The tiny model (two blocks, dim 64, 4 query and 2 key/value heads): what these tests check, the groups each rank
makes and when, does not depend on the model's size, and the hybrid CP's Ulysses 2 still splits the 2 key/value heads
over its ranks, pp 2 still one block per stage. The one-process run it is compared with trains the same shape.
Measured alone (counted CPU-s): the pp 2 x hybrid cp 4 test 31.6 -> 21-23, the ramp test 17.2 -> 10-12; at this
shape pp 2 x hybrid cp 4 equals the one process (0.0 relative), and a hybrid ring run without the causal mask is
3.9e-4 off (bound 1e-5)."""


def _census(out: str, *args, nproc: int, timeout: float = 500) -> tuple[list[dict], list[dict]]:
    """(per-rank group counts, metrics records) of a trainer run on `nproc` forked ranks (tests/group_census.py)."""
    command = [sys.executable, os.path.join(ROOT, "tests", "group_census.py"), str(nproc),
               os.path.join(ROOT, "train.py"), *args, "--job.dump_folder", out]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=child_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    counts = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "group_census_rank*.json")))]
    assert len(counts) == nproc, counts
    return counts, read_metrics(out)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hybrid_cp_under_pp2_trains_as_one_process_and_makes_no_group_after_setup(tmp_path):
    """pp 2 x cp 4 (hybrid: Ulysses 2 x ring 2) on 8 gloo ranks, 3 steps, against the single-process run."""
    args = (*SMALL, "--training.steps", "3", "--parallelism.dp_shard", "1")
    reference = train_losses(str(tmp_path / "one"), *args, "--parallelism.cp", "1", nproc=1)
    counts, records = _census(str(tmp_path / "pp2cp4"), *args, "--parallelism.pp", "2", "--parallelism.cp", "4",
                              "--parallelism.cp_impl", "hybrid", nproc=8)
    losses = [r["loss"] for r in records]
    print(f"pp2 x hybrid cp4: max relative loss difference {max_rel_diff(losses, reference):.2e}; groups made at "
          f"setup per rank {[c['setup'] for c in counts]}, after setup {[c['run'] for c in counts]}")
    assert max_rel_diff(losses, reference) <= 1e-5, (losses, reference)
    assert all(c["setup"] > 0 for c in counts) and [c["run"] for c in counts] == [0] * 8, counts


RAMP = """
[job]
seed = 0
[model]
name = "debug"
n_layers = 2
dim = 64
n_heads = 4
n_kv_heads = 2
[training]
steps = 3
seq_len = 128
local_batch_size = 2
tokens_per_step = 1024
[lr_scheduler]
warmup_steps = 1
[parallelism]
dp_shard = 4
cp_impl = "hybrid"
[data]
document_masking = false
[metrics]
enable_tensorboard = false
[[ramp]]
start_step = 0
seq_len = 128
cp = 1
[[ramp]]
start_step = 1
seq_len = 256
cp = 2
[[ramp]]
start_step = 2
seq_len = 512
cp = 4
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ramp_whose_cp_changes_makes_no_group_after_setup(tmp_path):
    """cp 1 -> 2 -> 4 (hybrid 2 x 2 at the end) on 4 ranks: all stages' groups exist before step 1; each switch
    destroys the old stage's own groups. The tiny model (RAMP's [model]; SMALL says why it is enough)."""
    recipe = tmp_path / "ramp.toml"
    recipe.write_text(RAMP)
    counts, records = _census(str(tmp_path / "ramp"), str(recipe), nproc=4)
    assert [(r["step"], r["cp"]) for r in records] == [(1, 1), (2, 2), (3, 4)]
    print(f"ramp cp 1 -> 2 -> 4: groups per rank (setup, after setup, destroyed at switches) "
          f"{[(c['setup'], c['run'], c['destroyed']) for c in counts]}")
    assert [c["run"] for c in counts] == [0] * 4, counts
    assert all(c["destroyed"] > 0 for c in counts), counts


def _stage_meshes(rank, world):
    import torch
    import torch.distributed as dist
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.stage_meshes import build_stage_meshes, release_stage

    dims = [ParallelDims(1, 1, 4, 1, 1, 4), ParallelDims(1, 1, 2, 2, 1, 4), ParallelDims(1, 1, 1, 4, 1, 4)]
    meshes = build_stage_meshes(dims, "cpu", lambda i, mesh: 2 if i == 2 else None)
    ranks = dist.get_process_group_ranks
    seen = {"cp": [ranks(m.cp_mesh.get_group()) for m in meshes], "data": [ranks(m.data.get_group()) for m in meshes],
            "hybrid": [ranks(g) for g in meshes[2].cp_subgroups[2]],
            "fsdp_shared": all(m.fsdp_shard.get_group() is meshes[0].fsdp_shard.get_group() for m in meshes)}
    cp_group = meshes[1].cp_mesh.get_group()
    seen["destroyed"] = release_stage(meshes[1], meshes[2:])
    total = torch.ones(1)
    dist.all_reduce(total, group=meshes[2].fsdp_shard.get_group())  # the shared FSDP group survives
    seen["fsdp_sum"] = total.item()
    seen["cp1_alive"] = cp_group in dist.distributed_c10d._world.pg_group_ranks
    return seen


def test_stage_meshes_share_what_stays_and_release_what_ends():
    """Three stages (cp 1, 2, 4) on 4 gloo ranks: each stage's CP and data groups, the hybrid 2 x 2 subgroups, one
    FSDP group for all; releasing stage 1 destroys its dp_shard, cp and data groups and nothing shared."""
    per_rank = run_ranks(_stage_meshes, 4, timeout=240)
    for rank, seen in enumerate(per_rank):
        assert seen["cp"] == [[rank], [rank // 2 * 2, rank // 2 * 2 + 1], [0, 1, 2, 3]]
        assert seen["data"] == [[0, 1, 2, 3], [rank % 2, rank % 2 + 2], [rank]]
        assert seen["hybrid"] == [[rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]]
        assert seen["fsdp_shared"] and seen["fsdp_sum"] == 4.0
        assert seen["destroyed"] == 3 and not seen["cp1_alive"], seen
