"""data.corpus: pydoc, .txt, .jsonl, folders, and a one-line RecipeError naming the path for each kind of bad input."""
import json

import pytest

from data.corpus import load_documents
from config import RecipeError


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_pydoc_is_the_bundled_topics_in_sorted_order():
    from pydoc_data.topics import topics  # the reference: read directly

    docs = load_documents(["pydoc"])
    assert len(docs) == len(topics) > 0  # counts differ between Python builds: read them from the data
    assert docs == [topics[k] for k in sorted(topics)]
    assert sum(map(len, docs)) == sum(map(len, topics.values()))


def test_txt_file_is_one_document_verbatim(tmp_path):
    text = "first line\n\n  indented ünïcode 🙂\n"
    assert load_documents([_write(tmp_path / "a.txt", text)]) == [text]


def test_jsonl_one_document_per_line_blank_lines_skipped(tmp_path):
    lines = [json.dumps({"text": "alpha", "id": 1}), "", json.dumps({"text": "beta\nwith newline"}), "  "]
    path = _write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    assert load_documents([path]) == ["alpha", "beta\nwith newline"]


def test_folder_is_recursive_sorted_and_ignores_other_files(tmp_path):
    _write(tmp_path / "b.txt", "B")
    _write(tmp_path / "a" / "z.jsonl", json.dumps({"text": "AZ1"}) + "\n" + json.dumps({"text": "AZ2"}) + "\n")
    _write(tmp_path / "a" / "b" / "c.txt", "ABC")
    _write(tmp_path / "notes.md", "ignored")
    # sorted full paths: a/b/c.txt < a/z.jsonl < b.txt
    assert load_documents([str(tmp_path)]) == ["ABC", "AZ1", "AZ2", "B"]


def test_entries_concatenate_in_order(tmp_path):
    first = _write(tmp_path / "x.txt", "X")
    docs = load_documents([first, "pydoc", first])
    assert docs[0] == "X" and docs[-1] == "X" and len(docs) == 81


def _assert_one_line_error(paths, *needles):
    with pytest.raises(RecipeError) as info:
        load_documents(paths)
    message = str(info.value)
    assert "\n" not in message
    assert "data.corpus" in message
    for needle in needles:
        assert needle in message
    return message


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope.txt")
    _assert_one_line_error([missing], missing, "does not exist")


def test_empty_folder(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    _assert_one_line_error([str(folder)], str(folder), "contains no .txt/.jsonl")


def test_folder_without_document_files(tmp_path):
    _write(tmp_path / "only.md", "x")
    _assert_one_line_error([str(tmp_path)], str(tmp_path))


def test_jsonl_line_without_text(tmp_path):
    path = _write(tmp_path / "bad.jsonl", json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    _assert_one_line_error([path], path, "line 2", '"text"')


def test_jsonl_invalid_json(tmp_path):
    path = _write(tmp_path / "bad.jsonl", "{not json}\n")
    _assert_one_line_error([path], path, "line 1", "not valid JSON")


def test_jsonl_text_not_a_string(tmp_path):
    path = _write(tmp_path / "bad.jsonl", json.dumps({"text": 3}) + "\n")
    _assert_one_line_error([path], path, "must be a string")


def test_unsupported_extension(tmp_path):
    path = _write(tmp_path / "data.csv", "a,b\n")
    _assert_one_line_error([path], path, "unsupported extension")


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    _assert_one_line_error([str(path)], str(path), "UTF-8")


def test_empty_list_and_no_documents(tmp_path):
    _assert_one_line_error([])
    path = _write(tmp_path / "blank.jsonl", "\n\n")
    _assert_one_line_error([path], "no documents")
