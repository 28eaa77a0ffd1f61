"""The trainer with parallelism.cp_load_balancer = "documents" (slow tier): its losses are those of every document
run alone through a plain model (cp2 x tp2; dp_shard2 x cp2 with data-parallel placement, on short documents so that
rows hold several), and a dp_shard2 x cp2 run resumed from a zigzag checkpoint onto the documents layout continues the
zigzag run's losses."""
import os
import shutil

import pytest

from bench.loss_parity import max_relative_error, reference_run, trainer_run
from tests.trainer_runs import read_metrics, run_train, short_documents_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

DOCUMENTS = ["--data.document_masking", "true", "--parallelism.cp_load_balancer", "documents"]


def test_documents_layout_on_cp2_tp2_matches_every_document_run_alone():
    steps, seq = 3, 192
    alone = reference_run(steps, seq, document_masking=True)
    records = trainer_run(dict(cp=2, tp=2, dp_shard=1), steps, seq, extra=DOCUMENTS, timeout=300)
    errors = {key: max_relative_error(alone, records, key) for key in ("loss", "grad_norm")}
    print(f"documents layout, cp2 x tp2: max relative error vs documents run alone: {errors}")
    assert errors["loss"] <= 1e-5 and errors["grad_norm"] <= 1e-5, (records, alone)


def test_documents_and_zigzag_with_placement_on_dp_shard2_cp2_match_every_document_run_alone(tmp_path):
    """Segments placed by work over 2 data-parallel ranks x 2 micro-steps, then laid out over cp 2 by documents or by
    zigzag: both are the documents run alone, and each other, within 1e-5."""
    steps, seq, recipe = 3, 128, short_documents_recipe(str(tmp_path))
    alone = reference_run(steps, seq, recipe=recipe, document_masking=True)
    placed = ["--data.document_masking", "true", "--data.placement", "work", "--training.local_batch_size", "1",
              "--training.global_batch_size", "4"]
    runs = {balancer: trainer_run(dict(dp_shard=2, cp=2), steps, seq, recipe=recipe, timeout=300,
                                  extra=[*placed, "--parallelism.cp_load_balancer", balancer])
            for balancer in ("documents", "zigzag")}
    errors = {name: max(max_relative_error(alone, records, key) for key in ("loss", "grad_norm"))
              for name, records in runs.items()}
    errors["documents vs zigzag"] = max(max_relative_error(runs["zigzag"], runs["documents"], key)
                                        for key in ("loss", "grad_norm"))
    print(f"dp_shard2 x cp2, placement by work: max relative error (loss, grad norm): {errors}")
    assert all(error <= 1e-5 for error in errors.values()), (runs, alone)
    assert runs["documents"][-1]["placement_whole_row_steps"] < steps  # segments really moved between rows
    assert all(r["attention_balance"] >= 1.0 for r in runs["documents"])


RESUME = ["--training.steps", "6", "--training.seq_len", "128", "--training.local_batch_size", "2",
          "--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--checkpoint.enable", "true",
          "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0", "--metrics.enable_tensorboard", "false",
          "--data.document_masking", "true"]


def _train(folder: str, *extra: str):
    result = run_train(*RESUME, "--job.dump_folder", folder, *extra, nproc=4, timeout=300, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, {r["step"]: r["loss"] for r in read_metrics(folder)}


def test_resume_from_a_zigzag_checkpoint_onto_the_documents_layout(tmp_path):
    source, resumed = str(tmp_path / "zigzag"), str(tmp_path / "documents")
    _, reference = _train(source, "--parallelism.cp_load_balancer", "zigzag")
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(os.path.join(source, "checkpoints", "step-3"), os.path.join(resumed, "checkpoints", "step-3"))
    result, losses = _train(resumed, "--parallelism.cp_load_balancer", "documents")
    assert "resumed from" in result.stdout and "(step 3)" in result.stdout
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(4, 7))
    print(f"dp_shard2 x cp2, zigzag -> documents at step 3: max relative loss difference, steps 4-6: {worst:.2e}")
    assert worst <= 1e-5, (reference, losses)
