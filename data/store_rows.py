"""Packed rows read from a token store (data/token_store.py): today's packing, without holding the token stream.

The row stream is the one `pack_token_documents` (data/packing.py) builds in memory: documents shuffled with `seed`,
each followed by one EOS, concatenated, cut into consecutive rows of `seq_len + 1` tokens (a corpus shorter than a row
repeats to fill it). Here only the document order and its running token count are held (16 bytes per document); a
row's tokens are gathered from the memory-mapped shards when the loader asks for it.

Per-source selection happens here too: `min_doc_tokens` drops shorter documents, and documents of at least
`long_doc_tokens` tokens appear `long_doc_upsample` times as often (an integer part, plus one more copy with the
fractional part's probability, drawn per document from the seed), as in Fu et al. 2024's per-source length upsampling.
"""
from __future__ import annotations

import numpy as np

from data.packing import row_fields
from data.token_store import TokenStore
from config import RecipeError

_UPSAMPLE_STREAM = 11  # keeps the upsampling draws apart from the document shuffle of the same seed
_HELDOUT_STREAM = 17  # which documents are held out for evaluation


def heldout_documents(store: TokenStore, fraction: float, seed: int) -> np.ndarray:
    """Bool per document: held out for evaluation (never trained on). At least one document when fraction > 0."""
    held = np.random.default_rng([_HELDOUT_STREAM, seed]).random(store.num_documents) < fraction
    if fraction > 0 and not held.any() and store.num_documents > 1:
        held[int(np.argmax(store.doc_lengths))] = True
    return held


class StoreRows:
    """The `PackedRows` interface (num_rows, row_fields, corpus_tokens, ...) over a `TokenStore`."""

    def __init__(self, store: TokenStore, *, seq_len: int, seed: int, document_masking: bool = False,
                 min_doc_tokens: int = 0, long_doc_tokens: int = 0, long_doc_upsample: float = 1.0,
                 heldout_fraction: float = 0.0, key: str = "data"):
        if seq_len < 2:
            raise RecipeError(f"training.seq_len must be >= 2 (one input and one label token per row), got "
                              f"{seq_len}; set e.g. --training.seq_len 512.")
        lengths = store.doc_lengths.astype(np.int64)
        copies = np.where(lengths >= max(min_doc_tokens, 1), 1.0, 0.0)
        if heldout_fraction > 0:
            copies[heldout_documents(store, heldout_fraction, seed)] = 0.0
        if long_doc_tokens > 0 and long_doc_upsample != 1.0:
            copies = np.where(lengths >= long_doc_tokens, copies * long_doc_upsample, copies)
        whole = np.floor(copies)
        draw = np.random.default_rng([_UPSAMPLE_STREAM, seed]).random(len(copies))
        counts = (whole + (draw < copies - whole)).astype(np.int64)
        instances = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
        if not len(instances):
            raise RecipeError(f"{key}: no document of '{store.manifest['name']}' is kept (min_doc_tokens = "
                              f"{min_doc_tokens}, longest document {int(lengths.max(initial=0))} tokens); lower "
                              f"min_doc_tokens or add data.")
        self._use_order(store, instances[np.random.default_rng(seed).permutation(len(instances))], seq_len,
                        document_masking)

    @classmethod
    def heldout(cls, store: TokenStore, *, seq_len: int, seed: int, fraction: float,
                document_masking: bool = False) -> "StoreRows":
        """Rows of the held-out documents, longest first (so the first rows carry the longest contexts)."""
        held = np.flatnonzero(heldout_documents(store, fraction, seed))
        order = held[np.argsort(-store.doc_lengths[held].astype(np.int64), kind="stable")]
        rows = cls.__new__(cls)
        rows._use_order(store, order, seq_len, document_masking)
        return rows

    def _use_order(self, store: TokenStore, order: np.ndarray, seq_len: int, document_masking: bool) -> None:
        self.store = store
        self.seq_len = seq_len
        self.eos_id = store.eos_id
        self.document_masking = document_masking
        self.order = order
        self.ends = np.cumsum(store.doc_lengths.astype(np.int64)[order] + 1)  # +1: the EOS after each document
        self.corpus_tokens = int(self.ends[-1]) if len(order) else 0
        self.num_documents = len(order)
        self.num_rows = max(1, self.corpus_tokens // (seq_len + 1))
        self.repeated = self.corpus_tokens < seq_len + 1

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def __len__(self) -> int:
        return self.num_rows

    def row_tokens(self, index: int) -> np.ndarray:
        """Tokens [index * (seq_len + 1), (index + 1) * (seq_len + 1)) of the (periodic) document stream."""
        width = self.seq_len + 1
        out = np.empty(width, dtype=np.int64)
        position = (index * width) % self.corpus_tokens
        filled = 0
        k = int(np.searchsorted(self.ends, position, side="right"))
        offset = position - (int(self.ends[k - 1]) if k else 0)
        while filled < width:
            document = self.store.document(int(self.order[k]))
            piece = document[offset:]
            take = min(len(piece), width - filled)
            out[filled:filled + take] = piece[:take]
            filled += take
            if filled < width and offset + take == len(document):
                out[filled] = self.eos_id
                filled += 1
            k, offset = (k + 1) % len(self.order), 0
        return out

    def row_fields(self, index: int) -> dict[str, np.ndarray]:
        return row_fields(self.row_tokens(index), self.eos_id, self.document_masking)
