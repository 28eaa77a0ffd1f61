"""Needle in a haystack (RULER's key-value form): "The special magic number for <word> is <7 digits>." placed at a
depth of a haystack, asked for at the end; only the answer digits carry labels.

A row, `seq_len + 1` tokens:

    haystack ... needle(s) ... haystack ... question answer

The haystack is the run's own held-out documents (token ids, concatenated; the passkey filler sentences when the run
has no stores). Variants (RULER): `keys` > 1 adds distractor needles for other words at random depths; `values` > 1
places that many needles for the asked word (the first at the cell's depth, the others at random depths), and the
answer is every value, in order of appearance, separated by ", ". A value has 7 distinct digits, each its own token
(as the passkey's), so an exact answer is a copy, never a count. Rows are virtual: row i is a pure function of
(seed, i), identical on every rank; `NiahRows` has the interface of `PasskeyRows` and plugs into the same evaluation
(and, with `depth=None`, into the loader as training rows: `data.dataset = "niah"`).
"""
from __future__ import annotations

import numpy as np

from config import RecipeError
from data.labels import IGNORE_INDEX, single_token_digits
from data.passkey import FILLER, SyntheticRows

WORDS = ("apple", "river", "candle", "forest", "marble", "pepper", "violin", "harbor", "saddle", "garden", "copper",
         "meadow", "anchor", "lantern", "orchid", "pillow", "rocket", "silver", "thunder", "walnut")
VALUE_DIGITS = 7
# The value follows "is" / "are" with no space (as the passkey's key does): a space would be a token of its own that
# the haystack uses everywhere, so the token before a value would no longer be unique to needles and answers.
NEEDLE = " The special magic number for {word} is"
# The question ends as the needle does ("... for <word> is"), as the passkey's question repeats its key line: the
# token pair before the value is then unique to the asked needle and the answer, so retrieval is a copy of what
# follows it. RULER's own ending ("... mentioned in the provided text is") gives a pair ("text is") that no needle
# has, and the recipe's 2-layer model stayed at 3.7% exact after 2,500 steps; with this ending it reaches 100%.
QUESTION = " What is the special magic number for {word} mentioned in the provided text? The special magic number " \
           "for {word} is"
QUESTION_ALL = " What are all the special magic numbers for {word} mentioned in the provided text? The special " \
               "magic numbers for {word} are"
_NIAH_STREAM = 19  # keeps needle randomness apart from other users of `seed`


class NiahRows(SyntheticRows):
    def __init__(self, tokenizer, haystack: np.ndarray | None = None, *, seq_len: int, seed: int,
                 depth: float | None = None, keys: int = 1, values: int = 1, num_rows: int = 1 << 30):
        """`haystack`: token ids the filler is cut from (None = the passkey filler sentences). `depth` places the
        asked needle (0 = start, 1 = just before the question); None draws it per row (training)."""
        if not 1 <= keys <= len(WORDS) or values < 1:
            raise RecipeError(f"eval.niah_keys must be 1..{len(WORDS)} and eval.niah_values >= 1, got {keys} and "
                              f"{values}.")
        self.seq_len, self.seed, self.depth = seq_len, seed, depth
        self.keys, self.values, self.num_rows = keys, values, num_rows
        self.document_masking = False
        self.needs_shuffle = False
        self.tokenizer = tokenizer
        self.digit_ids = single_token_digits(tokenizer, "needle")
        self.comma = np.asarray(tokenizer.encode(", "), dtype=np.int64)
        self.period = np.asarray(tokenizer.encode("."), dtype=np.int64)
        self.haystack = (np.asarray(haystack, dtype=np.int64) if haystack is not None and len(haystack)
                         else np.asarray(tokenizer.encode(FILLER * 8), dtype=np.int64))
        self.corpus_tokens = len(self.haystack)
        self._needles = {w: np.asarray(tokenizer.encode(NEEDLE.format(word=w)), dtype=np.int64) for w in WORDS}
        question = QUESTION_ALL if values > 1 else QUESTION
        self._questions = {w: np.asarray(tokenizer.encode(question.format(word=w)), dtype=np.int64) for w in WORDS}
        longest = max(len(n) for n in self._needles.values()) + VALUE_DIGITS + len(self.period)
        fixed = (keys - 1 + values) * longest + max(len(q) for q in self._questions.values()) + \
            values * VALUE_DIGITS + (values - 1) * len(self.comma)
        if seq_len + 1 - fixed < 1:
            raise RecipeError(f"eval.niah_lengths: {seq_len} is too short for the needle task ({fixed} tokens of "
                              f"needles and question); use lengths of {fixed + 64} or more.")

    def _value(self, rng) -> np.ndarray:
        return np.asarray([self.digit_ids[int(d)] for d in rng.permutation(10)[:VALUE_DIGITS]], dtype=np.int64)

    def sample(self, index: int) -> tuple[np.ndarray, int]:
        """(row tokens of length seq_len + 1, number of answer tokens at its end)."""
        rng = np.random.default_rng([_NIAH_STREAM, self.seed, index])
        words = [WORDS[int(i)] for i in rng.permutation(len(WORDS))[:self.keys]]
        asked = words[0]
        values = [self._value(rng) for _ in range(self.values)]
        depth = float(rng.random()) if self.depth is None else self.depth
        needles = [(depth, 0, asked, values[0])]  # (depth, order, word, value)
        needles += [(float(rng.random()), k, asked, v) for k, v in enumerate(values[1:], start=1)]
        needles += [(float(rng.random()), k, w, self._value(rng)) for k, w in enumerate(words[1:], start=self.values)]
        pieces = {id(v): np.concatenate([self._needles[w], v, self.period]) for _, _, w, v in needles}
        question = self._questions[asked]
        answer_parts = []
        for d, order, word, value in sorted(needles, key=lambda n: (n[0], n[1])):
            if word == asked:
                answer_parts += [value, self.comma]
        answer = np.concatenate(answer_parts[:-1])
        filler_length = self.seq_len + 1 - len(question) - len(answer) - sum(len(p) for p in pieces.values())
        start = int(rng.integers(0, max(1, len(self.haystack) - filler_length)))
        filler = np.resize(self.haystack[start:], filler_length)
        row, cut_from = [], 0
        for d, _, _, value in sorted(needles, key=lambda n: (n[0], n[1])):
            cut = max(cut_from, int(round(d * filler_length)))
            row += [filler[cut_from:cut], pieces[id(value)]]
            cut_from = cut
        row += [filler[cut_from:], question, answer]
        return np.concatenate(row), len(answer)

    def row_fields(self, index: int) -> dict[str, np.ndarray]:
        row, answer = self.sample(index)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[-answer:] = row[-answer:]
        return {"input_ids": row[:-1].copy(), "labels": labels,
                "position_ids": np.arange(self.seq_len, dtype=np.int64),
                "document_ids": np.zeros(self.seq_len, dtype=np.int64)}
