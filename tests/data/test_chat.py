"""Chat sources against transformers itself: rendered ids equal `apply_chat_template(tokenize=True)` and the label
mask equals `return_assistant_tokens_mask` (templates with `{% generation %}`), the prefix rule gives the same mask on
the same templates without markers; the store and the packed rows hold every conversation whole with its ids and
labels (jsonl, jsonl.gz and parquet alike); long conversations are dropped or cut at a turn; bad input is one line."""
from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from config import RecipeError
from config.recipe import load_config
from data.chat import LABEL, TURN_START, build_renderer
from data.hf_tokenizer import HFTokenizer
from data.passkey import IGNORE_INDEX
from data.sources import check_sources, open_stores, stage_rows
from tests.data.chat_fixtures import conversations, write_chat_tokenizer, write_jsonl

transformers = pytest.importorskip("transformers")


def reference(folder: str, messages: list[dict]) -> tuple[list[int], list[int] | None]:
    """transformers' ids and assistant mask (None when the template marks no generation)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tok")
    return {(style, markers): write_chat_tokenizer(str(root / f"{style}-{markers}"), style, generation_markers=markers)
            for style in ("llama3", "chatml") for markers in (True, False)}


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_ids_and_masks_equal_transformers_on_30_conversations(folders, style):
    marked = transformers.AutoTokenizer.from_pretrained(folders[(style, True)])
    unmarked = transformers.AutoTokenizer.from_pretrained(folders[(style, False)])
    ours_marked = build_renderer(HFTokenizer(os.path.join(folders[(style, True)], "tokenizer.json")), "test")
    ours_rule = build_renderer(HFTokenizer(os.path.join(folders[(style, False)], "tokenizer.json")), "test")
    assert ours_marked.marks_generation and not ours_rule.marks_generation
    labelled = 0
    for messages in conversations(30):
        ref = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = ours_marked.encode(messages, "test")
        assert ids == list(ref["input_ids"])
        assert list(mask & LABEL) == list(ref["assistant_masks"])
        # No markers: ids still equal transformers' rendering; the prefix rule finds the spans the markers mark.
        rule_ids, rule_mask = ours_rule.encode(messages, "test")
        assert rule_ids == list(unmarked.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        assert rule_ids == ids and list(rule_mask) == list(mask)
        turns = np.flatnonzero(mask & TURN_START)
        assert len(turns) == len(messages) and turns[0] == 0
        labelled += int((mask & LABEL).sum())
    assert labelled > 100


def chat_recipe(tmp_path, paths: list[str], folder: str, *, seq_len: int = 128, extra: str = "") -> str:
    recipe = tmp_path / "chat.toml"
    entries = ", ".join(json.dumps(str(p)) for p in paths)
    recipe.write_text(f"[training]\nsteps = 1\nseq_len = {seq_len}\nlocal_batch_size = 1\n[parallelism]\ndp_shard = 1\n"
                      f"[data]\ncache_dir = \"{tmp_path / 'cache'}\"\ntokenizer_path = \"{folder}\"\nprepare_workers = 1\n"
                      f"document_masking = true\n[[data.sources]]\nname = \"chat\"\npath = [{entries}]\n"
                      f"format = \"chat\"\n{extra}")
    return str(recipe)


def whole_conversations(fields: dict, pad_id: int) -> list[tuple[list[int], list[bool]]]:
    """(input ids, predicted per token) of every conversation of the row (rows hold whole conversations, then
    padding: a last document of pad ids that carries no label)."""
    ids, labels, docs = fields["input_ids"], fields["labels"], fields["document_ids"]
    predicted = np.concatenate(([False], labels[:-1] != IGNORE_INDEX))
    out = []
    for doc in np.unique(docs):
        where = np.flatnonzero(docs == doc)
        if doc == docs[-1] and (ids[where] == pad_id).all() and not predicted[where].any():
            continue  # the padding
        out.append((list(ids[where]), list(predicted[where])))
    return out


def test_store_rows_keep_conversations_in_jsonl_gz_and_parquet(folders, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = folders[("chatml", True)]
    chats = conversations(24, seed=3)
    write_jsonl(tmp_path / "a.jsonl", [{"messages": m} for m in chats[:8]])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in chats[8:16])
    pq.write_table(pa.table({"messages": chats[16:]}), tmp_path / "c.parquet")
    cfg = load_config(chat_recipe(tmp_path, [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.parquet"],
                                  folder, seq_len=256), [])
    check_sources(cfg)
    tokenizer = HFTokenizer(os.path.join(folder, "tokenizer.json"))
    rows = stage_rows(cfg, open_stores(cfg, tokenizer, log=lambda _: None))
    references = [reference(folder, m) for m in chats]
    expected = {tuple(ids): mask for ids, mask in references}
    file_of = {tuple(ids): i // 8 for i, (ids, _) in enumerate(references)}
    seen = set()
    for index in range(rows.num_rows):
        fields = rows.row_fields(index)
        second = fields["document_ids"] == 1  # document masking: positions restart per conversation
        assert (fields["position_ids"][second] == np.arange(second.sum())).all()
        for ids, predicted in whole_conversations(fields, tokenizer.eos_id):
            assert tuple(ids) in expected
            assert [bool(x) for x in expected[tuple(ids)]] == predicted
            seen.add(tuple(ids))
    # every conversation, whole, from each of the three files
    assert len(seen) == len(expected) and {file_of[ids] for ids in seen} == {0, 1, 2}
    assert rows.dropped == 0 and rows.truncated == 0


def test_long_conversations_dropped_or_cut_at_a_turn(folders, tmp_path):
    folder = folders[("llama3", True)]
    long_chat = [{"role": "user", "content": "short question"}, {"role": "assistant", "content": "short answer"},
                 {"role": "user", "content": " ".join(["river"] * 200)}, {"role": "assistant", "content": "done"}]
    short = [m for m in conversations(12, seed=5) if len(reference(folder, m)[0]) <= 96]
    write_jsonl(tmp_path / "a.jsonl", [{"messages": long_chat}] + [{"messages": m} for m in short])
    tokenizer = HFTokenizer(os.path.join(folder, "tokenizer.json"))
    for truncate, dropped, cut in (("drop", 1, 0), ("turns", 0, 1)):
        cfg = load_config(chat_recipe(tmp_path, [tmp_path / "a.jsonl"], folder, seq_len=96,
                                      extra=f"truncate = \"{truncate}\"\n"), [])
        rows = stage_rows(cfg, open_stores(cfg, tokenizer, log=lambda _: None))
        assert (rows.dropped, rows.truncated) == (dropped, cut)
        assert f"{dropped:,} longer than seq_len dropped, {cut:,} cut" in rows.describe("chat")
    full, _ = reference(folder, long_chat)
    kept, kept_mask = reference(folder, long_chat[:2])
    doc = int(np.flatnonzero(rows.lengths == len(kept))[0])  # the cut conversation: its first two turns exactly
    assert list(rows.store.document(doc)[:len(kept)]) == kept and len(full) > 96


@pytest.mark.parametrize("case, needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "unknown role 'robot'"),
    ({"messages": "hi there"}, "must be a list"),
])
def test_bad_conversations_are_one_line_errors(folders, tmp_path, case, needle):
    write_jsonl(tmp_path / "a.jsonl", [{"messages": conversations(1)[0]}, case])
    folder = folders[("chatml", True)]
    cfg = load_config(chat_recipe(tmp_path, [tmp_path / "a.jsonl"], folder), [])
    with pytest.raises(RecipeError) as err:
        open_stores(cfg, HFTokenizer(os.path.join(folder, "tokenizer.json")), log=lambda _: None)
    assert needle in str(err.value) and "a.jsonl" in str(err.value) and "\n" not in str(err.value)


def test_chat_source_without_template_is_one_line_error(tmp_path):
    folder = write_chat_tokenizer(str(tmp_path / "tok"), "chatml", template=False)
    write_jsonl(tmp_path / "a.jsonl", [{"messages": conversations(1)[0]}])
    cfg = load_config(chat_recipe(tmp_path, [tmp_path / "a.jsonl"], folder), [])
    with pytest.raises(RecipeError, match="no chat_template in tokenizer_config.json") as err:
        check_sources(cfg)
    assert "data.sources[0]" in str(err.value) and "\n" not in str(err.value)
