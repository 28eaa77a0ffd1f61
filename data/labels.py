"""What the data marks in a row's labels, and the one rule for answer digits.

IGNORE_INDEX is what `F.cross_entropy` ignores by default: the loss skips every token labelled with it (filler,
prompts, user turns, padding). The models package keeps its own copy (models.chunked_loss) because models never
import data; tests/data/test_labels.py checks the two agree with torch's default.

The synthetic retrieval tasks (passkey, needle in a haystack) answer with digits, one token each, so an exact
answer is a copy of tokens and never a count over subword pieces: `single_token_digits` is that check, once.
"""
from __future__ import annotations

from config import RecipeError

IGNORE_INDEX = -100


def single_token_digits(tokenizer, task: str) -> list[int]:
    """The token id of each digit 0-9; a one-line error naming the task if the tokenizer splits any digit."""
    ids = []
    for digit in "0123456789":
        encoded = tokenizer.encode(digit)
        if len(encoded) != 1:
            raise RecipeError(f"the tokenizer encodes digit '{digit}' as {len(encoded)} tokens; the {task} task "
                              f"needs one token per digit (train the tokenizer with byte fallback on data.corpus).")
        ids.append(encoded[0])
    return ids
