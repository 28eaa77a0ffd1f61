"""data.tokenizer: exact vocab, lossless round trip, byte fallback, cache hits, racing ranks, loading, the CLI."""
import os
import subprocess
import sys

import pytest
import sentencepiece as spm

import data.tokenizer as tokenizer_module
from data.corpus import load_documents
from data.tokenizer import Tokenizer, build_tokenizer, publish_once
from config import RecipeError
from harness.launch_env import child_env
from tests.distributed import fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pydoc_docs():
    return load_documents(["pydoc"])


@pytest.fixture(scope="module")
def pydoc_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spm_cache"))


@pytest.fixture(scope="module")
def pydoc_tokenizer(pydoc_docs, pydoc_cache):
    return build_tokenizer(None, pydoc_docs, 2048, pydoc_cache)


def _cached_models(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(".model"))


def test_trains_exactly_the_requested_vocab(pydoc_tokenizer, pydoc_cache):
    (name,) = _cached_models(pydoc_cache)
    reference = spm.SentencePieceProcessor(model_file=os.path.join(pydoc_cache, name))  # read the file directly
    assert reference.get_piece_size() == pydoc_tokenizer.vocab_size == 2048
    assert (pydoc_tokenizer.bos_id, pydoc_tokenizer.eos_id, pydoc_tokenizer.pad_id) == (1, 2, 3)
    assert [reference.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]


def test_other_vocab_size_is_exact_too(pydoc_docs, tmp_path):
    assert build_tokenizer(None, pydoc_docs, 777, str(tmp_path)).vocab_size == 777


def test_round_trip_every_pydoc_document(pydoc_tokenizer, pydoc_docs):
    for doc in pydoc_docs:
        assert pydoc_tokenizer.decode(pydoc_tokenizer.encode(doc)) == doc
    batch = pydoc_tokenizer.encode_batch(pydoc_docs[:5])
    assert batch == [pydoc_tokenizer.encode(doc) for doc in pydoc_docs[:5]]
    # compression sanity: BPE at 2048 pieces packs several characters per token on English prose
    tokens = sum(len(ids) for ids in pydoc_tokenizer.encode_batch(pydoc_docs))
    assert 2.5 < sum(map(len, pydoc_docs)) / tokens < 4.0


def test_byte_fallback_encodes_unseen_characters(pydoc_tokenizer):
    text = "  leading spaces\ttabs\r\nand 🦙 llama, 中文, \x00 nul "
    assert pydoc_tokenizer.decode(pydoc_tokenizer.encode(text)) == text
    ids = pydoc_tokenizer.encode("🦙")
    processor = spm.SentencePieceProcessor(model_proto=pydoc_tokenizer.model_proto)
    expected = [f"<0x{byte:02X}>" for byte in "🦙".encode("utf-8")]  # the UTF-8 bytes, one piece each
    assert [processor.id_to_piece(i) for i in ids] == expected
    assert pydoc_tokenizer.encode("") == [] and pydoc_tokenizer.decode([]) == ""


def test_cache_hit_is_identical_and_does_not_train(pydoc_tokenizer, pydoc_docs, pydoc_cache, monkeypatch):
    (name,) = _cached_models(pydoc_cache)
    path = os.path.join(pydoc_cache, name)
    mtime = os.stat(path).st_mtime_ns

    def must_not_train(*args, **kwargs):
        raise AssertionError("cache hit retrained")

    monkeypatch.setattr(tokenizer_module, "train_model_proto", must_not_train)
    again = build_tokenizer(None, pydoc_docs, 2048, pydoc_cache)  # no wall-clock bound: must_not_train is the check
    assert again.model_proto == pydoc_tokenizer.model_proto
    assert os.stat(path).st_mtime_ns == mtime
    assert _cached_models(pydoc_cache) == [name]


def test_cache_key_depends_on_documents_and_vocab(pydoc_docs, tmp_path):
    build_tokenizer(None, pydoc_docs, 600, str(tmp_path))
    build_tokenizer(None, pydoc_docs[:-1], 600, str(tmp_path))
    build_tokenizer(None, pydoc_docs, 601, str(tmp_path))
    assert len(_cached_models(tmp_path)) == 3


def _race_body(barrier, docs, cache_dir, queue):
    barrier.wait()  # both processes look at the empty cache at the same moment
    tok = build_tokenizer(None, docs, 1024, cache_dir)
    queue.put(tok.model_proto)


def test_two_processes_racing_for_the_cache_agree(pydoc_docs, tmp_path):
    ctx = fresh_process_context()
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_body, args=(barrier, pydoc_docs, str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        protos = [queue.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    (name,) = _cached_models(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [name]  # no temp file left behind
    with open(tmp_path / name, "rb") as f:
        on_disk = f.read()
    assert protos[0] == protos[1] == on_disk


def test_publish_once_keeps_the_first_file_and_cleans_up(tmp_path):
    target = str(tmp_path / "m.model")
    publish_once(target, b"first")
    publish_once(target, b"second")
    with open(target, "rb") as f:
        assert f.read() == b"first"
    assert os.listdir(tmp_path) == ["m.model"]


def test_loads_a_given_model(pydoc_tokenizer, tmp_path):
    path = tmp_path / "given.model"
    path.write_bytes(pydoc_tokenizer.model_proto)
    loaded = build_tokenizer(str(path), ["ignored"], 2048, str(tmp_path / "unused"))
    assert loaded.encode("hello world") == pydoc_tokenizer.encode("hello world")
    assert not (tmp_path / "unused").exists()
    with pytest.raises(RecipeError, match="model.vocab_size"):
        build_tokenizer(str(path), [], 1000, str(tmp_path))


def test_given_model_errors(tmp_path):
    missing = str(tmp_path / "missing.model")
    with pytest.raises(RecipeError, match="data.tokenizer_path") as info:
        build_tokenizer(missing, [], 2048, str(tmp_path))
    assert missing in str(info.value)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(RecipeError, match="not a SentencePiece model"):
        build_tokenizer(str(garbage), [], 2048, str(tmp_path))


def test_vocab_too_large_for_the_corpus_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="model.vocab_size") as info:
        build_tokenizer(None, ["a tiny corpus, far too small"], 2048, str(tmp_path))
    assert "\n" not in str(info.value)
    assert _cached_models(tmp_path) == []


def test_cli_writes_a_model_with_the_exact_vocab(tmp_path):
    out = tmp_path / "sub" / "tok.model"
    env = child_env()
    done = subprocess.run([sys.executable, "-m", "data.tokenizer", "--corpus", "pydoc", "--vocab-size", "512",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "512 pieces" in done.stdout
    assert Tokenizer.from_file(str(out)).vocab_size == 512
    bad = subprocess.run([sys.executable, "-m", "data.tokenizer", "--corpus", str(tmp_path / "nope"),
                          "--vocab-size", "512", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "data.corpus" in bad.stderr
