"""Documents for training: the recipe's `data.corpus` list turned into a list of strings.

The default entry "pydoc" is the English documentation every CPython ships (`pydoc_data.topics.topics`, 79 documents,
~465k characters), so a fresh checkout trains without downloading anything. Other entries are local files: a `.txt`
file is one document, a `.jsonl` file holds one document per line in its "text" field, and a folder contributes every
`.txt`/`.jsonl` file below it in sorted path order (so every rank and every rerun sees the same documents in the same
order). Anything else is a user error reported as a one-line `RecipeError`.
"""
from __future__ import annotations

import json
import os

from config import RecipeError

PYDOC = "pydoc"
DOCUMENT_SUFFIXES = (".txt", ".jsonl")
_KEY = "data.corpus"


def load_documents(paths: list[str]) -> list[str]:
    """All documents of all entries, in entry order; entries are "pydoc", .txt/.jsonl files or folders of them."""
    if isinstance(paths, str):  # a bare string would otherwise be read one character at a time
        paths = [paths]
    if not paths:
        raise RecipeError(f"{_KEY} is empty; list at least one entry, e.g. [\"{PYDOC}\"] or a .txt/.jsonl path.")
    documents: list[str] = []
    for entry in paths:
        documents.extend(_load_entry(str(entry)))
    if not documents:
        raise RecipeError(f"{_KEY} = {list(paths)} holds no documents; add non-empty .txt/.jsonl files "
                          f"or use \"{PYDOC}\".")
    return documents


def check_corpus_paths(paths: list[str]) -> None:
    """The path errors `load_documents` would raise (empty list, missing path, empty folder, wrong extension),
    found without reading any document: the launch check runs per ramp stage, and reading stays with the trainer."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise RecipeError(f"{_KEY} is empty; list at least one entry, e.g. [\"{PYDOC}\"] or a .txt/.jsonl path.")
    for entry in map(str, paths):
        if entry != PYDOC:
            for path in _entry_files(entry):
                _check_suffix(path)


def pydoc_documents() -> list[str]:
    """Python's bundled topic help pages, sorted by topic name for a stable order."""
    from pydoc_data.topics import topics  # lazy: ~0.5 MB of text that only the "pydoc" entry needs

    return [topics[name] for name in sorted(topics)]


def _load_entry(entry: str) -> list[str]:
    if entry == PYDOC:
        return pydoc_documents()
    return [doc for path in _entry_files(entry) for doc in _load_file(path)]


def _entry_files(entry: str) -> list[str]:
    """The document files of one local entry: the file itself, or every .txt/.jsonl file below a folder."""
    if not os.path.exists(entry):
        raise RecipeError(f"{_KEY}: '{entry}' does not exist; fix the path or use \"{PYDOC}\" "
                          f"(the documentation bundled with Python).")
    if not os.path.isdir(entry):
        return [entry]
    files = _document_files_under(entry)
    if not files:
        raise RecipeError(f"{_KEY}: folder '{entry}' contains no .txt or .jsonl files; add some "
                          f"or point {_KEY} elsewhere.")
    return files


def _document_files_under(folder: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found.extend(os.path.join(root, name) for name in names if name.endswith(DOCUMENT_SUFFIXES))
    return sorted(found)


def _load_file(path: str) -> list[str]:
    _check_suffix(path)
    return [_read_text(path)] if path.endswith(".txt") else _read_jsonl(path)


def _check_suffix(path: str) -> None:
    if not path.endswith(DOCUMENT_SUFFIXES):
        raise RecipeError(f"{_KEY}: '{path}' has an unsupported extension; use a .txt file (one document), "
                          f"a .jsonl file (one {{\"text\": ...}} per line) or a folder of them.")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise RecipeError(f"{_KEY}: '{path}' is not valid UTF-8 ({err.reason} at byte {err.start}); "
                          f"re-encode it as UTF-8.") from None


def _read_jsonl(path: str) -> list[str]:
    documents = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():  # blank lines (e.g. a trailing newline) are not documents
                    continue
                documents.append(_jsonl_text(path, line_number, line))
    except UnicodeDecodeError as err:
        raise RecipeError(f"{_KEY}: '{path}' is not valid UTF-8 ({err.reason} at byte {err.start}); "
                          f"re-encode it as UTF-8.") from None
    return documents


def _jsonl_text(path: str, line_number: int, line: str) -> str:
    where = f"{_KEY}: '{path}' line {line_number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecipeError(f"{where} is not valid JSON ({err.msg}); write one JSON object per line.") from None
    if not isinstance(record, dict) or "text" not in record:
        raise RecipeError(f"{where} has no \"text\" field; every line must be an object like {{\"text\": \"...\"}}.")
    if not isinstance(record["text"], str):
        raise RecipeError(f"{where}: \"text\" must be a string, got {type(record['text']).__name__}.")
    return record["text"]
