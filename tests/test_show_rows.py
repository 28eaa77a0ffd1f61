"""`./run_train.sh RECIPE --show-rows N [--json]` as a user runs it (no process group, no GPU): the JSON rows of a chat
and text mixture read back hold whole conversations only, with transformers' ids and assistant mask, then padding
(marked as such, no labels, a document of its own), text rows label
every token, and bad chat input stops in one line before torchrun."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data.labels import IGNORE_INDEX
from tests.data.chat_fixtures import conversations, write_chat_tokenizer, write_jsonl
from tests.trainer_runs import run_train

transformers = pytest.importorskip("transformers")


def mixture_recipe(tmp_path, folder: str, chats: list) -> str:
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    recipe = tmp_path / "mix.toml"
    recipe.write_text(f"""
[training]
steps = 1
seq_len = 192
local_batch_size = 1
[parallelism]
dp_shard = 1
[data]
cache_dir = "{tmp_path / 'cache'}"
tokenizer_path = "{folder}"
prepare_workers = 1
document_masking = true
[[data.sources]]
name = "talk"
path = "{tmp_path / 'chat.jsonl'}"
format = "chat"
weight = 1.0
[[data.sources]]
name = "docs"
path = "pydoc"
weight = 1.0
""")
    return str(recipe)


@pytest.mark.slow
def test_show_rows_json_holds_transformers_rendering(tmp_path):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): launches beside transformers' chat
    template, 19 s."""
    folder = write_chat_tokenizer(str(tmp_path / "tok"), "llama3")
    chats = conversations(30, seed=7)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    expected = {}
    for m in chats:
        out = reference.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        expected[tuple(out["input_ids"])] = [bool(x) for x in out["assistant_masks"]]
    eos = reference.convert_tokens_to_ids("<|eot_id|>")
    recipe = mixture_recipe(tmp_path, folder, chats)
    result = run_train(recipe, "--show-rows", "8", "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["row"] for r in rows] == list(range(8)) and {r["source"] for r in rows} == {"talk", "docs"}
    whole = 0
    for row in rows:
        ids, labels, docs = (np.asarray(row[k]) for k in ("input_ids", "labels", "document_ids"))
        assert len(ids) == len(labels) == len(row["position_ids"]) == 192
        if row["source"] == "docs":
            assert (labels != IGNORE_INDEX).all()
            continue
        predicted = np.concatenate(([False], labels[:-1] != IGNORE_INDEX))
        padding = row["padding"]
        assert padding > 0  # 30 short conversations fill few rows: some room is left
        assert (ids[-padding:] == eos).all() and (labels[-padding - 1:] == IGNORE_INDEX).all()
        assert len(set(docs[-padding:])) == 1 and docs[-padding - 1] != docs[-1]
        assert row["position_ids"][-padding:] == list(range(padding))
        for doc in np.unique(docs[:-padding]):  # whole conversations only
            where = np.flatnonzero(docs == doc)
            assert row["position_ids"][where[0]] == 0
            key = tuple(ids[where].tolist())
            assert key in expected and expected[key] == predicted[where].tolist()
            whole += 1
    assert whole >= 3

    text = run_train(recipe, "--show-rows", "2", timeout=300)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "row 0 (source 'talk'" in text.stdout and "⟦" in text.stdout and "document 0" in text.stdout
    padding = rows[0]["padding"]
    assert f"{padding} padding;" in text.stdout
    assert f"padding ({padding} tokens, positions 0..{padding - 1}, no labels, a document of its own)" in text.stdout


@pytest.mark.parametrize("case, needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": {"role": "user", "content": "hi"}}, "must be a list"),
])
def test_bad_chat_input_stops_in_one_line_before_torchrun(tmp_path, case, needle):
    folder = write_chat_tokenizer(str(tmp_path / "tok"), "chatml")
    recipe = mixture_recipe(tmp_path, folder, conversations(2))
    with open(tmp_path / "chat.jsonl", "a") as f:
        f.write(json.dumps(case) + "\n")
    result = run_train(recipe, nproc=1, timeout=300)
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "chat.jsonl" in errors[0], result.stderr[-2000:]
    assert "torch.distributed.run" not in result.stderr and "Traceback" not in result.stderr
