"""The trainer with parallelism.cp_load_balancer = "documents" (slow tier): its losses are those of every document
run alone through a plain model, on rows that hold several documents (a guard checks it) (cp2 x tp2; dp_shard2 x cp2 with data-parallel placement, documents and zigzag; the
16-rank dp_replicate2 x dp_shard2 x cp2 x tp2 mesh; short documents so that rows hold several), and runs resumed from a
zigzag checkpoint onto the documents layout (dp_shard2 x cp2, and across a ramp stage cp 1 -> cp 2) continue the
uninterrupted runs' losses.

Shape: the debug model at 2 blocks (the layouts act per block alike; 2 still pass activations between blocks), rows of
128 tokens, 3 steps (step 1 forward and backward, step 2 the first update, step 3 the first update using optimizer
state carried over). The three reference comparisons share one reference run (same recipe, rows and shape), and the
resumed runs stop one step after the step they check: a launch's set-up, not its steps, is most of its cost."""
import os
import shutil

import pytest

from tests.loss_reference import max_relative_error, reference_run, trainer_run
from tests.trainer_runs import read_metrics, run_train, short_documents_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

LAYERS = ["--model.n_layers", "2"]
DOCUMENTS = ["--data.document_masking", "true", "--parallelism.cp_load_balancer", "documents", *LAYERS]
STEPS, SEQ = 3, 128


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> str:
    """The short-documents recipe, written once: the reference runs of the module's tests then share one run."""
    return short_documents_recipe(str(tmp_path_factory.mktemp("short-docs")))


def _alone(recipe: str) -> list[dict]:
    """Every document of the packed rows run alone through a plain model (memoized by reference_run)."""
    return reference_run(STEPS, SEQ, recipe=recipe, document_masking=True, n_layers=2)


def _several_documents_per_row(reference: list[dict], rows: int = 4) -> bool:
    """The guard that makes a documents-layout test mean something: on rows of one document every layout is zigzag's.
    `documents` counts each step's (row, document) pairs (tests/loss_reference.py): two documents per row on average,
    and in every step more documents than rows."""
    return sum(r["documents"] for r in reference) >= 2 * rows * len(reference) and \
        all(r["documents"] > rows for r in reference)


def test_documents_layout_on_cp2_tp2_matches_every_document_run_alone(recipe):
    """Short documents (pydoc paragraphs), so rows of 128 tokens hold several (the guard): whole pydoc topics made
    every row one document, where the documents layout is zigzag's."""
    alone = _alone(recipe)
    assert _several_documents_per_row(alone), alone
    records = trainer_run(dict(cp=2, tp=2, dp_shard=1), STEPS, SEQ, recipe=recipe, extra=DOCUMENTS, timeout=300)
    errors = {key: max_relative_error(alone, records, key) for key in ("loss", "grad_norm")}
    print(f"documents layout, cp2 x tp2: max relative error vs documents run alone: {errors}")
    assert errors["loss"] <= 1e-5 and errors["grad_norm"] <= 1e-5, (records, alone)


def test_documents_and_zigzag_with_placement_on_dp_shard2_cp2_match_every_document_run_alone(recipe):
    """Segments placed by work over 2 data-parallel ranks x 2 micro-steps, then laid out over cp 2 by documents or by
    zigzag: both are the documents run alone, and each other, within 1e-5."""
    alone = _alone(recipe)
    assert _several_documents_per_row(alone), alone
    placed = ["--data.document_masking", "true", "--data.placement", "work", "--training.local_batch_size", "1",
              "--training.global_batch_size", "4", *LAYERS]
    runs = {balancer: trainer_run(dict(dp_shard=2, cp=2), STEPS, SEQ, recipe=recipe, timeout=300,
                                  extra=[*placed, "--parallelism.cp_load_balancer", balancer])
            for balancer in ("documents", "zigzag")}
    errors = {name: max(max_relative_error(alone, records, key) for key in ("loss", "grad_norm"))
              for name, records in runs.items()}
    errors["documents vs zigzag"] = max(max_relative_error(runs["zigzag"], runs["documents"], key)
                                        for key in ("loss", "grad_norm"))
    print(f"dp_shard2 x cp2, placement by work: max relative error (loss, grad norm): {errors}")
    assert all(error <= 1e-5 for error in errors.values()), (runs, alone)
    assert runs["documents"][-1]["placement_whole_row_steps"] < STEPS  # segments really moved between rows
    # the documents layout balances the CP ranks' work that zigzag leaves uneven, on the same placed rows
    balance = [(d["attention_balance"], z["attention_balance"]) for d, z in zip(runs["documents"], runs["zigzag"])]
    assert all(d <= z * (1 + 1e-9) for d, z in balance) and any(d < z for d, z in balance), balance


def test_documents_layout_on_the_16_rank_4d_mesh_matches_every_document_run_alone(recipe):
    """dp_replicate2 x dp_shard2 x cp2 x tp2 (document masking refuses pp, so this is the 4-D mesh it can run), segments
    placed by work over the 4 data-parallel ranks. Measured by hand: zigzag on the same mesh is 2.4e-7 from the
    reference and 1.2e-7 from documents; one run here keeps the test under a minute."""
    alone = _alone(recipe)
    records = trainer_run(dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), STEPS, SEQ, recipe=recipe, timeout=600,
                          extra=DOCUMENTS)
    errors = {key: max_relative_error(alone, records, key) for key in ("loss", "grad_norm")}
    print(f"documents layout, dp_replicate2 x dp_shard2 x cp2 x tp2: max relative error vs documents alone: {errors}")
    assert errors["loss"] <= 1e-5 and errors["grad_norm"] <= 1e-5, (records, alone)
    assert _several_documents_per_row(alone), alone


RESUME = ["--training.steps", "4", "--training.seq_len", "128", "--training.local_batch_size", "2",
          "--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--checkpoint.enable", "true",
          "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--metrics.enable_tensorboard", "false",
          "--data.document_masking", "true", *LAYERS]


def _train(folder: str, *extra: str):
    result = run_train(*RESUME, "--job.dump_folder", folder, *extra, nproc=4, timeout=300, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, {r["step"]: r["loss"] for r in read_metrics(folder)}


def test_resume_from_a_zigzag_checkpoint_onto_the_documents_layout(tmp_path):
    """Saved at step 2, resumed for steps 3-4: step 3 checks the restored weights and data position, step 4 the
    restored optimizer state (its update is the first to use moments from before the resume)."""
    source, resumed = str(tmp_path / "zigzag"), str(tmp_path / "documents")
    _, reference = _train(source, "--parallelism.cp_load_balancer", "zigzag")
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(os.path.join(source, "checkpoints", "step-2"), os.path.join(resumed, "checkpoints", "step-2"))
    result, losses = _train(resumed, "--parallelism.cp_load_balancer", "documents")
    assert "resumed from" in result.stdout and "(step 2)" in result.stdout
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(3, 5))
    print(f"dp_shard2 x cp2, zigzag -> documents at step 2: max relative loss difference, steps 3-4: {worst:.2e}")
    assert worst <= 1e-5, (reference, losses)


RAMP = """
[[ramp]]
start_step = 0
seq_len = 128
cp = 1

[[ramp]]
start_step = 2
seq_len = 256
cp = 2
"""


def _ramp_run(recipe: str, folder: str, balancer: str) -> dict:
    result = run_train(recipe, "--training.steps", "4", "--training.tokens_per_step", "512", "--checkpoint.enable",
                       "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--job.dump_folder",
                       folder, "--metrics.enable_tensorboard", "false", *DOCUMENTS[:2], *LAYERS,
                       "--parallelism.cp_load_balancer", balancer, nproc=2, timeout=300, forked=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return {r["step"]: r for r in read_metrics(folder)}


def test_resume_across_a_ramp_stage_from_zigzag_onto_the_documents_layout(tmp_path):
    """Stage 1 at cp 1 (seq 128, dp_shard 2), stage 2 at cp 2 (seq 256, dp_shard 1), short documents placed by work.
    The zigzag run's checkpoint at the stage boundary, resumed with the documents layout, continues exactly as an
    uninterrupted documents run does (stage 1 at cp 1 is the same run for both layouts). Checkpoints every 2 steps:
    the boundary's (step 2) is the one resumed; one at every step saved two more per run for nothing."""
    recipe = short_documents_recipe(str(tmp_path))
    with open(recipe, "a") as f:
        f.write(RAMP)
    zigzag = _ramp_run(recipe, str(tmp_path / "zigzag"), "zigzag")
    straight = _ramp_run(recipe, str(tmp_path / "documents"), "documents")
    assert [(r["seq_len"], r["cp"]) for r in straight.values()] == [(128, 1), (128, 1), (256, 2), (256, 2)]
    resumed_folder = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(tmp_path, "zigzag", "checkpoints", "step-2"),
                    os.path.join(resumed_folder, "checkpoints", "step-2"))
    resumed = _ramp_run(recipe, resumed_folder, "documents")
    assert sorted(resumed) == [3, 4]
    print("ramp cp1 -> cp2, losses (zigzag, documents, documents resumed from zigzag at step 2): "
          f"{[(zigzag[s]['loss'], straight[s]['loss'], resumed.get(s, {}).get('loss')) for s in straight]}")
    assert [zigzag[s]["loss"] for s in (1, 2)] == [straight[s]["loss"] for s in (1, 2)]
    for key in ("loss", "grad_norm"):  # bit-identical in fp32
        assert [resumed[s][key] for s in (3, 4)] == [straight[s][key] for s in (3, 4)], (resumed, straight)
    assert resumed[3]["attention_balance"] < zigzag[3]["attention_balance"]  # stage 2 really runs the documents layout
    assert max(abs(zigzag[s]["loss"] - straight[s]["loss"]) / straight[s]["loss"] for s in (3, 4)) <= 1e-5
