"""The trainer under NCCL's device rule, emulated on CPU (tests/nccl_device_rule.py): every tensor that reaches a
collective must live on the run's device, as an NCCL group (CUDA only) requires. Each run must train as usual."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PASSKEY = """
[model]
name = "debug"
dim = 64
n_layers = 2
n_heads = 4
[training]
steps = 2
seq_len = 128
local_batch_size = 2
[data]
dataset = "passkey"
[parallelism]
dp_shard = 2
cp = 2
[eval]
passkey = true
passkey_lengths = [128]
passkey_depths = 2
passkey_samples = 2
[metrics]
enable_tensorboard = false
"""
DOCUMENTS = """
[model]
name = "debug"
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
[training]
steps = 2
seq_len = 128
local_batch_size = 2
[data]
document_masking = true
[parallelism]
dp_shard = 1
cp = 4
[metrics]
enable_tensorboard = false
"""


def _train_under_rule(recipe: str, out: str, *overrides: str, nproc: int = 4, timeout: int = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "tests", "nccl_device_rule.py"), os.path.join(ROOT, "train.py"), recipe,
           "--job.dump_folder", out, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _check(tmp_path, recipe_text: str, *overrides: str) -> str:
    recipe, out = tmp_path / "recipe.toml", str(tmp_path / "run")
    recipe.write_text(recipe_text)
    result = _train_under_rule(str(recipe), out, *overrides)
    rank0 = [line for line in result.stderr.splitlines() if line.startswith("[rank0]") and "^^^" not in line]
    assert result.returncode == 0, "\n".join(rank0[-12:]) or result.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    return out


@pytest.mark.timeout(300)
def test_trainer_keeps_every_collective_on_the_run_device(tmp_path):
    """dp 2 x cp 2 on passkey rows (their label count is reduced over dp) with the passkey evaluation (predictions
    gathered over cp): token counting, the loss, metrics and evaluation all pass through collectives."""
    out = _check(tmp_path, PASSKEY)
    assert os.path.exists(os.path.join(out, "passkey_eval.json"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [
    ("--parallelism.cp_impl", "ulysses"), ("--parallelism.cp_impl", "hybrid"), ("--parallelism.cp_impl", "allgather"),
    ("--parallelism.cp", "2", "--parallelism.tp", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1"),
    ("--parallelism.cp", "2", "--parallelism.pp", "2", "--data.document_masking", "false"),
], ids=["ulysses", "hybrid", "allgather", "cp2xtp2-checkpoint", "pp2xcp2"])
def test_every_cp_variant_and_mesh_keeps_collectives_on_the_run_device(tmp_path, overrides):
    """Document masking with GQA through every CP variant (plans, masks, all-to-all, all-gather), TP with its
    norm reductions and a checkpoint, and pipeline parallelism."""
    _check(tmp_path, DOCUMENTS, *overrides)
