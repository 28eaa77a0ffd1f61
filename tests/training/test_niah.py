"""Needle-in-a-haystack rows and pictures: needles sit at their depth with the asked value as the only labels
(single, multi-key with distractors, multi-value in order of appearance), read back from the decoded text; the heatmap
PNG and the TensorBoard image exist with the picture's size."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from data.niah import NiahRows
from data.labels import IGNORE_INDEX
from tests.data.chat_fixtures import write_chat_tokenizer
from data.hf_tokenizer import HFTokenizer

NEEDLE = re.compile(r"special magic number for (\w+) is ?(\d{7})\.")


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

    from training.evaluation.heatmap import log_heatmap_image, write_heatmap

    results = {(n, d): (i * 7 % 11) / 10 for i, (n, d) in enumerate((n, d) for n in (128, 256, 512)
                                                                      for d in (0, 0.25, 0.5, 0.75, 1.0))}
    pixels = write_heatmap(results, "Needle in a haystack, step 7", str(tmp_path / "h.png"))
    assert os.path.getsize(tmp_path / "h.png") > 5000 and pixels.ndim == 3 and pixels.shape[2] == 3
    log_heatmap_image(str(tmp_path / "tb"), "niah/heatmap", pixels, 7)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    events.Reload()
    image = events.Images("niah/heatmap")[0]
    assert image.step == 7 and (image.height, image.width) == pixels.shape[:2]


NIAH_RUN = """
[job]
seed = 0
[model]
name = "debug"
dim = 64
n_layers = 2
n_heads = 4
[training]
steps = 40
seq_len = 128
local_batch_size = 16
[optimizer]
lr = 3e-3
[data]
dataset = "niah"
[parallelism]
dp_shard = -1
cp = 1
[metrics]
log_freq = 20
enable_tensorboard = true
[checkpoint]
enable = true
interval = 40
[eval]
niah = true
niah_lengths = [96, 128]
niah_depths = 3
niah_samples = 8
"""


def read_cells(folder: str) -> dict:
    import json

    with open(os.path.join(folder, "niah_eval.json")) as f:
        last = json.load(f)[-1]
    return last["step"], {(c["context_length"], c["depth"]): (c["accuracy"], c["answer_token_accuracy"])
                          for c in last["cells"]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_niah_eval_under_cp2_equals_cp1_per_cell(tmp_path):
    """Trained briefly on 2 ranks (dp 2, cp 1), evaluated there; the checkpoint then evaluated again under cp 2 (a
    resume at the last step only evaluates): every cell's exact and answer-token accuracy is the same. The ranks are
    forked from one interpreter (tests/trainer_runs.run_train(forked=True)): the numbers are the subject, not the
    launch, and torchrun's agent and a torch import per rank were ~15 CPU-s of each run."""
    from tests.trainer_runs import run_train

    recipe, out = tmp_path / "niah.toml", str(tmp_path / "run")
    recipe.write_text(NIAH_RUN)
    first = run_train(str(recipe), "--job.dump_folder", out, nproc=2, timeout=500, forked=True)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    step, cp1 = read_cells(out)
    assert step == 40 and os.path.exists(os.path.join(out, "niah_heatmap.png"))
    second = run_train(str(recipe), "--job.dump_folder", out, "--parallelism.cp", "2", nproc=2, timeout=500,
                       forked=True)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "cp 2" in second.stdout and "NIAH (single) at step 40" in second.stdout
    step, cp2 = read_cells(out)
    print("cp1", cp1, "\ncp2", cp2)
    assert step == 40 and cp2 == cp1 and any(t > 0 for _, t in cp1.values())


def test_too_short_niah_length_is_one_line_before_torchrun(tmp_path):
    from tests.trainer_runs import run_train

    recipe = tmp_path / "niah.toml"
    recipe.write_text(NIAH_RUN.replace("niah_lengths = [96, 128]", "niah_lengths = [32, 128]"))
    result = run_train(str(recipe), nproc=2, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "eval.niah_lengths: 32 is too short" in errors[0], \
        result.stderr[-2000:]
    assert "torch.distributed.run" not in result.stderr
