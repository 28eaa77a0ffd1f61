"""The labels' one fact: the ignored label agrees everywhere it is used, and the digit rule refuses split digits."""
import pytest
import torch
import torch.nn.functional as F

from config import RecipeError
from data.labels import IGNORE_INDEX, single_token_digits
from models.chunked_loss import IGNORE_INDEX as MODEL_IGNORE_INDEX


def test_ignored_label_is_torchs_default_and_the_models():
    logits = torch.randn(3, 5)
    labels = torch.tensor([1, IGNORE_INDEX, 2])
    assert F.cross_entropy(logits, labels).item() == pytest.approx(F.cross_entropy(logits[[0, 2]],
                                                                                   labels[[0, 2]]).item())
    assert MODEL_IGNORE_INDEX == IGNORE_INDEX


class _SplitsSeven:
    def encode(self, text):
        return [ord(c) for c in text] * (2 if text == "7" else 1)


def test_a_split_digit_is_refused_naming_the_task():
    with pytest.raises(RecipeError, match="digit '7' as 2 tokens; the needle task"):
        single_token_digits(_SplitsSeven(), "needle")


def test_single_token_digits_in_order():
    class Bytes:
        def encode(self, text):
            return [ord(c) for c in text]
    assert single_token_digits(Bytes(), "passkey") == [ord(d) for d in "0123456789"]
