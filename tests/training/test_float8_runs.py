"""Float8's long runs (slow tier), in a file of their own so CI starts them early (tests/conftest.py): 8 ranks
composing dp 2 x tp 2 x cp 2, a 20-step learning run against bf16, a float8 checkpoint resharded, and torch.compile
over float8 blocks. The fast ones, and what each bound means, are in tests/training/test_float8.py."""
from __future__ import annotations

import pytest

pytest.importorskip("torchao")  # pinned in requirements.txt: a missing torchao fails here (tests/conftest.py)

from tests.loss_reference import trainer_run  # noqa: E402
from tests.trainer_runs import read_metrics, run_train  # noqa: E402
from tests.training.paced_runs import TINY  # noqa: E402
from tests.training.test_float8 import ACCUMULATE, DEBUG_MODEL, TP_BOUND, _losses_and_norms, _max_rel  # noqa: E402


FIRST_STEP_BOUND = (1e-6, 1e-4)
"""(loss, grad norm) relative, the first step of dp 2 x tp 2 x cp 2 against one process, float32: the same weights
and rows, every float8 scale over the whole tensor, so only float32 summation order differs (measured 0 in loss,
4.9e-6 in grad norm). Before the trainer precomputed the weights' scales ahead of the first step, FSDP's all-gather
scaled each TP rank's slice by its own max-abs there: 9.2e-6 in loss."""


@pytest.mark.slow
def test_eight_ranks_compose():
    """dp 2 x tp 2 x cp 2 (FSDP2 with float8 all-gathers, TP, CP) against one process over the same micro-batches,
    2 steps: the first from the scales the trainer precomputed at load, the second from those the optimizer step
    precomputed (every later step is that one again). Measured in loss over 4 steps: 0, 2.0e-6, 2.2e-6, 9.1e-6
    (issue 38's 1e-5); the later steps carry float8 roundings that TP's summation order flipped (dp 2 x tp 2 alone
    reaches 1.4e-5 at step 3, and the same meshes without float8 differ by 0), so they are held to TP_BOUND. The
    runs are deterministic and steps 1-2 lie in the recipe's warm-up, so they are the first 2 of those 4 (the test
    59 -> 41 CPU-s measured). CP ranks scaling their own tokens fail at step 1 already (2.2e-5 in loss at cp 2)."""
    one = _losses_and_norms(dict(dp_shard=1), *ACCUMULATE, dtype="float32", shape=DEBUG_MODEL, steps=2)
    full = _losses_and_norms(dict(dp_shard=2, cp=2, tp=2), dtype="float32", shape=DEBUG_MODEL, steps=2)
    print("dp2 x tp2 x cp2 against one process, loss:", [f"{abs(x - y) / y:.1e}" for x, y in zip(full[0], one[0])])
    assert abs(full[0][0] - one[0][0]) <= FIRST_STEP_BOUND[0] * one[0][0], (full, one)
    assert abs(full[1][0] - one[1][0]) <= FIRST_STEP_BOUND[1] * one[1][0], (full, one)
    assert _max_rel(full[0], one[0]) <= TP_BOUND[0] and _max_rel(full[1], one[1]) <= TP_BOUND[1], (full, one)


# ------------------------------------------------------------------ the accuracy cost (slow tier)
LEARNING_BOUND = 0.02
"""Every step's loss of a float8 run within 2% of the bf16 run's (same weights at step 0, same rows)."""


LEARNING_SHAPE = dict(steps=20, seq_len=64, lr="6e-3", n_layers=2, dim=128, n_heads=8)
"""20 steps of 8 rows of 64 tokens at 3x the recipe's learning rate, the debug model cut to 2 blocks of half its
width (dim 128, 8 heads of 16 as before): at dim 256 the two runs cost 45.5 CPU-s, at 128 19.8, and bf16 still falls
8.004 -> 5.102 (more than the 2.5 asked; its last three steps 4.96, 5.74, 5.10) with float8 within 5.6e-4 of it at
its worst step (2.0e-3 at dim 256; the bound is 0.02). Before the width cut: a fifth of the
tokens of the 50 steps at seq 128 (lr 2e-3) this test ran before (836 s of a contended CI for both runs), and a third
of the blocks (the runs cost 18 s of wall on 2 cores instead of ~50). The loss still falls by more than the 2.5 asked
(measured 8.227 -> 5.020 in bf16 with 2 blocks; 8.232 -> 5.396 with 6), and the float8 run tracks bf16 step by step
through the whole curve, its swings included (worst step 2.0e-3 relative with 2 blocks and with 6, the bound 0.02;
1.3e-3 at the old shape), so the gap float8 costs shows as before. Lower rates at this shape leave a last step short
of the 2.5 (lr 4e-3 over 24 steps, 6 blocks: its per-batch losses at 8 x 64 tokens swing by 0.5 and the last one was
6.07)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_float8_learns_like_bf16():
    """The debug model on 2 ranks (FSDP2, bf16 compute, 8 rows a step; LEARNING_SHAPE), tensorwise float8 against
    bf16 from the same weights over the same rows: every step's loss within LEARNING_BOUND, and bf16 learns. At the
    old shape (50 steps, seq 128, lr 2e-3): worst step 1.3e-3, mean of the last 10 steps 5.1324 against 5.1312; at
    seq 256 8.5e-4, and rowwise 1.3e-3 (the CPU has no float8 GEMM: torch emulates it)."""
    steps, seq_len, lr = LEARNING_SHAPE["steps"], LEARNING_SHAPE["seq_len"], LEARNING_SHAPE["lr"]
    extra = ["--optimizer.lr", lr, *(item for key in ("n_layers", "dim", "n_heads")
                                      for item in (f"--model.{key}", str(LEARNING_SHAPE[key])))]
    runs = {recipe: [r["loss"] for r in trainer_run(dict(dp_shard=2), steps, seq_len, global_batch=8, timeout=420,
                                                   extra=["--training.float8", recipe, *extra], dtype="bfloat16")]
            for recipe in ("off", "tensorwise")}
    bf16, float8 = runs["off"], runs["tensorwise"]
    worst = max(abs(x - y) / y for x, y in zip(float8, bf16))
    print(f"float8 tensorwise vs bf16 over {steps} steps: worst step {worst:.2e} relative; last 5 steps "
          f"{sum(float8[-5:]) / 5:.4f} vs {sum(bf16[-5:]) / 5:.4f}")
    assert bf16[-1] < bf16[0] - 2.5 and worst <= LEARNING_BOUND, (float8, bf16)


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_a_float8_checkpoint_reshards(tmp_path):
    """A float8 run saved on FSDP over 4 ranks resumes on HSDP 2 x 2 (DCP reshards the plain tensors): losses within
    1e-5 of the uninterrupted run (each rank still scales the same one row, so the float8 values are the same)."""
    from tests.training.test_checkpoint_runs import losses, resume_from_step5, train

    source = str(tmp_path / "source")
    train(source, "dp_shard4", "--training.float8", "tensorwise", "--training.dtype", "bfloat16")
    reference = losses(source)
    resumed = resume_from_step5(source, str(tmp_path / "resumed"), "dp_replicate2 x dp_shard2",
                                "--training.float8", "tensorwise", "--training.dtype", "bfloat16")
    worst = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(6, 11))
    print(f"float8 dp_shard4 -> dp_replicate2 x dp_shard2: max relative loss difference over steps 6-10: {worst:.2e}")
    assert sorted(resumed) == list(range(6, 11)) and worst <= 1e-5, (reference, resumed)


COMPILE_SHAPE = ("--training.seq_len", "128", *TINY)
"""The compile test's model and rows: the tiny model (tests/training/paced_runs.TINY: two blocks, dim 64) at seq 128,
64 tokens a CP rank."""


@pytest.mark.slow
def test_float8_compiles_without_surprises(tmp_path):
    """torch.compile (CUDA's default) over float8 blocks under CP 2 and FSDP2 over it (float8 all-gathers): the same
    losses as eager up to bf16 fusion, one graph per block kind, no graph break, no compile warning (parallelisms/parallelize.compile_surprises: graph breaks, failed
    frames, unsupported constructs) and no graph built after the first step: the float8 scales' CP maximum is one
    module-level function (parallelisms/float8.amax_over_sequence), not a closure per micro-step (issue 47).
    2 steps, not 3: the second is the first that could build a graph again, and the runs are deterministic, so the
    largest difference over 2 steps is at most the one measured over 3 (the compile itself is most of the cost).
    The tiny model at seq 128 (COMPILE_SHAPE): none of these properties depends on the size (each whole block is one
    graph of as many kernels at any size, so the compile costs the same), while the debug model's 4 steps of bf16
    float8 at seq 512 cost ~30 of the test's 96 CPU-s (measured: the eager run 27.7 -> 4.7 CPU-s, the test 96 -> 69)."""
    losses = {}
    for compiled in ("false", "true"):
        out = str(tmp_path / compiled)
        result = run_train("--training.steps", "2", "--training.dtype", "bfloat16", "--training.float8", "tensorwise",
                           "--training.compile", compiled, "--metrics.enable_tensorboard", "false",
                           "--parallelism.cp", "2", "--parallelism.dp_shard", "1", *COMPILE_SHAPE,
                           "--job.dump_folder", out, nproc=2, timeout=400, forked=True)
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_metrics(out)
        losses[compiled] = [r["loss"] for r in records]
    assert "torch.compile: the first step took" in result.stdout and "graph breaks: 0)" in result.stdout
    assert records[0]["compile"]["unique_graphs"] == records[-1]["compile"]["unique_graphs"], records
    assert "warning: torch.compile" not in result.stdout + result.stderr, result.stdout[-3000:]
    # bf16 fusion: each whole block is one graph, whose fused norms and residual adds skip eager's bf16 roundings of
    # their intermediates. Measured with the debug model at seq 512 1.03e-4 relative over 3 steps (1.3e-5 when only
    # attention and feed-forward were compiled; with inductor's emulate_precision_casts, which keeps those roundings,
    # 2.1e-5); at COMPILE_SHAPE 1.3e-5 over the 2 steps.
    print(f"compiled against eager, float8 tensorwise under CP 2: {_max_rel(losses['true'], losses['false']):.1e}")
    assert _max_rel(losses["true"], losses["false"]) <= 2e-4, losses
