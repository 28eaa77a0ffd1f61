"""`training.cpu_offload` in real 2-rank gloo runs (slow tier; ranks forked by harness/forked_launch.py): the
reference is always the same recipe without the offload, or an uninterrupted run for the resumes.

On CPU the host is the device, so these runs prove FSDP2's offload code path (host-built shards, host gradients and
optimizer, the policy's copies) and its numbers; the memory it saves is only visible on a GPU. The loss comparisons
train a tiny model (tests/training/paced_runs.TINY: the same code path at any size; the debug model's steps were most
of their cost); the resident-set test keeps the debug model, whose memory its plan predicts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from tests.trainer_runs import ROOT, read_metrics, run_train
from tests.training.paced_runs import TINY

pytestmark = pytest.mark.slow

COMMON = ["--training.steps", "10", "--training.seq_len", "128", "--metrics.enable_tensorboard", "false",
          "--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
CP_AC_DOCUMENTS = ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--training.seq_len", "256",
                   "--data.document_masking", "true", "--activation_checkpoint.mode", "full",
                   "--activation_checkpoint.offload", "true", "--checkpoint.enable", "false"]


def losses(folder: str) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in read_metrics(folder)}


def train(folder: str, offload: bool, *extra: str) -> dict[int, float]:
    result = run_train(*COMMON, *TINY, "--job.dump_folder", folder, "--training.cpu_offload", str(offload).lower(),
                       *extra, nproc=2, timeout=240, forked=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return losses(folder)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """10 steps of the tiny model on dp_shard 2, fp32, without and with the offload (checkpoints at 5 and 10)."""
    root = tmp_path_factory.mktemp("offload")
    return {offload: (str(root / f"offload-{offload}"), train(str(root / f"offload-{offload}"), offload))
            for offload in (False, True)}


def worst_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b), (a, b)
    return max(abs(a[s] - b[s]) for s in a)


@pytest.mark.timeout(300)
def test_offloaded_fsdp_losses_equal_the_plain_run(fsdp_runs):
    plain, offloaded = fsdp_runs[False][1], fsdp_runs[True][1]
    assert sorted(plain) == list(range(1, 11))
    print(f"dp_shard 2: max |loss difference| over 10 steps: {worst_difference(offloaded, plain):.2e}")
    assert worst_difference(offloaded, plain) <= 1e-6, (plain, offloaded)


@pytest.mark.timeout(300)
def test_offload_composes_with_cp_full_ac_activation_offload_and_documents(tmp_path):
    plain = train(str(tmp_path / "plain"), False, *CP_AC_DOCUMENTS)
    offloaded = train(str(tmp_path / "offloaded"), True, *CP_AC_DOCUMENTS)
    print(f"cp 2 + AC full + activation offload + documents: max |loss difference|: "
          f"{worst_difference(offloaded, plain):.2e}")
    assert worst_difference(offloaded, plain) <= 1e-6, (plain, offloaded)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("resume_offloaded", [True, False])
def test_resume_an_offloaded_checkpoint_with_and_without_offload(tmp_path, fsdp_runs, resume_offloaded):
    """Steps 6-10 after resuming the offloaded run's step-5 checkpoint equal its uninterrupted steps bit for bit,
    whether the resumed job offloads or not (DCP reads host shards into device ones and back)."""
    source, straight = fsdp_runs[True]
    folder = tmp_path / "resumed"
    os.makedirs(folder / "checkpoints")
    shutil.copytree(os.path.join(source, "checkpoints", "step-5"), folder / "checkpoints" / "step-5")
    resumed = train(str(folder), resume_offloaded)
    assert sorted(resumed) == list(range(6, 11))
    assert all(resumed[s] == straight[s] for s in resumed), (straight, resumed)


RSS_RUN = ["--training.seq_len", "1024", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full",
           "--activation_checkpoint.offload", "true", "--training.steps", "2", "--checkpoint.enable", "false"]
RETURNING_ALLOCATOR = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}
"""glibc returning freed blocks at once: the resident set then follows the live tensors the plan counts (its default
heap keeps freed pages: training/launch_checks/host_memory.py). It replaces the tunables run_tests.sh sets for every
other test (blocks up to 32 MiB kept on the heap, which made this RSS 23% larger than the live tensors)."""


@pytest.mark.timeout(300)
def test_dry_run_host_peak_per_rank_matches_the_measured_peak_rss(tmp_path):
    """2 CPU ranks, AC full + activation offload, with and without cpu_offload: the dry run's host bytes per rank
    against the ranks' measured peak resident set (ru_maxrss, the larger rank's, metrics.jsonl `memory`)."""
    import json

    # a process of its own, not forked: the plan counts the dry run's own resident set as a rank's runtime, and a
    # forked child's is lower (its parent's library pages not yet touched): forked, 0.396 GiB against 0.462 measured
    plan = run_train("--dry-run", "--job.dump_folder", str(tmp_path / "plan"), *COMMON, *RSS_RUN,
                     env={"WORLD_SIZE": "2"})
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert "host memory (cpu run" in plan.stdout
    with open(tmp_path / "plan" / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    for offload in (False, True):
        folder = tmp_path / f"run-{offload}"
        # torchrun's own ranks (not forked from this interpreter, whose pages they would share): as run_train.sh
        # starts them, without its launch check
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", "train.py", "recipes/debug.toml", *COMMON, *RSS_RUN, "--job.dump_folder",
                                 str(folder), "--training.cpu_offload", str(offload).lower()], cwd=ROOT,
                                capture_output=True, text=True, timeout=240,
                                env=child_env(base={**os.environ, **RETURNING_ALLOCATOR}))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        measured = max(record["memory"] for record in read_metrics(str(folder)))
        error = stage["host_peak_gib_per_rank"] / measured - 1
        print(f"cpu_offload {offload}: host per rank predicted {stage['host_peak_gib_per_rank']:.3f} GiB, "
              f"measured peak RSS {measured:.3f} GiB ({100 * error:+.1f}%)")
        assert abs(error) <= 0.10, (stage["host_peak_gib_per_rank"], measured)
