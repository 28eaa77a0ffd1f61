"""The tokenized corpus store: token shards read memory-mapped, so no rank holds the corpus or its token stream.

One store per source, in a folder under `data.cache_dir/stores/`:

    manifest.json            what the store holds and what it was made from (format, tokenizer fingerprint, the
                             source files with sizes and mtimes, dtype, per-shard counts and checksums)
    shard-00000.tokens       the documents' token ids back to back (uint16 when the vocab fits, else uint32)
    shard-00000.lengths      uint32 tokens per document (BOS included when the tokenizer adds it; never EOS)
    shard-00000.mask         chat sources only: uint8 per token, bit 1 = the token carries a label (an assistant
                             token), bit 2 = it starts a message (data/chat.py)
    shard-00000.json         the shard's completion record (written last, atomically: a shard without it is unfinished)

A shard is the tokenized form of one `SourcePart` (data/corpus.py), so the shards and their bytes depend only on the
sources and the tokenizer, never on how many workers made them or how often preparation was interrupted.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from config import RecipeError

FORMAT = 1
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_shard(folder: str, index: int, token_documents: list[list[int]], dtype: np.dtype,
                masks: list[np.ndarray] | None = None) -> dict:
    """Writes shard `index` of `folder`; its completion record goes last, so a crash leaves it unfinished, not torn.
    `masks` (chat sources): one uint8 mask per document, as long as its tokens."""
    lengths = np.fromiter((len(doc) for doc in token_documents), dtype=np.uint32, count=len(token_documents))
    tokens = np.empty(int(lengths.sum(dtype=np.int64)), dtype=dtype)
    start = 0
    for doc in token_documents:
        tokens[start:start + len(doc)] = doc
        start += len(doc)
    name = shard_name(index)
    digest = hashlib.sha256()
    arrays = [("tokens", tokens), ("lengths", lengths)]
    if masks is not None:
        arrays.append(("mask", np.concatenate(masks).astype(np.uint8) if masks else np.empty(0, dtype=np.uint8)))
    for suffix, array in arrays:
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        digest.update(data)
        _write_atomically(os.path.join(folder, f"{name}.{suffix}"), data)
    record = {"name": name, "tokens": int(tokens.size), "documents": int(lengths.size), "sha256": digest.hexdigest()}
    _write_atomically(os.path.join(folder, f"{name}.json"), json.dumps(record).encode())
    return record


def finished_shard(folder: str, index: int) -> dict | None:
    """The completion record of shard `index`, or None when it is not finished."""
    try:
        with open(os.path.join(folder, f"{shard_name(index)}.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class TokenStore:
    """A published store, memory-mapped: `document(i)` is a view into the page cache, not a copy."""

    def __init__(self, folder: str):
        self.folder = folder
        with open(os.path.join(folder, MANIFEST)) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise RecipeError(f"data store '{folder}' has format {self.manifest.get('format')}, this code reads "
                              f"{FORMAT}; run ./run_train.sh RECIPE --prepare-data again.")
        self.dtype = np.dtype(self.manifest["dtype"])
        self._tokens = []
        self._masks = [] if self.manifest.get("label_mask") else None
        lengths = []
        for shard in self.manifest["shards"]:
            path = os.path.join(folder, f"{shard['name']}.tokens")
            self._tokens.append(np.memmap(path, dtype=self.dtype, mode="r") if shard["tokens"] else
                                np.empty(0, dtype=self.dtype))
            if self._masks is not None:
                self._masks.append(np.memmap(os.path.join(folder, f"{shard['name']}.mask"), dtype=np.uint8, mode="r")
                                   if shard["tokens"] else np.empty(0, dtype=np.uint8))
            lengths.append(np.fromfile(os.path.join(folder, f"{shard['name']}.lengths"), dtype="<u4"))
        self.doc_lengths = np.concatenate(lengths) if lengths else np.empty(0, dtype=np.uint32)
        counts = np.array([len(x) for x in lengths], dtype=np.int64)
        self._shard_first_doc = np.concatenate(([0], np.cumsum(counts)))
        # Start of each document inside its own shard (int64: shards may exceed 4 Gi tokens).
        self._doc_starts = np.concatenate([np.concatenate(([0], np.cumsum(x[:-1], dtype=np.int64)))
                                           if len(x) else np.empty(0, dtype=np.int64) for x in lengths]
                                          or [np.empty(0, dtype=np.int64)])

    @property
    def num_documents(self) -> int:
        return int(self.doc_lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def has_label_mask(self) -> bool:
        """A chat store: only the tokens its mask marks carry labels."""
        return self._masks is not None

    def document(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self._shard_first_doc, index, side="right")) - 1
        start = int(self._doc_starts[index])
        return self._tokens[shard][start:start + int(self.doc_lengths[index])]

    def document_mask(self, index: int) -> np.ndarray:
        """The mask bits of document `index` (data/chat.py: LABEL, TURN_START); chat stores only."""
        shard = int(np.searchsorted(self._shard_first_doc, index, side="right")) - 1
        start = int(self._doc_starts[index])
        return self._masks[shard][start:start + int(self.doc_lengths[index])]


def _write_atomically(path: str, data: bytes) -> None:
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def write_manifest(folder: str, manifest: dict) -> None:
    _write_atomically(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
