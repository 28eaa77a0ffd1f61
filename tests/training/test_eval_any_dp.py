"""Evaluation on any data-parallel degree: every rank runs the same forwards (a dp that does not divide the rows used
to hang in FSDP's all-gather), and the numbers equal a single-process evaluation's."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.trainer_runs import read_metrics, run_train
from training.evaluation.rows import rank_batches, rank_rows


@pytest.mark.parametrize("rows, dp", [(8, 3), (8, 5), (4, 5), (8, 8), (1, 3)])
def test_every_rank_gets_ceil_rows_over_dp_and_every_row_once(rows, dp):
    shares = [rank_rows(rows, r, dp) for r in range(dp)]
    assert {len(s) for s in shares} == {-(-rows // dp)}
    real = sorted(i for s in shares for i in s if i is not None)
    assert real == list(range(rows))
    assert len({len(rank_batches(rows, r, dp, 2)) for r in range(dp)}) == 1


class _RowOracle(torch.nn.Module):
    """Predicts each known row's next tokens exactly, except one answer digit of every odd-numbered known row (so
    the right answer depends on the row, not on where the row sits in a batch)."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def forward(self, tokens, position_ids=None, *, labels=None, token_scores=False, **_):
        predictions = torch.empty_like(tokens)
        for b, seq in enumerate(tokens):
            i = next(i for i, r in enumerate(self.rows) if torch.equal(torch.as_tensor(r[:-1]), seq))
            predictions[b] = torch.as_tensor(self.rows[i][1:])
            if i % 2 == 1:
                predictions[b, -3] += 1
        return torch.zeros(tokens.shape), predictions


def _oracle_hits(rank, world_size):
    from data.corpus import load_documents
    from data.passkey import PasskeyRows
    from data.tokenizer import build_tokenizer
    from models.llama import model_config
    from parallelisms.comm import Collectives
    from training.evaluation.passkey import EVAL_SEED_OFFSET, answer_hits
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        tokenizer = build_tokenizer(None, load_documents(["pydoc"]), model_config("debug").vocab_size, cache)
    rows = PasskeyRows(tokenizer, seq_len=96, seed=EVAL_SEED_OFFSET, depth=0.0)
    model = _RowOracle([rows.sample(i)[0] for i in range(7)])
    comm = Collectives(torch.device("cpu"))
    return answer_hits(model, rows, list(range(7)), torch.device("cpu"), None, None, 1, "zigzag", batch_size=2,
                       dp_rank=rank, dp_size=world_size, reduce_sums=comm.reduce_values)


def test_answer_hits_split_over_3_ranks_equal_one_process():
    """7 rows over 3 ranks (3, 2, 2 real rows, in 2 forwards of 2 rows on every rank): padding counts nothing and
    the counts are summed over the ranks, so every rank reports one process's figures (4 of 7 rows right; a
    padding row repeats row 0, which is right, so counting it would show)."""
    want = _oracle_hits(0, 1)
    assert want[0] == 4 / 7 and 0.5 < want[1] < 1
    got = run_ranks(_oracle_hits, world_size=3, timeout=120)
    assert all(g == want for g in got), (got, want)


def _eval_outputs(folder: str) -> dict:
    with open(os.path.join(folder, "niah_eval.json")) as f:
        niah = {r["step"]: r["cells"] for r in json.load(f)}
    with open(os.path.join(folder, "passkey_eval.json")) as f:
        passkey = json.load(f)
    long_doc = {r["step"]: r["long_doc_loss"] for r in read_metrics(folder) if "long_doc_loss" in r}
    return {"niah": niah, "passkey": passkey, "long_doc": long_doc}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp3_and_dp5_evaluations_finish_and_equal_dp1(tmp_path):
    """Long-document loss (8 rows), passkey and NIAH (5 rows per cell) at every step of a 2-step run on 1, 3 and 5
    gloo ranks (dp_shard = ranks; the same global batch of 15 rows): 8 rows split over 3 and 5 ranks unevenly, and
    5 answer rows over 3. Every number equals dp 1's within 1e-6 relative."""
    common = ["recipes/debug.toml", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
              "--training.steps", "2", "--training.seq_len", "256", "--training.local_batch_size", "1",
              "--training.global_batch_size", "15", "--metrics.enable_tensorboard", "false",
              "--data.cache_dir", str(tmp_path / "cache"),
              "--eval.long_doc_loss", "true", "--eval.long_doc_interval", "1", "--eval.long_doc_rows", "8",
              "--eval.long_doc_heldout", "0.05", "--eval.niah", "true", "--eval.niah_interval", "1",
              "--eval.niah_lengths", "256", "--eval.niah_depths", "2", "--eval.niah_samples", "5",
              "--eval.passkey", "true", "--eval.passkey_depths", "2", "--eval.passkey_samples", "5"]
    outputs = {}
    for dp in (1, 3, 5):
        out = str(tmp_path / f"dp{dp}")
        result = run_train(*common, "--parallelism.dp_shard", str(dp), "--job.dump_folder", out, nproc=dp,
                           timeout=400, forked=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        outputs[dp] = _eval_outputs(out)
    want = outputs[1]
    assert sorted(want["long_doc"]) == [1, 2] and sorted(want["niah"]) == [1, 2] and len(want["passkey"]) == 2
    for dp in (3, 5):
        got = outputs[dp]
        worst = max(abs(got["long_doc"][s][k] - v) / abs(v) for s, b in want["long_doc"].items() for k, v in b.items())
        print(f"dp {dp}: long-document loss max relative difference to dp 1: {worst:.2e}; NIAH and passkey cells "
              f"equal: {got['niah'] == want['niah'] and got['passkey'] == want['passkey']}")
        for step, buckets in want["long_doc"].items():
            assert got["long_doc"][step].keys() == buckets.keys()
            assert all(abs(got["long_doc"][step][k] - v) <= 1e-6 * abs(v) for k, v in buckets.items()), (dp, got)
        for step, cells in want["niah"].items():
            for a, b in zip(cells, got["niah"][step]):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * abs(a[k]) for k in a), (dp, a, b)
        assert got["passkey"] == want["passkey"], (dp, got["passkey"], want["passkey"])
