"""Passkey rows and the retrieval evaluation, checked against the row's own text and against an oracle model."""
import numpy as np
import pytest
import torch

from data.labels import IGNORE_INDEX
from data.passkey import KEY_INTRO, QUESTION, PasskeyRows
from config import RecipeError


@pytest.fixture(scope="module")
def tokenizer():
    from data.corpus import load_documents
    from data.tokenizer import build_tokenizer
    from models.llama import model_config
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        return build_tokenizer(None, load_documents(["pydoc"]), model_config("debug").vocab_size, cache)


def _find(row, pattern):
    pattern = list(pattern)
    return [i for i in range(len(row) - len(pattern) + 1) if list(row[i:i + len(pattern)]) == pattern]


def test_row_holds_the_key_at_its_depth_and_asks_for_it_at_the_end(tokenizer):
    rows = PasskeyRows(tokenizer, seq_len=256, seed=3)
    intro, question = tokenizer.encode(KEY_INTRO), tokenizer.encode(QUESTION)
    depths = []
    for index in range(20):
        row, key, depth = rows.sample(index)
        assert len(row) == 257 and len(key) == 5
        digits = [int(tokenizer.decode([t])) for t in row[-5:]]
        assert "".join(map(str, digits)) == key  # the answer is the key, one token per digit
        assert list(row[-5 - len(question):-5]) == question
        start, asked = _find(row, intro)  # the needle's, and the end of the question: nowhere else
        assert asked == 256 - 5 - len(intro) + 1
        assert list(row[start + len(intro):start + len(intro) + 5]) == list(row[-5:])
        assert abs(start / (256 - 5 - len(question)) - depth) < 0.1
        depths.append(depth)
    assert min(depths) < 0.25 and max(depths) > 0.75  # keys land anywhere, including the other CP rank's chunks


def test_rows_label_only_the_answer_and_keys_have_distinct_digits(tokenizer):
    rows = PasskeyRows(tokenizer, seq_len=128, seed=0)
    for index in range(30):
        fields = rows.row_fields(index)
        answered = fields["labels"] != IGNORE_INDEX
        assert answered.sum() == 5 and answered[-5:].all()
        assert np.array_equal(fields["labels"][-5:], rows.sample(index)[0][-5:])
        assert np.array_equal(fields["input_ids"][-4:], fields["labels"][-5:-1])  # teacher forcing: shifted by one
        assert len(set(rows.sample(index)[1])) == 5


def test_rows_are_reproducible_and_seed_dependent(tokenizer):
    a, b = PasskeyRows(tokenizer, seq_len=128, seed=1), PasskeyRows(tokenizer, seq_len=128, seed=2)
    assert np.array_equal(a.sample(7)[0], PasskeyRows(tokenizer, seq_len=128, seed=1).sample(7)[0])
    assert a.sample(7)[1] != b.sample(7)[1] or a.sample(8)[1] != b.sample(8)[1]


def test_too_short_a_row_is_a_recipe_error(tokenizer):
    with pytest.raises(RecipeError, match="training.seq_len 16 is too short for the passkey task"):
        PasskeyRows(tokenizer, seq_len=16, seed=0)


class _Oracle(torch.nn.Module):
    """Predicts every next token of known rows exactly (or, with `wrong_digit`, misses one answer digit)."""

    def __init__(self, rows, vocab, wrong_digit=False):
        super().__init__()
        self.rows, self.vocab, self.wrong_digit = rows, vocab, wrong_digit

    def forward(self, tokens, position_ids=None, *, labels=None, token_scores=False, **_):
        """Logits, or (with `token_scores`, as the evaluation asks) per-token loss (unused) and argmax."""
        logits = torch.zeros(*tokens.shape, self.vocab)
        for b, seq in enumerate(tokens):
            row = next(r for r in self.rows if torch.equal(torch.as_tensor(r[:-1]), seq))
            target = torch.as_tensor(row[1:])
            if self.wrong_digit and b % 2 == 0:
                target[-3] = (target[-3] + 1) % self.vocab
            logits[b, torch.arange(len(target)), target] = 1.0
        return (torch.zeros(tokens.shape), logits.argmax(-1)) if token_scores else logits


@pytest.mark.parametrize("wrong_digit, expected", [(False, 1.0), (True, 0.5)])
def test_accuracy_counts_a_row_only_when_every_digit_is_right(tokenizer, wrong_digit, expected):
    from training.evaluation.passkey import EVAL_SEED_OFFSET, evaluate_passkey
    rows = PasskeyRows(tokenizer, seq_len=96, seed=EVAL_SEED_OFFSET, depth=0.0)
    known = [rows.sample(i)[0] for i in range(8)]
    model = _Oracle(known, tokenizer.vocab_size, wrong_digit)
    results = evaluate_passkey(model, tokenizer, None, context_lengths=[96], depths=[0.0], samples=8, seed=0,
                               device=torch.device("cpu"))
    assert results == {(96, 0.0): expected}
