"""The debug model trained with context parallelism has the losses of the same run without it (fp32), and with
document masking the losses of every document run alone through a plain model.

Shape: 2 blocks (CP acts in every block's attention alike; 2 still pass activations between blocks) and 3 steps (step
1 forward and backward, step 2 the first update, step 3 the first update using optimizer state carried over): a
launch's set-up, not its steps, is most of its cost."""
import pytest

from tests.loss_reference import max_relative_error, reference_run, trainer_run
from tests.trainer_runs import max_rel_diff, train_losses

pytestmark = pytest.mark.timeout(720)  # the module's reference run and the test's run are allowed 300 s each

LAYERS = ("--model.n_layers", "2")
COMMON = ("--training.steps", "3", "--training.seq_len", "256", "--training.local_batch_size", "2",
          "--parallelism.dp_shard", "1", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
          *LAYERS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_losses(str(tmp_path_factory.mktemp("cp1")), *COMMON, "--parallelism.cp", "1", nproc=1)


@pytest.mark.parametrize("cp, balancer", [
    (2, "zigzag"),
    pytest.param(2, "striped", marks=pytest.mark.slow),
    pytest.param(4, "zigzag", marks=pytest.mark.slow),
])
def test_cp_training_matches_cp1(tmp_path, reference, cp, balancer):
    losses = train_losses(str(tmp_path), *COMMON, "--parallelism.cp", str(cp),
                          "--parallelism.cp_load_balancer", balancer, nproc=cp)
    assert max_rel_diff(losses, reference) <= 1e-5, (losses, reference)


DOC_STEPS, DOC_SEQ = 3, 192  # 192 splits into 2 x cp chunks for cp 1, 2 and 3


@pytest.fixture(scope="module")
def documents_alone():
    """The independent reference: the loader's packed rows, each document run alone (no mask, positions from 0)
    through a plain single-process Llama; the same AdamW, schedule and clipping as the trainer."""
    return reference_run(DOC_STEPS, DOC_SEQ, document_masking=True, n_layers=2)


@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_document_masking_matches_every_document_run_alone(documents_alone, cp):
    """The trainer with data.document_masking at cp 1, 2 and 3 (the ring masks across documents) against it."""
    assert sum(r["documents"] for r in documents_alone) >= 4 * DOC_STEPS + 3  # rows really hold several documents
    records = trainer_run(dict(cp=cp, dp_shard=1), DOC_STEPS, DOC_SEQ,
                          extra=["--data.document_masking", "true", *LAYERS], timeout=300)
    errors = {key: max_relative_error(documents_alone, records, key) for key in ("loss", "grad_norm")}
    print(f"document masking, cp{cp}: max relative error vs documents run alone: {errors}")
    assert errors["loss"] <= 1e-5 and errors["grad_norm"] <= 1e-5, (records, documents_alone)
