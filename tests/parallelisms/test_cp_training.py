"""The debug model trained with context parallelism has the losses of the same run without it (fp32)."""
import pytest

from tests.trainer_runs import max_rel_diff, train_losses

COMMON = ("--training.steps", "5", "--training.seq_len", "256", "--training.local_batch_size", "2",
          "--parallelism.dp_shard", "1", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1")


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


def test_document_masking_runs_through_the_ring_at_cp1_and_cp2(tmp_path):
    args = (*COMMON, "--data.document_masking", "true")
    one = train_losses(str(tmp_path / "a"), *args, "--parallelism.cp", "1", nproc=1)
    two = train_losses(str(tmp_path / "b"), *args, "--parallelism.cp", "2", nproc=2)
    assert max_rel_diff(two, one) <= 1e-5, (two, one)
