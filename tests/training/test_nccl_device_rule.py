"""The trainer under the process-level NCCL double, on CPU (tests/nccl_device_rule.py): every tensor that reaches a
collective must live on the run's device, as an NCCL group (CUDA only) requires; groups are made by the whole world;
reduce ops agree. Each run must train (and evaluate) as usual."""
import json
import os

import pytest

from harness.launch_env import child_env
from tests.distributed import forked_train
from tests.nccl_device_rule import install_with_report

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
    """train.py on `nproc` ranks, each under the double from its start (tests/nccl_device_rule.install_with_report),
    forked from the test process' forkserver (tests/distributed.forked_train): the subject is the collectives, not
    the launch, and torchrun's agent and a torch import per rank were most of these runs' cost (a 12-rank run
    imported torch 13 times)."""
    env = child_env(OMP_NUM_THREADS="1", NCCL_DOUBLE_REPORT=os.path.join(out, "nccl_double"))
    return forked_train(nproc, [recipe, "--job.dump_folder", out, *overrides], env, ROOT, timeout,
                        before_rank=install_with_report)


def _check(tmp_path, recipe_text: str, *overrides: str, nproc: int = 4, steps: int = 2, timeout: int = 240,
           one_collective_per_reduction: bool = False) -> str:
    """`one_collective_per_reduction`: also no DTensor warning that a redistribution ran sequential collectives
    (FSDP2 x TP's gradient norm over (dp_shard_cp, tp), issue 57: one all-reduce over the flattened group)."""
    recipe, out = tmp_path / "recipe.toml", str(tmp_path / "run")
    recipe.write_text(recipe_text)
    result = _train_under_rule(str(recipe), out, *overrides, nproc=nproc, timeout=timeout)
    rank0 = [line for line in result.stderr.splitlines()
             if line.startswith("[rank0]") and "^^^" not in line and not line.startswith("[rank0]:W")]
    assert result.returncode == 0, "\n".join(rank0[-12:]) or result.stderr[-3000:]
    if one_collective_per_reduction:
        sequential = [line for line in result.stderr.splitlines() if "sequential" in line]
        assert not sequential, sequential[0]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f if "loss" in json.loads(line)] == list(range(1, steps + 1))
    return out


def _double_report(out: str) -> list[dict]:
    """Per rank: the collectives the double checked (c10d: FSDP2 and the project's; _c10d_functional: DTensor)."""
    folder = os.path.join(out, "nccl_double")
    return [json.load(open(os.path.join(folder, name))) for name in sorted(os.listdir(folder))]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_keeps_every_collective_on_the_run_device(tmp_path):
    """dp 2 x cp 2 on passkey rows (their label count is reduced over dp) with the passkey evaluation (predictions
    gathered over cp): token counting, the loss, metrics and evaluation all pass through collectives. Slow tier since
    issue 56 (the fast tier runs in minutes; CI runs both): trainer ranks under the NCCL double, 23 s."""
    out = _check(tmp_path, PASSKEY)
    assert os.path.exists(os.path.join(out, "passkey_eval.json"))
    assert all(rank["collectives"] > 0 and rank["reductions_compared"] > 0 for rank in _double_report(out))


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


EVERY_EVAL = """
[model]
name = "debug"
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
[training]
steps = 2
seq_len = 256
local_batch_size = 1
[data]
corpus = ["pydoc"]
[parallelism]
cp = 2
tp = 2
[metrics]
enable_tensorboard = false
"""
EVALS = """
[eval]
long_doc_loss = true
long_doc_interval = 1
long_doc_rows = 8
long_doc_heldout = 0.05
passkey = true
passkey_lengths = [256]
passkey_depths = 2
passkey_samples = 2
niah = true
niah_lengths = [256]
niah_depths = 2
niah_samples = 2
niah_interval = 2
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp", [3, 2], ids=["dp3-evals", "dp2-evals"])
def test_trainer_step_and_every_eval_under_the_double(tmp_path, dp):
    """FSDP2 over dp_shard x cp, TP 2 (DTensor's functional collectives), CP 2, on a data-parallel degree that does
    not divide the eval rows (8 long-document rows, 4 passkey and 4 NIAH rows over dp 3): every collective of the
    step and of the long-document loss, passkey and NIAH evals passes the double's rules. The training-only run at
    dp 3 (12 ranks, 89 s of a contended CI) is merged into dp3-evals: two steps on the same mesh (of the rows left
    after the long-document loss holds out 5% of the documents) run first there, under the same double (which
    raises at the first collective off its rules) and the same assertions; the evals come after them. And the
    gradient norm's partials over (dp_shard_cp, tp) reduce in one all-reduce over their flattened group (before: two
    in sequence, and DTensor's warning on every rank of every such run)."""
    overrides = ("--parallelism.dp_shard", str(dp), "--data.cache_dir", str(tmp_path / "cache"))
    out = _check(tmp_path, EVERY_EVAL + EVALS, *overrides, nproc=dp * 4, timeout=540, one_collective_per_reduction=True)
    report = _double_report(out)
    assert len(report) == dp * 4
    assert all(rank["c10d"] > 0 and rank["_c10d_functional"] > 0 and rank["reductions_compared"] > 0
               and rank["buffers_delivered_at_wait"] > 0 for rank in report), report
    for name in ("passkey_eval.json", "niah_eval.json"):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert any("long_doc_loss" in line for line in f)
