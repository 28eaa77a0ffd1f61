"""The token store against independent references: the documents read and tokenized directly, and the in-memory
packing the trainer used before stores existed; preparation in parallel, interrupted (SIGINT, SIGKILL) and resumed
gives byte-identical stores; a store whose files changed is refused in one line."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data.corpus import load_documents
from data.packing import pack_documents
from data.prepare import StoreSpec, ensure_store, open_store, prepare_store
from data.store_rows import StoreRows
from data.tokenizer import build_tokenizer
from tests.trainer_runs import ROOT
from config import RecipeError

WORDS = ("river mill stone wall bird hill quiet long day walk back again the a of to and in is was "
         "context ring attention token shard rank memory store prepare").split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(None, load_documents(["pydoc"]), 2048, str(tmp_path_factory.mktemp("spm")))


def write_corpus(folder, documents: int, seed: int = 0, words: tuple[int, int] = (5, 400)) -> list[str]:
    """A .jsonl, a .jsonl.gz, a .parquet and a folder of .txt files; returns every document in entry order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, rng.integers(*words))) + "." for _ in range(documents)]
    quarter = documents // 4
    os.makedirs(folder / "txt", exist_ok=True)
    with open(folder / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:quarter]))
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs[quarter:2 * quarter])
    pq.write_table(pa.table({"text": docs[2 * quarter:3 * quarter]}), folder / "c.parquet", row_group_size=7)
    for i, d in enumerate(docs[3 * quarter:]):
        (folder / "txt" / f"{i:04d}.txt").write_text(d)
    return docs


def test_every_format_reads_the_documents_written(tmp_path):
    docs = write_corpus(tmp_path, 40)
    assert load_documents([str(tmp_path / "a.jsonl")]) == docs[:10]
    assert load_documents([str(tmp_path / "b.jsonl.gz")], text_field="body") == docs[10:20]
    assert load_documents([str(tmp_path / "c.parquet")]) == docs[20:30]
    assert load_documents([str(tmp_path / "txt")]) == docs[30:]
    assert load_documents([str(tmp_path / "txt" / "00*.txt")]) == docs[30:]


def test_store_documents_are_the_tokenized_documents_and_rows_are_the_in_memory_packing(tmp_path, tokenizer):
    docs = write_corpus(tmp_path, 60)
    entries = (str(tmp_path / "a.jsonl"), str(tmp_path / "c.parquet"), str(tmp_path / "txt"))
    spec = StoreSpec("mix", entries, "text", str(tmp_path / "cache"))
    store = ensure_store(spec, tokenizer, workers=2, log=lambda *_: None)
    reference_docs = docs[:15] + docs[30:]
    expected = tokenizer.encode_batch(reference_docs)
    assert store.num_documents == len(expected)
    assert all(list(store.document(i)) == ids for i, ids in enumerate(expected))
    assert store.manifest["dtype"] == "uint16"
    for seq_len, masking in ((64, False), (257, True), (100_000, False)):
        reference = pack_documents(tokenizer, reference_docs, seq_len=seq_len, seed=5, document_masking=masking)
        rows = StoreRows(store, seq_len=seq_len, seed=5, document_masking=masking)
        assert rows.num_rows == reference.num_rows
        for i in range(rows.num_rows):
            got, want = rows.row_fields(i), reference.row_fields(i)
            assert all(np.array_equal(got[k], want[k]) for k in want), (seq_len, i)


def test_document_filters_and_long_document_upsampling(tmp_path, tokenizer):
    write_corpus(tmp_path, 200, words=(2, 120))
    spec = StoreSpec("s", (str(tmp_path / "a.jsonl"),), "text", str(tmp_path / "cache"))
    store = ensure_store(spec, tokenizer, workers=1, log=lambda *_: None)
    lengths = store.doc_lengths.astype(int)
    threshold = int(np.median(lengths))
    kept = StoreRows(store, seq_len=32, seed=0, min_doc_tokens=threshold)
    assert sorted(set(kept.order.tolist())) == [i for i, n in enumerate(lengths) if n >= threshold]
    upsampled = StoreRows(store, seq_len=32, seed=0, long_doc_tokens=threshold, long_doc_upsample=2.5)
    seen = np.bincount(upsampled.order, minlength=len(lengths))
    long, short = seen[lengths >= threshold], seen[lengths < threshold]
    assert set(short.tolist()) == {1} and set(long.tolist()) <= {2, 3}
    assert abs(long.mean() - 2.5) < 0.25, long.mean()  # fractional copies drawn per document


def _store_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.startswith("shard-"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


PREPARE_SCRIPT = """
import os, signal, sys
# Ctrl-C in a terminal: SIGINT raises KeyboardInterrupt even when this test runs where SIGINT is ignored (a background
# job of a non-interactive shell: children inherit the ignore, and the preparation would run on to the end). Niced, so
# the test's polling keeps up with it on a busy box; its spawned workers inherit both.
signal.signal(signal.SIGINT, signal.default_int_handler)
os.nice(19)
sys.path.insert(0, {root!r})
from data.prepare import StoreSpec, prepare_store
from data.tokenizer import Tokenizer
prepare_store(StoreSpec("big", ({entry!r},), "text", {cache!r}, part_bytes={part_bytes}),
              Tokenizer.from_file({model!r}), workers=2, progress=False)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_interrupted_preparation_resumes_without_redoing_shards_and_matches_an_uninterrupted_one(tmp_path, tokenizer,
                                                                                                  sig):
    entry, cache, part_bytes = str(tmp_path / "txt"), tmp_path / "cache", 4096  # ~100 shards of ~4 KiB of text
    write_corpus(tmp_path, 400, words=(200, 600))
    model = tmp_path / "tok.model"
    model.write_bytes(tokenizer.model_proto)
    script = PREPARE_SCRIPT.format(root=ROOT, entry=entry, cache=str(cache), part_bytes=part_bytes, model=str(model))
    # The preparation (~0.5 s for its 41 parts) runs in short steps: its whole process group is frozen (SIGSTOP takes
    # effect at once) before each count of finished shards, so the signal always lands part-way, never after publishing.
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    partial, deadline = None, time.time() + 120
    while partial is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGSTOP)
        found = list(cache.glob("stores/*.partial"))
        if found and len(list(found[0].glob("shard-*.json"))) >= 5:
            partial = found[0]
        else:
            os.killpg(proc.pid, signal.SIGCONT)
    assert partial is not None, f"preparation never got going (exit code {proc.poll()})"
    os.killpg(proc.pid, sig)  # the whole process group, as Ctrl-C in a terminal or a killed job would
    os.killpg(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGINT once continued
    proc.wait(timeout=60)
    done_before = sorted(p.name for p in partial.glob("shard-*.json"))
    assert done_before and not list(cache.glob("stores/*/manifest.json"))  # nothing was published
    mtimes = {name: os.stat(partial / name).st_mtime_ns for name in done_before}

    log = []
    spec = StoreSpec("big", (entry,), "text", str(cache), part_bytes=part_bytes)
    folder = prepare_store(spec, tokenizer, workers=2, progress=False, log=log.append)
    assert f"({len(done_before)} already done)" in log[0], log[0]
    assert {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in done_before} == mtimes  # kept, not redone
    fresh = prepare_store(StoreSpec("big", (entry,), "text", str(tmp_path / "fresh"), part_bytes=part_bytes),
                          tokenizer, workers=1, progress=False, log=lambda *_: None)
    assert _store_digest(folder) == _store_digest(fresh)
    assert json.load(open(os.path.join(folder, "manifest.json")))["shards"] == \
        json.load(open(os.path.join(fresh, "manifest.json")))["shards"]


def test_a_store_whose_files_changed_is_a_one_line_error_until_prepared_again(tmp_path, tokenizer):
    write_corpus(tmp_path, 20)
    path = tmp_path / "a.jsonl"
    spec = StoreSpec("s", (str(path),), "text", str(tmp_path / "cache"), key="data.sources 's'")
    ensure_store(spec, tokenizer, workers=1, log=lambda *_: None)
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(RecipeError) as info:
        open_store(spec, tokenizer)
    message = str(info.value)
    assert "\n" not in message and "changed" in message and "--prepare-data" in message and "'s'" in message


def test_bad_sources_are_one_line_errors_naming_the_file(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(RecipeError, match=r"no column 'text' \(columns: content\)"):
        load_documents([str(tmp_path / "t.parquet")])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"txt": "no"}) + "\n")
    spec = StoreSpec("s", (str(tmp_path / "bad.jsonl"),), "text", str(tmp_path / "cache"))
    with pytest.raises(RecipeError, match=r"bad.jsonl' line 2 has no \"text\" field"):
        prepare_store(spec, tokenizer, workers=1, progress=False, log=lambda *_: None)
    with pytest.raises(RecipeError, match="does not exist"):
        load_documents([str(tmp_path / "missing.jsonl")])
