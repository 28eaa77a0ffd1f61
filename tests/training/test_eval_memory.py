"""Evaluation memory: measured on real tensors it stays within the training step's peak at a 131,072-token vocabulary
(no whole logits); the dry run measures each stage's evaluations with the same fake-tensor probe as its training step,
writes them to dry_run.json and refuses an evaluation that does not fit in one line naming its key; the launch check
refuses an evaluation length a stage's CP ranks cannot split."""
from __future__ import annotations

import json
import os

import pytest
import torch

from config import RecipeError
from tests.distributed import run_ranks
from tests.trainer_runs import ROOT, run_train
from tests.training.real_step_memory import LiveStorages, persistent_storages, real_step_peaks

VOCAB, SEQ = 131_072, 4096
MIB = 2**20


def _cfg(*overrides):
    from config.recipe import load_config

    return load_config(os.path.join(ROOT, "recipes", "debug.toml"), list(overrides))


def _train_and_eval_peaks(rank, world_size):
    """Real bytes (live tensor storages, tests/training/real_step_memory.py) of one training step and of one
    long-document evaluation forward of the same row length on the trained model (training/evaluation/rows.py)."""
    from parallelisms.context_parallel import CommStats
    from training.build import build_model
    from training.evaluation.rows import eval_chunk_tokens, score_tokens
    from training.step import StepSetup
    from models.llama import recipe_model_config

    cfg = _cfg("--model.vocab_size", str(VOCAB), "--model.dim", "64", "--model.n_layers", "1", "--model.n_heads",
               "4", "--training.seq_len", str(SEQ), "--training.local_batch_size", "1",
               "--training.loss_chunk_tokens", "512", "--parallelism.dp_shard", "1")
    train = real_step_peaks(cfg, world_size)["peak"]
    from parallelisms.parallel_dims import ParallelDims
    dims = ParallelDims.resolve(1, 1, 1, 1, 1, world_size, where="test")
    mesh = dims.build_mesh("cpu")
    (model,) = build_model(cfg, recipe_model_config(cfg), mesh, torch.device("cpu")).parts
    from training.build import build_optimizer
    optimizer, _ = build_optimizer(cfg, [model])
    for param in model.parameters():  # the state a trained model has when it is evaluated: AdamW's moments
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    setup = StepSetup(model, mesh, cfg.parallelism, document_masking=False, loss_parallel=False, stats=CommStats(),
                      loss_chunk_tokens=cfg.training.loss_tile_tokens(VOCAB))
    ids = torch.randint(0, VOCAB, (1, SEQ))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)[None].clone()}
    model.eval()
    with torch.no_grad(), LiveStorages(persistent_storages(model, optimizer)) as live:
        loss, _ = score_tokens(model, batch, eval_chunk_tokens(setup.loss_chunk_tokens), sparse_labels=False)
    assert loss.shape == (1, SEQ) and torch.isfinite(loss).all()
    return train, live.peak


@pytest.mark.slow
def test_eval_peak_at_vocab_131072_and_seq_4096_is_within_the_training_step():
    """Whole logits would be 4096 x 131,072 x (4 B + 4 B float32 + 4 B log-softmax) = 6 GiB here; the chunked
    scores hold one 512-token chunk, as the training loss does. Slow tier since issue 56 (the fast tier runs in minutes;
    CI runs both): a 131,072-vocab evaluation probe, 29 s."""
    ((train, evaluation),) = run_ranks(_train_and_eval_peaks, world_size=1, timeout=300)
    print(f"real peaks: training step {train / MIB:.1f} MiB, evaluation {evaluation / MIB:.1f} MiB "
          f"(ratio {evaluation / train:.3f})")
    assert evaluation <= 1.1 * train, (train / MIB, evaluation / MIB)


def _dry_run_args(tmp_path, *more):
    return ("recipes/debug.toml", "--dry-run", "--model.n_layers", "2", "--job.dump_folder", str(tmp_path),
            "--training.seq_len", "256", "--eval.passkey", "true", *more)


def test_dry_run_measures_each_stage_evaluations_and_writes_them(tmp_path):
    done = run_train(*_dry_run_args(tmp_path), nproc=2, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    with open(tmp_path / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    assert 0 < stage["eval_peak_device_gib_per_rank"] <= stage["peak_device_gib_per_rank"] and stage["fits"]
    assert "eval GiB" in done.stdout


def test_dry_run_refuses_an_evaluation_that_does_not_fit_naming_its_key(tmp_path):
    """The training step at seq 256 fits in 0.2 GiB; passkey rows of 65,536 tokens x 4 rows per forward do not."""
    done = run_train(*_dry_run_args(tmp_path, "--eval.passkey_lengths", "65536", "--hardware.device_memory_gib",
                                    "2.2"), nproc=2, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    refusal = [line for line in done.stdout.splitlines() if "does NOT fit" in line]
    assert len(refusal) == 1 and "change eval.passkey_lengths" in refusal[0], done.stdout
    with open(tmp_path / "dry_run.json") as f:
        (stage,) = json.load(f)["stages"]
    assert not stage["fits"] and stage["eval_peak_device_gib_per_rank"] > 0.2


def test_launch_check_refuses_an_eval_length_the_stage_cp_cannot_split():
    from training.launch_checks.preflight import preflight_stages

    ramp = os.path.join(ROOT, "recipes", "debug_ramp.toml")
    from config.recipe import load_config
    # 1002 is evaluated from stage 1 on (seq 2048, cp 2: zigzag needs a multiple of 4): refused, naming key and stage
    with pytest.raises(RecipeError, match=r"ramp\[1\].*eval\.niah_lengths 1002 is not divisible by 4"):
        preflight_stages(load_config(ramp, ["--eval.niah", "true", "--eval.niah_lengths", "1002",
                                            "--eval.niah_interval", "2"]), 4, check_data=False)
    # passkey runs after the last stage only (cp 4: a multiple of 8)
    with pytest.raises(RecipeError, match=r"ramp\[2\].*eval\.passkey_lengths 1028 is not divisible by 8"):
        preflight_stages(load_config(ramp, ["--eval.passkey", "true", "--eval.passkey_lengths", "1028"]), 4,
                         check_data=False)
    preflight_stages(load_config(ramp, ["--eval.passkey", "true", "--eval.passkey_lengths", "1032"]), 4,
                     check_data=False)
