"""Needle-in-a-haystack rows and pictures: needles sit at their depth with the asked value as the only labels
(single, multi-key with distractors, multi-value in order of appearance), read back from the decoded text; the heatmap
PNG and the TensorBoard image exist with the picture's size."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from data.niah import NiahRows
from data.passkey import IGNORE_INDEX
from tests.data.chat_fixtures import write_chat_tokenizer
from data.hf_tokenizer import HFTokenizer

NEEDLE = re.compile(r"special magic number for (\w+) is (\d{7})\.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = write_chat_tokenizer(str(tmp_path_factory.mktemp("niah_tok")), "chatml")
    return HFTokenizer(os.path.join(folder, "tokenizer.json"))


@pytest.mark.parametrize("keys, values", [(1, 1), (4, 1), (1, 3), (2, 2)])
def test_needles_at_their_depths_and_the_answer_is_the_only_label(tokenizer, keys, values):
    haystack = np.asarray(tokenizer.encode("the quiet river runs past the mill " * 80))
    for depth in (0.0, 0.5, 1.0):
        rows = NiahRows(tokenizer, haystack, seq_len=400, seed=3, depth=depth, keys=keys, values=values)
        fields = rows.row_fields(0)
        text = tokenizer.decode(np.concatenate([fields["input_ids"], fields["labels"][-1:]]))
        needles = NEEDLE.findall(text)
        asked = re.search(r"numbers? for (\w+) mentioned in the provided text\?", text).group(1)
        assert len(needles) == keys - 1 + values and len({w for w, _ in needles}) == keys
        expected = ", ".join(v for w, v in needles if w == asked)
        labelled = fields["labels"] != IGNORE_INDEX
        assert tokenizer.decode(fields["labels"][labelled]) == expected
        assert labelled[-len(fields["labels"][labelled]):].all() and text.endswith(expected)
        first = text.index(f"for {asked} is")  # the asked needle placed at `depth` comes first for values == 1
        question = text.index("What ")
        if values == 1:
            assert abs(first / question - depth) < 0.12, (first / question, depth)
        assert len(fields["input_ids"]) == 400


def test_heatmap_png_and_tensorboard_image(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.heatmap import log_heatmap_image, write_heatmap

    results = {(n, d): (i * 7 % 11) / 10 for i, (n, d) in enumerate((n, d) for n in (128, 256, 512)
                                                                      for d in (0, 0.25, 0.5, 0.75, 1.0))}
    pixels = write_heatmap(results, "Needle in a haystack, step 7", str(tmp_path / "h.png"))
    assert os.path.getsize(tmp_path / "h.png") > 5000 and pixels.ndim == 3 and pixels.shape[2] == 3
    log_heatmap_image(str(tmp_path / "tb"), "niah/heatmap", pixels, 7)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    image = events.Images("niah/heatmap")[0]
    assert image.step == 7 and (image.height, image.width) == pixels.shape[:2]
