"""Passkey retrieval learned by the real trainer under zigzag CP=2 (recipes/passkey_cp2.toml): proves that attention
crosses shards during training, not only in parity tests. The evaluation keys at middle depths sit in rank 1's zigzag
chunks while the question is on rank 0. The recipe evaluates every 100 steps of its last stage and ends at the first
evaluation with a mean of 95% or better and every depth at 85% or better (eval.passkey_stop_mean and passkey_stop_at,
this test's own criterion): a learning run that stops once its criterion holds, not at a fixed step.

Its last stage is 128 tokens, not 256 as before issue 56: the key at depths 0.5 and 0.75 is in rank 1's chunks and the
question in rank 0's at 128 as at 256 (checked below), so retrieval still has to cross ranks, and the run is 1,300
steps instead of 2,000 (243 s alone on the Intel box of 2026-12-03 instead of 414 s)."""
import json
import os

import numpy as np
import pytest

from config import RecipeError
from config.recipe import load_config
from tests.trainer_runs import ROOT, read_metrics, run_train
from training.evaluation.passkey import passkey_stop_reached
from training.launch_checks.preflight import preflight_stages

RECIPE = os.path.join(ROOT, "recipes", "passkey_cp2.toml")


def _key_and_question_ranks(depth: float, seq_len: int = 128) -> tuple[set[int], set[int]]:
    """CP ranks (zigzag over 2) holding the key's tokens and the answer positions of evaluation row 0."""
    from data.corpus import load_documents
    from data.passkey import KEY_INTRO, PasskeyRows
    from data.tokenizer import build_tokenizer
    from models.llama import model_config
    from parallelisms.cp.plan_sharding import local_positions
    from training.evaluation.passkey import EVAL_SEED_OFFSET
    tokenizer = build_tokenizer(None, load_documents(["pydoc"]), model_config("debug").vocab_size,
                                os.path.join(ROOT, ".cache"))
    row, _, _ = PasskeyRows(tokenizer, seq_len=seq_len, seed=EVAL_SEED_OFFSET, depth=depth).sample(0)
    intro = tokenizer.encode(KEY_INTRO)
    start = next(i for i in range(len(row)) if list(row[i:i + len(intro)]) == intro) + len(intro)
    owner = np.empty(seq_len, dtype=int)
    for rank in range(2):
        owner[local_positions(seq_len, rank, 2, "zigzag").numpy()] = rank
    return set(owner[start:start + 5].tolist()), set(owner[seq_len - 5:].tolist())


@pytest.mark.parametrize("overrides, expect", [
    (["--eval.passkey_stop_at", "1.5"], "passkey_stop_at, passkey_stop_mean in [0, 1] (got 100, 1.5, 0.95)"),
    (["--eval.passkey_stop_mean", "-0.1"], "passkey_stop_at, passkey_stop_mean in [0, 1] (got 100, 0.85, -0.1)"),
    (["--eval.passkey_interval", "-1"], "eval.passkey_interval must be >= 0"),
    (["--eval.passkey_interval", "0"], "set eval.passkey = true and eval.passkey_interval > 0"),
    (["--eval.passkey", "false"], "set eval.passkey = true and eval.passkey_interval > 0"),
    (["--eval.passkey", "false", "--eval.passkey_stop_at", "0"], "set eval.passkey = true"),
])
def test_a_passkey_stop_without_its_evaluations_is_refused_in_one_line(overrides, expect):
    with pytest.raises(RecipeError) as err:
        preflight_stages(load_config(RECIPE, overrides), world_size=2)
    message = str(err.value)
    assert expect in message and RECIPE in message and "\n" not in message, message


@pytest.mark.parametrize("stop_at, stop_mean, cells, stops", [
    (0.95, 0.0, [0.95, 1.0, 0.96], True), (0.95, 0.0, [0.94, 1.0, 1.0], False),  # every cell at the floor
    (0.0, 0.95, [0.90, 1.0, 0.96], True), (0.0, 0.95, [0.90, 1.0, 0.90], False),  # the mean alone
    (0.85, 0.95, [0.86, 1.0, 1.0], True), (0.85, 0.95, [0.84, 1.0, 1.0], False),  # both: a cell under the floor
    (0.85, 0.95, [0.90, 0.95, 0.95], False), (0.0, 0.0, [1.0, 1.0, 1.0], False),  # the mean short; no stop set
])
def test_the_stop_needs_the_mean_and_every_cell(stop_at, stop_mean, cells, stops):
    e = load_config(RECIPE, ["--eval.passkey_stop_at", str(stop_at), "--eval.passkey_stop_mean", str(stop_mean)]).eval
    results = {(128, depth / 2): accuracy for depth, accuracy in enumerate(cells)}
    assert passkey_stop_reached(e, results) is stops


@pytest.mark.slow
# A hang guard, not a speed target: 243 s alone on the Intel box of 2026-12-03 (ends at step 1,300 of 1,600; 414 s
# for the 256-token recipe before); 1,961 s for the old recipe in a clean-clone CI of a slower AMD box. On the 2-core
# box of 2026-12-05 it ended at step 1,200 (mean 97%), 382 CPU-s. Tried then on that shared box, none cheaper (the
# first two side by side): a 96-token last stage (also crosses ranks at depths 0.5/0.75) ends at step 1,200
# too, 387 CPU-s against 382 (same tokens per step, so the same step cost); a cosine over 1,300 steps reached 95.0%
# only at step 1,300 (94% at 1,250, 50-step evaluations); 64 rows in the 48-token stage (half, 128-token stage
# unchanged) had a loss of 1.63 at step 500 against 0.31 and 0% from 550 to 700; 256 rows there and 128 rows of 96
# (twice the tokens, ramp at 250) learned no faster per step (loss 1.53 at 200 against 1.44, 2% at step 800); a
# SwiGLU width of 128 instead of 256 (-17% per step) left the plateau far later (loss 0.92 at step 500, 26% at
# 1,200). A 48-token step is ~0.12 CPU-s of per-step work for the two ranks plus ~0.001 per row (64 and 128 rows
# measured); an evaluation ~1 CPU-s (~3 steps), so evaluating every 50 steps costs about what it can save. Later
# that day, alone on the box: a peak lr of 5e-3 instead of 3e-3 was still on the plateau at step 700 (loss 1.79, 0%;
# stopped), and the 128-token stage from step 400 instead of 500 ended at step 1,500 (53% at 700, 88-90% at
# 1,200-1,400), not 1,200.
@pytest.mark.timeout(3100)
def test_passkey_is_learned_under_zigzag_cp2(tmp_path):
    out = str(tmp_path / "passkey")
    result = run_train(RECIPE, "--job.dump_folder", out, nproc=2, timeout=3000)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = read_metrics(out)
    stages = {(r["seq_len"], r["cp"]) for r in records}
    assert stages == {(48, 1), (128, 2)}
    # an evaluation every 100 steps of the 128-token stage (steps 500-1600), none before it
    evaluated = [r["step"] for r in records if "passkey_accuracy" in r]
    last = records[-1]["step"]
    assert evaluated == list(range(600, min(last, 1599) + 1, 100)), (evaluated, last)
    if last < 1600:  # ended early: its last evaluation met both stops, and it said so
        assert (f"passkey accuracy mean >= 0.95 with >= 0.85 in every cell at step {last}: the run ends here"
                in result.stdout)
    with open(os.path.join(out, "passkey_eval.json")) as f:
        table = json.load(f)
    assert {t["context_length"] for t in table} == {128} and len(table) == 5
    accuracies = {t["depth"]: t["accuracy"] for t in table}
    assert sum(accuracies.values()) / len(accuracies) >= 0.95, accuracies
    assert min(accuracies.values()) >= 0.85, accuracies
    assert "passkey accuracy" in result.stdout
    for depth in (0.5, 0.75):  # retrieval at these depths had to cross to the other rank
        key_ranks, question_ranks = _key_and_question_ranks(depth)
        assert key_ranks == {1} and question_ranks == {0}, (depth, key_ranks, question_ranks)
