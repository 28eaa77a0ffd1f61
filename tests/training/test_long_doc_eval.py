"""Long-document loss by position bucket: held-out documents never reach training, the buckets equal a direct
per-token computation with a plain model, and the trainer's figures at cp 2 equal its figures at cp 1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.corpus import load_documents
from data.prepare import StoreSpec, ensure_store
from data.store_rows import StoreRows, heldout_documents
from data.tokenizer import build_tokenizer
from models.llama import Llama, model_config
from tests.trainer_runs import read_metrics, run_train
from training.evaluation.passkey import bucket_name, long_document_loss, position_buckets, positions_in_document


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ld"))
    tokenizer = build_tokenizer(None, load_documents(["pydoc"]), 2048, folder)
    return ensure_store(StoreSpec("pydoc", ("pydoc",), "text", folder), tokenizer, workers=1, log=lambda *_: None)


def test_held_out_documents_never_reach_training_rows(store):
    held = heldout_documents(store, 0.1, seed=3)
    assert 0 < held.sum() < store.num_documents
    training = StoreRows(store, seq_len=256, seed=3, heldout_fraction=0.1)
    assert not set(training.order.tolist()) & set(np.flatnonzero(held).tolist())
    assert len(training.order) == store.num_documents - held.sum()
    evaluation = StoreRows.heldout(store, seq_len=256, seed=3, fraction=0.1)
    assert sorted(evaluation.order.tolist()) == np.flatnonzero(held).tolist()
    lengths = store.doc_lengths[evaluation.order]
    assert (np.diff(lengths.astype(int)) <= 0).all()  # longest first


def test_buckets_and_positions():
    assert position_buckets(8192) == [(0, 128), (128, 512), (512, 2048), (2048, 8192)]
    assert bucket_name(1024, 4096) == "1K-4K" and bucket_name(0, 128) == "0-128"
    ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    assert positions_in_document(ids).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_bucket_losses_equal_a_direct_per_token_computation(store):
    torch.manual_seed(0)
    model = Llama(model_config("debug", n_layers=2))
    model.init_weights(0)
    rows = [StoreRows.heldout(store, seq_len=512, seed=0, fraction=0.2)]
    got = long_document_loss(model, rows, 3, device=torch.device("cpu"), dp_rank=0, dp_size=1,
                             reduce_sums=lambda values: values)
    sums, counts = {}, {}
    for index in range(3):
        fields = rows[0].row_fields(index % rows[0].num_rows)
        with torch.no_grad():
            logits = model(torch.from_numpy(fields["input_ids"])[None], torch.from_numpy(fields["position_ids"])[None])
        losses = torch.nn.functional.cross_entropy(logits[0].double(), torch.from_numpy(fields["labels"]),
                                                   reduction="none")
        position = 0
        for t in range(512):  # position inside the document, counted by hand
            if t > 0 and fields["document_ids"][t] != fields["document_ids"][t - 1]:
                position = 0
            name = next(bucket_name(lo, hi) for lo, hi in position_buckets(512) if lo <= position < hi)
            sums[name] = sums.get(name, 0.0) + float(losses[t])
            counts[name] = counts.get(name, 0) + 1
            position += 1
    want = {name: sums[name] / counts[name] for name in sums}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) / want[k] < 1e-5 for k in want), (got, want)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_long_doc_loss_at_cp2_equals_cp1(tmp_path):
    common = ["--training.steps", "3", "--training.seq_len", "1024", "--training.local_batch_size", "2",
              "--eval.long_doc_loss", "true", "--eval.long_doc_rows", "4", "--eval.long_doc_heldout", "0.05",
              "--data.document_masking", "true", "--metrics.enable_tensorboard", "false",
              "--data.cache_dir", str(tmp_path / "cache")]
    results = {}
    for cp, nproc in ((1, 1), (2, 2)):
        out = str(tmp_path / f"cp{cp}")
        result = run_train(*common, "--job.dump_folder", out, "--parallelism.dp_shard", "1", "--parallelism.cp",
                           str(cp), nproc=nproc, timeout=400, forked=True)  # numbers, not the launch
        assert result.returncode == 0, result.stderr[-3000:]
        results[cp] = read_metrics(out)[-1]["long_doc_loss"]
    assert list(results[1]) == ["0-64", "64-256", "256-1K"]
    assert all(abs(results[2][k] - results[1][k]) / results[1][k] < 1e-4 for k in results[1]), results
