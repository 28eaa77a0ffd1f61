"""SentencePiece tokenizer: load one (`data.tokenizer_path`) or train one on the corpus with exactly the model's vocab.

Training settings: BPE with byte fallback (any text encodes, unknown characters become byte pieces), identity
normalisation, no dummy prefix and no whitespace folding, so `decode(encode(text)) == text` for any valid text.
Ids 0..3 are <unk>, <s>, </s>, <pad>. Training is pinned to one thread because SentencePiece's BPE result depends on
the thread count; single-threaded it is reproducible byte for byte, and on pydoc at vocab 2048 takes ~0.1 s.

Cache: a trained model is stored as `<cache_dir>/spm-<hash>.model`, the hash covering the documents, the vocab size,
the trainer settings and the sentencepiece version. Concurrent ranks: every rank that misses the cache trains its own
copy (cheap, and no rank ever waits on another), writes it to a private temp file and publishes it with `os.link`,
which atomically creates the final name only if it does not exist yet. The first rank to finish wins; later ranks drop
their copy and load the published file, so all ranks use byte-identical models and no reader ever sees a half-written
file. On file systems without hard links the fallback is `os.replace` (the last rename wins; training is deterministic,
so the bytes are the same).

CLI: python -m data.tokenizer --corpus PATH [PATH...] --vocab-size N --out FILE
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tempfile
import time

import sentencepiece as spm

from config import RecipeError
from data.corpus import load_documents

# SentencePiece skips training "sentences" longer than max_sentence_length bytes, so long documents are fed in
# newline-aligned chunks of at most this many characters (4 bytes per character at most in UTF-8).
TRAINING_CHUNK_CHARS = 1 << 14

TRAINER_SETTINGS = {
    "model_type": "bpe",
    "byte_fallback": True,
    "character_coverage": 0.9995,  # the rarest characters go through byte fallback instead of taking pieces
    "normalization_rule_name": "identity",
    "add_dummy_prefix": False,
    "remove_extra_whitespaces": False,
    "split_digits": True,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": 3,
    "num_threads": 1,
    "max_sentence_length": 4 * TRAINING_CHUNK_CHARS,
}


class Tokenizer:
    """A loaded SentencePiece model with the handful of calls the data pipeline needs."""

    add_bos = False  # our packing never put BOS in documents; kept so that trained models see what they always saw

    def __init__(self, model_proto: bytes, source: str = "<memory>"):
        self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.source = source
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:24]

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        with open(path, "rb") as f:
            proto = f.read()
        try:
            return cls(proto, source=path)
        except RuntimeError as err:
            raise RecipeError(f"'{path}' is not a SentencePiece model ({_first_line(err)}); point "
                              f"data.tokenizer_path at a tokenizer.model, or delete it if it is a stale file "
                              f"in data.cache_dir.") from None

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def pad_id(self) -> int:
        """The model's <pad>; models without one (e.g. Llama 2's) pad with EOS, which the loss never sees."""
        pad = self._processor.pad_id()
        return pad if pad >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], threads: int | None = None) -> list[list[int]]:
        """`threads` None: SentencePiece's own choice (every core); the store's workers pass 1 (one core each)."""
        return self._processor.encode(list(texts), out_type=int, num_threads=threads)

    def decode(self, ids) -> str:
        return self._processor.decode([int(i) for i in ids])


def build_tokenizer(model_path: str | None, documents: list[str], vocab_size: int, cache_dir: str) -> Tokenizer:
    """Load `model_path` if given, else train on `documents` (or reuse the cached model trained on the same inputs)."""
    if model_path:
        return _load_given_model(model_path, vocab_size)
    cache_path = os.path.join(cache_dir, f"spm-{training_key(documents, vocab_size)}.model")
    if not os.path.exists(cache_path):
        proto = train_model_proto(documents, vocab_size)
        publish_once(cache_path, proto)
    tokenizer = Tokenizer.from_file(cache_path)
    if tokenizer.vocab_size != vocab_size:  # only a foreign file at our cache name could do this
        raise RecipeError(f"data.cache_dir: '{cache_path}' has {tokenizer.vocab_size} pieces, expected "
                          f"{vocab_size}; delete it so it is trained again.")
    return tokenizer


def training_key(documents: list[str], vocab_size: int) -> str:
    """Hash of everything that decides the trained model's bytes."""
    digest = hashlib.sha256()
    settings = dict(TRAINER_SETTINGS, vocab_size=vocab_size, chunk=TRAINING_CHUNK_CHARS,
                    sentencepiece=spm.__version__)
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for doc in documents:
        data = doc.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] and ["a", "bc"] differ
        digest.update(data)
    return digest.hexdigest()[:24]


def train_model_proto(documents: list[str], vocab_size: int) -> bytes:
    """Train a SentencePiece model with exactly `vocab_size` pieces and return its serialized bytes."""
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_training_sentences(documents), model_writer=writer,
                                       vocab_size=vocab_size, minloglevel=2, **TRAINER_SETTINGS)
    except RuntimeError as err:
        raise RecipeError(f"model.vocab_size = {vocab_size} cannot be trained on this data.corpus "
                          f"({_first_line(err)}); pick a vocab size in the range SentencePiece names, "
                          f"use a larger corpus, or set data.tokenizer_path.") from None
    proto = writer.getvalue()
    pieces = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    if pieces != vocab_size:
        raise RecipeError(f"model.vocab_size = {vocab_size} but the trained tokenizer has {pieces} pieces; "
                          f"use a larger data.corpus or a smaller vocab.")
    return proto


def publish_once(path: str, data: bytes) -> None:
    """Atomically create `path` with `data` unless another process already did; never overwrite a published file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp_path = _write_temp(folder, os.path.basename(path), data)
    try:
        os.link(temp_path, path)
    except FileExistsError:
        pass  # another rank published first; its model is what everybody loads
    except OSError:  # no hard links on this file system
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)


def write_atomically(path: str, data: bytes) -> None:
    """Write `path` so that readers see the old file or the new one, never a partial one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temp_path = _write_temp(folder, os.path.basename(path), data)
    os.replace(temp_path, path)


def _write_temp(folder: str, name: str, data: bytes) -> str:
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return temp_path


def _load_given_model(model_path: str, vocab_size: int):
    """A SentencePiece .model, a Hugging Face tokenizer.json, or a folder holding either (an HF model folder)."""
    from data.hf_tokenizer import HFTokenizer, tokenizer_json_in

    if not os.path.exists(model_path):
        raise RecipeError(f"data.tokenizer_path: '{model_path}' does not exist; fix the path or leave "
                          f"data.tokenizer_path empty to train a tokenizer on data.corpus.")
    json_path = tokenizer_json_in(model_path)
    if json_path:
        tokenizer = HFTokenizer(json_path)
    else:
        spm_path = os.path.join(model_path, "tokenizer.model") if os.path.isdir(model_path) else model_path
        if not os.path.isfile(spm_path):
            raise RecipeError(f"data.tokenizer_path: folder '{model_path}' holds neither tokenizer.json nor "
                              f"tokenizer.model; point it at a Hugging Face model folder or a tokenizer file.")
        tokenizer = Tokenizer.from_file(spm_path)
    if tokenizer.vocab_size > vocab_size:
        raise RecipeError(f"data.tokenizer_path: '{model_path}' has {tokenizer.vocab_size} tokens but "
                          f"model.vocab_size is {vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}.")
    if tokenizer.eos_id < 0:
        raise RecipeError(f"data.tokenizer_path: '{model_path}' defines no EOS piece, which packing needs to "
                          f"separate documents; use a model with </s>.")
    return tokenizer


def _training_sentences(documents: list[str]):
    """Documents cut at newlines into pieces SentencePiece will not skip as too long."""
    for doc in documents:
        start = 0
        while start < len(doc):
            end = min(start + TRAINING_CHUNK_CHARS, len(doc))
            if end < len(doc):
                newline = doc.rfind("\n", start, end)
                if newline > start:
                    end = newline + 1
            yield doc[start:end]
            start = end


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    text = text.splitlines()[-1] if text else type(err).__name__
    return text.rsplit("] ", 1)[-1]  # drop SentencePiece's "INTERNAL: file.cc(line) [check]" prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.tokenizer",
                                     description="Train a SentencePiece tokenizer with an exact vocab size.")
    parser.add_argument("--corpus", nargs="+", required=True, help='"pydoc", .txt/.jsonl files or folders')
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", required=True, help="where to write the .model file")
    args = parser.parse_args(argv)
    try:
        documents = load_documents(args.corpus)
        start = time.perf_counter()
        proto = train_model_proto(documents, args.vocab_size)
        seconds = time.perf_counter() - start
        write_atomically(args.out, proto)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer(proto)
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(documents))
    print(f"wrote {args.out}: {tokenizer.vocab_size} pieces, trained in {seconds:.2f}s on {len(documents)} "
          f"documents ({sum(map(len, documents))} chars -> {tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
