"""Packed rows read from a token store (data/token_store.py): today's packing, without holding the token stream.

The row stream is the one `pack_token_documents` (data/packing.py) builds in memory: documents shuffled with `seed`,
each followed by one EOS, concatenated, cut into consecutive rows of `seq_len + 1` tokens (a corpus shorter than a row
repeats to fill it). Here only the document order and its running token count are held (16 bytes per document); a
row's tokens are gathered from the memory-mapped shards when the loader asks for it.

Per-source selection happens here too: `min_doc_tokens` drops shorter documents, and documents of at least
`long_doc_tokens` tokens appear `long_doc_upsample` times as often (an integer part, plus one more copy with the
fractional part's probability, drawn per document from the seed), as in Fu et al. 2024's per-source length upsampling.

Chat stores (their mask marks the assistant tokens, data/chat.py) are not cut anywhere: their rows hold whole
conversations, packed by best-fit decreasing over windows of `pack_window` conversations and padded
(data/chat_packing.py). Only marked tokens carry labels, document boundaries come from the store rather than from EOS
ids (a chat tokenizer's EOS may end every turn), and a conversation longer than seq_len is dropped, or with
truncate = "turns" cut before the first message that does not fit (dropped all the same when what is left has no
assistant token); both are counted.
"""
from __future__ import annotations

import numpy as np

from data.chat import LABEL, TURN_START
from data.chat_packing import DEFAULT_PACK_WINDOW, chat_row, pack_conversations
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
                 heldout_fraction: float = 0.0, key: str = "data", truncate: str = "drop",
                 pack_window: int = DEFAULT_PACK_WINDOW):
        if seq_len < 2:
            raise RecipeError(f"training.seq_len must be >= 2 (one input and one label token per row), got "
                              f"{seq_len}; set e.g. --training.seq_len 512.")
        lengths = self._fitted_lengths(store, seq_len, truncate)
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
                        document_masking, lengths, pack_window)

    @classmethod
    def heldout(cls, store: TokenStore, *, seq_len: int, seed: int, fraction: float,
                document_masking: bool = False, pack_window: int = DEFAULT_PACK_WINDOW) -> "StoreRows":
        """Rows of the held-out documents, longest first (so the first rows carry the longest contexts)."""
        rows = cls.__new__(cls)
        lengths = rows._fitted_lengths(store, seq_len, "drop")
        held = np.flatnonzero(heldout_documents(store, fraction, seed) & (lengths > 0))
        order = held[np.argsort(-lengths[held], kind="stable")]
        rows._use_order(store, order, seq_len, document_masking, lengths, pack_window)
        return rows

    def _fitted_lengths(self, store: TokenStore, seq_len: int, truncate: str) -> np.ndarray:
        """Tokens used of each document: all of a text document; of a conversation, all when it fits in seq_len,
        else 0 (dropped) or, with truncate = "turns", up to the start of the first message that does not fit."""
        lengths = store.doc_lengths.astype(np.int64)
        self.dropped = self.truncated = 0
        if not store.has_label_mask:
            return lengths
        fitted = lengths.copy()
        for doc in np.flatnonzero(lengths > seq_len):
            fitted[doc] = 0
            if truncate == "turns":
                mask = np.asarray(store.document_mask(int(doc))[:seq_len + 1])
                starts = np.flatnonzero(mask & TURN_START)
                cut = int(starts[starts <= seq_len].max(initial=0))
                if cut and (mask[:cut] & LABEL).any():
                    fitted[doc] = cut
                    self.truncated += 1
                    continue
            self.dropped += 1
        return fitted

    def describe(self, name: str) -> str:
        """The start-up line of a chat source: conversations used, dropped and cut for this seq_len, and how full
        its rows of whole conversations are."""
        if self.layout is None:
            return ""
        return (f"data: chat source '{name}' at seq_len {self.seq_len}: {self.num_documents:,} conversation(s) used, "
                f"{self.dropped:,} longer than seq_len dropped, {self.truncated:,} cut at a turn boundary; packed "
                f"whole into {self.num_rows:,} rows, packing efficiency {self.packing_efficiency:.4f} (conversation "
                f"tokens / row tokens; best-fit decreasing over windows of {self.layout.window:,} conversations)")

    @property
    def packing_efficiency(self) -> float | None:
        """Tokens of conversations / row tokens of a chat source (None for text, whose rows hold no padding)."""
        return None if self.layout is None else self.layout.efficiency

    def padding_of(self, index: int) -> int:
        """How many of row `index`'s input tokens are padding (the last ones; 0 for text rows)."""
        return 0 if self.layout is None else self.seq_len - int(self.lengths[self.layout.row_members(index)].sum())

    def _use_order(self, store: TokenStore, order: np.ndarray, seq_len: int, document_masking: bool,
                   lengths: np.ndarray, pack_window: int = DEFAULT_PACK_WINDOW) -> None:
        self.store = store
        self.lengths = lengths
        self.seq_len = seq_len
        self.eos_id = store.eos_id
        self.document_masking = document_masking
        self.order = order
        self.num_documents = len(order)
        self.layout = None
        if store.has_label_mask:  # whole conversations per row, padded
            self.layout = pack_conversations(order, lengths, seq_len, pack_window)
            self.corpus_tokens = self.layout.conversation_tokens
            self.num_rows = self.layout.num_rows
            self.repeated = False
            return
        self.ends = np.cumsum(lengths[order] + 1)  # +1: the EOS after each document
        self.corpus_tokens = int(self.ends[-1]) if len(order) else 0
        self.num_rows = max(1, self.corpus_tokens // (seq_len + 1))
        self.repeated = self.corpus_tokens < seq_len + 1

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def __len__(self) -> int:
        return self.num_rows

    def row_tokens(self, index: int) -> np.ndarray:
        """The seq_len + 1 tokens of row `index`: of a text source, tokens [index * (seq_len + 1), (index + 1) *
        (seq_len + 1)) of the (periodic) document stream; of a chat source, its conversations and padding."""
        if self.layout is not None:
            return chat_row(self.store, self.layout, self.lengths, index, self.eos_id)[0]
        return self._text_row(index)

    def _text_row(self, index: int) -> np.ndarray:
        width = self.seq_len + 1
        out = np.empty(width, dtype=np.int64)
        position = (index * width) % self.corpus_tokens
        filled = 0
        k = int(np.searchsorted(self.ends, position, side="right"))
        offset = position - (int(self.ends[k - 1]) if k else 0)
        while filled < width:
            doc = int(self.order[k])
            length = int(self.lengths[doc])
            piece = self.store.document(doc)[offset:length]
            take = min(len(piece), width - filled)
            out[filled:filled + take] = piece[:take]
            filled += take
            if filled < width and offset + take == length:
                out[filled] = self.eos_id
                filled += 1
            k, offset = (k + 1) % len(self.order), 0
        return out

    def row_fields(self, index: int) -> dict[str, np.ndarray]:
        if self.layout is None:
            return row_fields(self._text_row(index), self.eos_id, self.document_masking)
        tokens, labelled, ends, _ = chat_row(self.store, self.layout, self.lengths, index, self.eos_id)
        return row_fields(tokens, self.eos_id, self.document_masking, labelled=labelled, ends_document=ends)
