"""Rows of whole conversations: a chat source's conversations packed by best-fit decreasing, the rest of a row padding.

Why. A conversation cut by a row boundary trains replies on questions the model cannot see (with document masking the
first part is invisible) and replies whose conversation goes on elsewhere, so a chat row holds whole conversations
only, as TRL's and LLaMA-Factory's packing do. Text sources keep their cut-anywhere stream (data/store_rows.py).

The packing. The conversations (already selected and shuffled with the seed, data/store_rows.py) are taken in windows
of `window` consecutive conversations. Inside a window, best-fit decreasing: longest first (ties in shuffled order),
each goes into the open row with the least room that still holds it, or opens a new row; a row holds `seq_len`
tokens of conversations (the model's inputs). Rows are numbered window by window in the order they open; the layout
is computed once, so row r (and through the loader's permutation, global row g) is a pure function of (store, seed,
seq_len, window).

A row's tokens. Its conversations back to back, each exactly as rendered (no separator: a conversation's ids are
transformers' `apply_chat_template` ids), then padding up to seq_len + 1 tokens: the padding id, no labels, and one
document of its own, so with document masking it attends only to itself and its positions start at 0. The first
token of each conversation is never a target, so no label crosses a conversation boundary.

Efficiency = tokens of conversations / (rows x seq_len): the share of the model's input tokens that are conversation.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from data.chat import LABEL

DEFAULT_PACK_WINDOW = 10_000
_BIN_BITS = 32  # a row's key in the best-fit search: room << 32 | row number (one int compares both)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item (rows numbered in the order they open): longest first, ties in input order, each into
    the open row with the least room that holds it (the lowest-numbered among equals), else into a new row."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"items must be 1..{capacity} long, got {int(lengths.min())}..{int(lengths.max())}")
    rows = np.empty(len(lengths), dtype=np.int64)
    smallest = int(lengths.min(initial=capacity))
    open_rows: list[int] = []  # keys of rows that can still take the smallest item, sorted by (room, row)
    opened = 0
    for item in np.argsort(-lengths, kind="stable").tolist():
        size = int(lengths[item])
        at = bisect_left(open_rows, size << _BIN_BITS)
        if at < len(open_rows):
            key = open_rows.pop(at)
            room, row = (key >> _BIN_BITS) - size, key & ((1 << _BIN_BITS) - 1)
        else:
            room, row = capacity - size, opened
            opened += 1
        rows[item] = row
        if room >= smallest:
            insort(open_rows, (room << _BIN_BITS) | row)
    return rows


@dataclass
class ChatLayout:
    """Which conversations each row holds: row r is members[starts[r]:starts[r + 1]], in the order they were placed."""

    members: np.ndarray
    starts: np.ndarray
    conversation_tokens: int
    seq_len: int
    window: int

    @property
    def num_rows(self) -> int:
        return len(self.starts) - 1

    @property
    def efficiency(self) -> float:
        """Tokens of conversations / row tokens (rows x seq_len inputs)."""
        return self.conversation_tokens / max(1, self.num_rows * self.seq_len)

    def row_members(self, row: int) -> np.ndarray:
        return self.members[self.starts[row]:self.starts[row + 1]]


def pack_conversations(order: np.ndarray, lengths: np.ndarray, seq_len: int, window: int) -> ChatLayout:
    """The rows of conversations `order` (store document numbers, a document may repeat) with token counts
    `lengths[doc]` (each 1..seq_len), packed by best-fit decreasing inside each window of `window` conversations."""
    if window < 1:
        raise ValueError(f"the packing window must hold at least one conversation, got {window}")
    members, counts = [], []
    for first in range(0, len(order), window):
        docs = np.asarray(order[first:first + window], dtype=np.int64)
        rows = best_fit_decreasing(lengths[docs], seq_len)
        placed = np.argsort(-lengths[docs], kind="stable")  # placement order, as the packer took them
        by_row = placed[np.argsort(rows[placed], kind="stable")]
        members.append(docs[by_row])
        counts.append(np.bincount(rows, minlength=int(rows.max(initial=-1)) + 1))
    members = np.concatenate(members) if members else np.empty(0, dtype=np.int64)
    counts = np.concatenate(counts) if counts else np.empty(0, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return ChatLayout(members, starts, int(lengths[members].sum()), seq_len, window)


def chat_row(store, layout: ChatLayout, lengths: np.ndarray, row: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(tokens, labelled, ends_document, padding tokens among the inputs) of one row of seq_len + 1 tokens:
    `ends_document` is True at the last token of each conversation, so the padding after it is a document of its
    own (data/packing.row_fields)."""
    width = layout.seq_len + 1
    tokens = np.full(width, pad_id, dtype=np.int64)
    labelled = np.zeros(width, dtype=bool)
    ends = np.zeros(width, dtype=bool)
    filled = 0
    for doc in layout.row_members(row).tolist():
        length = int(lengths[doc])
        tokens[filled:filled + length] = store.document(doc)[:length]
        labelled[filled:filled + length] = (store.document_mask(doc)[:length] & LABEL) > 0
        labelled[filled] = False  # a conversation's first token is never the target of the one before it
        filled += length
        ends[filled - 1] = True
    return tokens, labelled, ends, layout.seq_len - filled
