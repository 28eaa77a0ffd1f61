"""Every mesh trains like one process: per-step loss and grad norm of the real trainer (torchrun, fp32, 5 steps,
same rows) against a plain single-process Llama (tests/loss_reference.py's reference), token accounting that does not
count CP/TP ranks as data, and impossible meshes refused in one line before any process group starts."""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import pytest

from tests.loss_reference import GLOBAL_BATCH, MESHES, max_relative_error, reference_run, trainer_run, world_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, SEQ_LEN, TOLERANCE = 5, 128, 1e-5
# Pipeline schedules and AC modes (8 runs of 4-8 ranks) train 3 steps: steps 1-3 are lr warmup, whose lr does not
# depend on the run's length, so their losses and grad norms are those of the 5-step reference's first three.
SHORT_STEPS = 3
RUN_TIMEOUT = 900  # one trainer run; each test's pytest timeout adds the module's reference runs and a margin
FAST_MESHES = ("1 rank", "tp2", "pp2", "dp_shard2 x cp2")
# Issue 15's memory features, on in every trainer run of this module, at sizes that split each rank's tokens into
# several uneven chunks and tiles (and the off switches for the on-vs-off comparison). The reference never uses them.
FEATURES = ["--training.loss_chunk_tokens", "48", "--model.mlp_chunk_tokens", "40"]
FEATURES_OFF = ["--training.loss_chunk_tokens", "0", "--model.mlp_chunk_tokens", "0"]
ON_VS_OFF_TOLERANCE = 1e-6


@functools.cache
def _reference(dtype: str) -> list[dict]:
    """Once per test process: CI spreads this file's tests over its workers one by one (no module fixture ties them
    to one), and trainer_run shares each trainer run (FEATURES on) between the parity and the on-vs-off tests."""
    return reference_run(STEPS, SEQ_LEN, dtype=dtype)


@pytest.fixture
def reference():
    return copy.deepcopy(_reference("float32"))


def _check_run(reference, records, degrees):
    assert [r["step"] for r in records] == list(range(1, len(reference) + 1))
    errors = {key: max_relative_error(reference, records, key) for key in ("loss", "grad_norm")}
    print(f"{degrees}: max relative error vs the single process: {errors}")
    assert errors["loss"] <= TOLERANCE and errors["grad_norm"] <= TOLERANCE, (records, reference)
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN  # rows x tokens, never multiplied by the CP or TP degree
    for r in records:
        assert r["global_batch_size"] == GLOBAL_BATCH and r["seq_len"] == SEQ_LEN
        assert r["cp"] == degrees.get("cp", 1)
        assert r["tokens_seen"] == r["step"] * tokens_per_step
        assert r["tokens_per_step"] == tokens_per_step
        assert r["tokens_per_sec_per_rank"] == pytest.approx(r["tokens_per_sec"] / world_size(degrees), rel=1e-9)


def _mesh_params():
    params = []
    for name in MESHES:
        marks = () if name in FAST_MESHES else (pytest.mark.slow,)
        params.append(pytest.param(name, id=name.replace(" ", ""), marks=marks))
    return params


@pytest.mark.timeout(RUN_TIMEOUT + 240)
@pytest.mark.parametrize("name", _mesh_params())
def test_mesh_matches_single_process(reference, name):
    degrees = MESHES[name]
    _check_run(reference, trainer_run(degrees, STEPS, SEQ_LEN, extra=FEATURES, timeout=RUN_TIMEOUT), degrees)


def _on_vs_off_params():
    return [pytest.param(name, id=name.replace(" ", ""), marks=() if name in FAST_MESHES else (pytest.mark.slow,))
            for name in ("1 rank", "cp2", "tp2", "pp2", "pp2 x dp_shard2 x cp2 x tp2")]


@pytest.mark.timeout(2 * RUN_TIMEOUT + 240)
@pytest.mark.parametrize("name", _on_vs_off_params())
def test_chunked_loss_and_tiled_mlp_change_no_number(name):
    """Issue 15: the fused chunked loss (TP: vocabulary-sharded with loss parallelism; PP: on the last stage) and
    the tiled SwiGLU on vs off on the same mesh, fp32, 5 steps. Measured: <= 1.6e-7 relative in loss and grad norm
    on every mesh (float32 summation order over chunks and tiles)."""
    degrees = MESHES[name]
    on = trainer_run(degrees, STEPS, SEQ_LEN, extra=FEATURES, timeout=RUN_TIMEOUT)  # the parity test's run
    off = trainer_run(degrees, STEPS, SEQ_LEN, extra=FEATURES_OFF, timeout=RUN_TIMEOUT)
    errors = {key: max_relative_error(off, on, key) for key in ("loss", "grad_norm")}
    print(f"{name}: features on vs off, max relative difference {errors}")
    assert errors["loss"] <= ON_VS_OFF_TOLERANCE and errors["grad_norm"] <= ON_VS_OFF_TOLERANCE, (on, off)


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 240)
def test_passkey_rows_score_only_their_labelled_tokens_for_the_same_numbers():
    """Passkey rows label 5 answer digits per row: the chunked loss projects only those (sparse labels), against
    whole logits and F.cross_entropy on the same cp2 x tp2 mesh (vocabulary-sharded loss), fp32, 5 steps."""
    degrees, passkey = MESHES["cp2 x tp2"], ["--data.dataset", "passkey"]
    sparse = trainer_run(degrees, STEPS, SEQ_LEN, extra=[*passkey, *FEATURES], timeout=RUN_TIMEOUT)
    whole = trainer_run(degrees, STEPS, SEQ_LEN, extra=[*passkey, *FEATURES_OFF], timeout=RUN_TIMEOUT)
    errors = {key: max_relative_error(whole, sparse, key) for key in ("loss", "grad_norm")}
    print(f"passkey rows, cp2 x tp2: sparse chunked loss vs whole logits, max relative difference {errors}")
    assert errors["loss"] <= ON_VS_OFF_TOLERANCE and errors["grad_norm"] <= ON_VS_OFF_TOLERANCE, (sparse, whole)


# bf16 (issue 14): the reference is the same mixed-precision policy in one plain process (bf16 compute, fp32 master
# weights and gradients). Measured over 5 steps (max relative error): the bf16 reference vs the fp32 one differs by
# 4.3e-4 in loss and 5.6e-3 in grad norm (that is bf16's noise); dp_shard2 x cp2, cp2 x tp2 and the 1-rank trainer
# differ from the bf16 reference by at most 2.9e-5 in loss and 3.9e-4 in grad norm (summation order of bf16
# partial products). The bounds are ~3.5x those, and still ~4x below the bf16-vs-fp32 gap, so a mesh that silently
# ran fp32 (or a wrong policy) fails.
BF16_LOSS_TOLERANCE, BF16_GRAD_NORM_TOLERANCE = 1e-4, 1.5e-3


@pytest.fixture
def bf16_reference():
    return copy.deepcopy(_reference("bfloat16"))


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 240)
@pytest.mark.parametrize("name", ["1 rank", "dp_shard2 x cp2", "cp2 x tp2"])  # 1 rank: autocast, no FSDP2
def test_bf16_mesh_matches_single_process_mixed_precision(reference, bf16_reference, name):
    degrees = MESHES[name]
    records = trainer_run(degrees, STEPS, SEQ_LEN, extra=FEATURES, dtype="bfloat16", timeout=RUN_TIMEOUT)
    loss_error = max_relative_error(bf16_reference, records, "loss")
    norm_error = max_relative_error(bf16_reference, records, "grad_norm")
    print(f"bf16 {name}: max relative error vs the bf16 reference: loss {loss_error:.2e}, grad norm {norm_error:.2e}")
    assert loss_error <= BF16_LOSS_TOLERANCE and norm_error <= BF16_GRAD_NORM_TOLERANCE, (records, bf16_reference)
    # the tolerance can tell bf16 from fp32: the two references are further apart than it
    assert max_relative_error(reference, bf16_reference, "loss") > 2 * BF16_LOSS_TOLERANCE
    assert max_relative_error(reference, records, "loss") > 2 * BF16_LOSS_TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 240)
@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"])
def test_pipeline_schedules_with_tp_and_cp(reference, schedule):
    degrees = dict(pp=2, cp=2, tp=2, dp_shard=1)
    records = trainer_run(degrees, SHORT_STEPS, SEQ_LEN, extra=["--parallelism.pp_schedule", schedule, *FEATURES],
                          timeout=RUN_TIMEOUT)
    _check_run(reference[:SHORT_STEPS], records, degrees)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 240)
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_activation_checkpointing_under_cp_and_tp(reference, mode):
    degrees = dict(cp=2, tp=2, dp_shard=1)
    records = trainer_run(degrees, SHORT_STEPS, SEQ_LEN, extra=["--activation_checkpoint.mode", mode, *FEATURES],
                          timeout=RUN_TIMEOUT)
    _check_run(reference[:SHORT_STEPS], records, degrees)


# ---------------------------------------------------------------- impossible meshes: one line, before any collective
def _run_train(*args, nproc=None):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("NPROC", None)
    if nproc:
        env["NPROC"] = str(nproc)
    return subprocess.run([os.path.join(ROOT, "run_train.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args, nproc, expect", [
    (["--parallelism.tp", "3", "--parallelism.dp_shard", "1"], None, "n_heads 16 is not divisible by parallelism.tp 3"),
    (["--model.n_kv_heads", "2", "--parallelism.tp", "4", "--parallelism.dp_shard", "1"], None,
     "n_kv_heads 2 is not divisible by parallelism.tp 4"),
    (["--model.n_layers", "3", "--parallelism.pp", "4", "--parallelism.dp_shard", "1"], None,
     "n_layers 3 is fewer than the 4 pipeline stages"),
    (["--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--training.seq_len", "130"],
     None, "training.seq_len 130 is not divisible by 4"),
    (["--parallelism.tp", "2", "--parallelism.dp_shard", "1", "--training.seq_len", "127"], None,
     "training.seq_len 127 is not divisible by 2"),
    (["--parallelism.pp", "2", "--parallelism.dp_shard", "1", "--training.local_batch_size", "3",
      "--parallelism.pp_microbatches", "2"], None, "local_batch_size 3 cannot be split into"),
    (["--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 8,
     "= 4, but 8 ranks were launched"),
])
def test_impossible_mesh_fails_in_one_line(args, nproc, expect):
    result = _run_train(*args, "--job.dump_folder", os.devnull, nproc=nproc)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
