"""Packing: documents -> one token stream -> rows of `seq_len + 1` tokens -> the four per-token training buffers.

Deterministic given (documents, tokenizer, seq_len, seed): every document is tokenized and gets one EOS appended, the
document order is shuffled with `seed`, and the documents are concatenated into a single int32 stream stored once.
Rows are consecutive, non-overlapping `seq_len + 1` windows of that stream (reshaped views, no copies); the tail that
does not fill a row is dropped. A corpus shorter than one row is repeated until it fills one, so a tiny corpus still
works at a long seq_len (the row then sees the same documents several times).

Per row, inputs and labels are shifted here, before any sequence sharding, so a context-parallel shard of `labels`
still holds the true next token of its last input. The EOS token belongs to the document it ends: `document_ids` count
the EOS tokens strictly before each position, and with document masking `position_ids` restart at 0 after each EOS.
"""
from __future__ import annotations

import numpy as np

from config import RecipeError
from config.schema import MIN_SEQ_LEN
from data.labels import IGNORE_INDEX

FIELDS = ("input_ids", "labels", "position_ids", "document_ids")


class PackedRows:
    """The packed token stream of one corpus and a cheap view of it as rows."""

    def __init__(self, stream: np.ndarray, *, corpus_tokens: int, num_documents: int, seq_len: int, eos_id: int,
                 document_masking: bool):
        self.stream = stream
        self.corpus_tokens = corpus_tokens
        self.num_documents = num_documents
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.document_masking = document_masking
        self.num_rows = len(stream) // (seq_len + 1)
        self.rows = stream[: self.num_rows * (seq_len + 1)].reshape(self.num_rows, seq_len + 1)

    @property
    def repeated(self) -> bool:
        """True when the corpus was shorter than one row and had to be repeated to fill it."""
        return len(self.stream) > self.corpus_tokens

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens the model sees in one pass over all rows."""
        return self.num_rows * self.seq_len

    def __len__(self) -> int:
        return self.num_rows

    def row_fields(self, index: int) -> dict[str, np.ndarray]:
        """input_ids, labels, position_ids, document_ids of row `index`, each int64 of length seq_len."""
        return row_fields(self.rows[index], self.eos_id, self.document_masking)


def row_fields(tokens: np.ndarray, eos_id: int, document_masking: bool, *, labelled: np.ndarray | None = None,
               ends_document: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The four training buffers of one row of seq_len + 1 tokens (labels shifted here, before any sharding).
    Chat rows pass `labelled` (per token: it carries a label; the others get IGNORE_INDEX) and `ends_document` (per
    token: the EOS that ends a document), since their tokenizer's EOS id may also end every turn."""
    seq_len = len(tokens) - 1
    input_ids = tokens[:-1].astype(np.int64)
    labels = tokens[1:].astype(np.int64)
    if labelled is not None:
        labels[~labelled[1:]] = IGNORE_INDEX
    ends_document = input_ids == eos_id if ends_document is None else ends_document[:-1]
    document_ids = np.zeros(seq_len, dtype=np.int64)
    np.cumsum(ends_document[:-1], out=document_ids[1:])
    positions = np.arange(seq_len, dtype=np.int64)
    if document_masking:
        document_starts = np.flatnonzero(np.concatenate(([True], ends_document[:-1])))
        positions = positions - document_starts[document_ids]
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "document_ids": document_ids}


def pack_documents(tokenizer, documents: list[str], *, seq_len: int, seed: int,
                   document_masking: bool = False) -> PackedRows:
    """Tokenize `documents` with `tokenizer` (anything with encode/eos_id) and pack them."""
    if hasattr(tokenizer, "encode_batch"):
        token_documents = tokenizer.encode_batch(documents)
    else:
        token_documents = [tokenizer.encode(doc) for doc in documents]
    return pack_token_documents(token_documents, eos_id=tokenizer.eos_id, seq_len=seq_len, seed=seed,
                                document_masking=document_masking)


def pack_token_documents(token_documents: list[list[int]], *, eos_id: int, seq_len: int, seed: int,
                         document_masking: bool = False) -> PackedRows:
    """Pack already tokenized documents (no EOS yet) into rows of seq_len + 1 tokens."""
    if seq_len < MIN_SEQ_LEN:
        raise RecipeError(f"training.seq_len must be >= 2 (one input and one label token per row), got {seq_len}; "
                          f"set e.g. --training.seq_len 512.")
    if not token_documents:
        raise RecipeError("data.corpus produced no documents to pack; add documents or use \"pydoc\".")
    order = np.random.default_rng(seed).permutation(len(token_documents))
    lengths = np.array([len(token_documents[i]) + 1 for i in order], dtype=np.int64)
    stream = np.empty(int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    for doc_index, end, length in zip(order, ends, lengths):
        stream[end - length: end - 1] = token_documents[doc_index]
        stream[end - 1] = eos_id
    corpus_tokens = len(stream)
    row_tokens = seq_len + 1
    if corpus_tokens < row_tokens:
        stream = np.tile(stream, -(-row_tokens // corpus_tokens))
    return PackedRows(stream, corpus_tokens=corpus_tokens, num_documents=len(token_documents), seq_len=seq_len,
                      eos_id=eos_id, document_masking=document_masking)
