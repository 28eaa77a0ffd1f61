"""Synthetic passkey retrieval: a random key hidden at some depth of filler text, asked for at the very end.

It proves attention reaches across the whole context, and under context parallelism across shards held by other
ranks: the question sits at the end of the row (the last zigzag chunk, on rank 0 with the first one) while the key can
be anywhere. A row, `seq_len + 1` tokens:

    filler ... " The pass key is" 4 8 2 1 3 ". Remember it. " ... filler ... " What was the pass key? The pass key is" 4 8 2 1 3

Only the answer digits carry labels (the rest is IGNORE_INDEX), in training and in evaluation: the filler is
trivially predictable and would drown the one signal that matters. The key has distinct digits, so every key digit
but the last has a unique successor inside the key and copying it needs no counting; each digit is its own token.
A small model learns the copy far faster on short rows (the search for the key's position is the slow part), so
recipes/passkey_cp2.toml ramps 48 -> 128 tokens. Rows are virtual: row i is generated
from (seed, i), so the stream is endless, identical on every rank and cheap to index; `PasskeyRows` has the interface
of `PackedRows` and plugs into the same global-row loader (so it checkpoints and reshards like real data).
"""
from __future__ import annotations

import numpy as np

from config import RecipeError
from data.labels import IGNORE_INDEX, single_token_digits
# The standard formulation: the key sits in repetitive, key-free filler, so what is measured is retrieval over
# distance, not reading comprehension. (Our own sentences; only the idea is the benchmark's.)
FILLER = ("The river runs past the old mill. Birds rest on the stone wall. The day stays long and quiet. "
          "We walk to the hill and come back again. ")  # no " is" and no digits: the key's prompt stays unique
# No space after "is": SentencePiece would make it a token of its own that the filler uses too, so the token before
# the key and before the answer would no longer be unique to them.
KEY_INTRO = " The pass key is"
KEY_OUTRO = ". Remember it. "
QUESTION = " What was the pass key? The pass key is"
_PASSKEY_STREAM = 7  # keeps passkey randomness apart from other users of `seed`


class SyntheticRows:
    """What the loader asks of a virtual row stream (passkey, needle in a haystack): `num_rows` rows of `seq_len`
    tokens, each a pure function of its index, never repeated."""
    num_rows: int
    seq_len: int

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    @property
    def repeated(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_rows


class PasskeyRows(SyntheticRows):
    def __init__(self, tokenizer, filler_documents: list[str] | None = None, *, seq_len: int, seed: int,
                 key_digits: int = 5, num_rows: int = 1 << 30, depth: float | None = None):
        """`filler_documents` default to the repeated FILLER sentences. `depth` fixes where the key goes (0 = start
        of the filler, 1 = just before the question); None draws it uniformly per row, which is what training wants."""
        self.seq_len = seq_len
        self.seed = seed
        if not 1 <= key_digits <= 10:
            raise RecipeError(f"passkey key_digits must be 1..10 (the key's digits are distinct), got {key_digits}")
        self.key_digits = key_digits
        self.num_rows = num_rows
        self.depth = depth
        self.document_masking = False
        self.needs_shuffle = False  # row i is already a random draw; a permutation of 2**30 rows would cost 8 GiB
        self.digit_ids = single_token_digits(tokenizer, "passkey")
        self.intro = tokenizer.encode(KEY_INTRO)
        self.outro = tokenizer.encode(KEY_OUTRO)
        self.question = tokenizer.encode(QUESTION)
        self.filler = np.concatenate([np.asarray(tokenizer.encode(doc), dtype=np.int64)
                                      for doc in (filler_documents or [FILLER])])
        self.corpus_tokens = len(self.filler)
        fixed = len(self.intro) + len(self.outro) + len(self.question) + 2 * key_digits
        self.filler_length = seq_len + 1 - fixed
        if self.filler_length < 1:
            raise RecipeError(f"training.seq_len {seq_len} is too short for the passkey task: it needs at least "
                              f"{fixed} tokens of prompt and key. Use a seq_len of {fixed + 64} or more.")

    def sample(self, index: int) -> tuple[np.ndarray, str, float]:
        """(row tokens of length seq_len + 1, the key as a string, the depth used)."""
        rng = np.random.default_rng([_PASSKEY_STREAM, self.seed, index])
        key = "".join(str(d) for d in rng.permutation(10)[:self.key_digits])
        depth = float(rng.random()) if self.depth is None else self.depth
        key_tokens = np.asarray([self.digit_ids[int(c)] for c in key], dtype=np.int64)
        start = int(rng.integers(0, max(1, len(self.filler) - self.filler_length)))
        filler = np.resize(self.filler[start:], self.filler_length)  # wraps around a short filler corpus
        cut = int(round(depth * self.filler_length))
        needle = np.concatenate([self.intro, key_tokens, self.outro]).astype(np.int64)
        row = np.concatenate([filler[:cut], needle, filler[cut:], np.asarray(self.question, dtype=np.int64),
                              key_tokens])
        return row, key, depth

    def row_fields(self, index: int) -> dict[str, np.ndarray]:
        row, _, _ = self.sample(index)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[-self.key_digits:] = row[-self.key_digits:]
        return {"input_ids": row[:-1].copy(), "labels": labels,
                "position_ids": np.arange(self.seq_len, dtype=np.int64),
                "document_ids": np.zeros(self.seq_len, dtype=np.int64)}
