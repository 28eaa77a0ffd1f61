"""Documents for training: source entries turned into files, and files into document strings, read lazily.

An entry is "pydoc" (the English documentation every CPython ships, `pydoc_data.topics.topics`, 79 documents, ~465k
characters, so a fresh checkout trains without downloading anything), a file, a folder, or a glob pattern. Formats:
`.txt` (one document), `.jsonl` and `.jsonl.gz` (one JSON object per line, the document in `text_field`), `.parquet`
(the string column `text_field`, read one row group at a time with pyarrow). A folder contributes every such file below
it and a glob every such match, in sorted path order, so every rank and every rerun sees the same documents in the same
order. Anything else is a user error reported as a one-line `RecipeError` naming the key, the path and the fix.

`load_documents` returns whole lists (the tokenizer trainer and small corpora); the store builder (data/prepare.py)
reads `source_parts` one at a time in worker processes, so no process ever holds a large corpus.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass, replace as _replace

from config import RecipeError

PYDOC = "pydoc"
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
GLOB_CHARACTERS = "*?["
PART_BYTES = 16 << 20  # .jsonl files, .parquet row groups and runs of .txt files are cut into parts of about this size


@dataclass(frozen=True)
class SourcePart:
    """A unit of preparation work: a byte range of one .jsonl, one .jsonl.gz, some row groups of one .parquet, a run
    of .txt files, or the pydoc documents. Parts are listed in a fixed order, so a store's shards are too."""
    kind: str  # "pydoc" | "jsonl" | "jsonl.gz" | "parquet" | "txt"
    paths: tuple[str, ...]
    start: int = 0  # jsonl: first byte; parquet: first row group
    stop: int = -1  # jsonl: end byte; parquet: end row group; -1 = to the end
    text_field: str = "text"
    key: str = "data.corpus"
    format: str = "text"
    """text: `text_field` holds a string; chat: it holds a conversation (checked by data/chat.py)."""


def load_documents(paths, text_field: str = "text", key: str = "data.corpus") -> list[str]:
    """All documents of all entries, in entry order."""
    if isinstance(paths, str):  # a bare string would otherwise be read one character at a time
        paths = [paths]
    if not paths:
        raise RecipeError(f"{key} is empty; list at least one entry, e.g. [\"{PYDOC}\"] or a .txt/.jsonl path.")
    documents = [doc for part in source_parts(paths, text_field, key) for doc in read_part(part)]
    if not documents:
        raise RecipeError(f"{key} = {list(paths)} holds no documents; add non-empty files or use \"{PYDOC}\".")
    return documents


def pydoc_documents() -> list[str]:
    """Python's bundled topic help pages, sorted by topic name for a stable order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def source_files(paths, key: str = "data.corpus") -> list[str]:
    """The files (and "pydoc") behind the entries, in order; checks that each entry exists without reading it."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for entry in map(str, paths):
        if entry == PYDOC:
            files.append(PYDOC)
        elif any(c in entry for c in GLOB_CHARACTERS):
            matches = sorted(m for m in glob.glob(entry, recursive=True) if _is_document_file(m))
            if not matches:
                raise RecipeError(f"{key}: pattern '{entry}' matches no {'/'.join(DOCUMENT_SUFFIXES)} files; "
                                  f"fix the pattern.")
            files.extend(matches)
        elif not os.path.exists(entry):
            raise RecipeError(f"{key}: '{entry}' does not exist; fix the path or use \"{PYDOC}\" "
                              f"(the documentation bundled with Python).")
        elif os.path.isdir(entry):
            found = _document_files_under(entry)
            if not found:
                raise RecipeError(f"{key}: folder '{entry}' contains no {'/'.join(DOCUMENT_SUFFIXES)} files; "
                                  f"add some or point {key} elsewhere.")
            files.extend(found)
        elif _is_document_file(entry):
            files.append(entry)
        else:
            raise RecipeError(f"{key}: '{entry}' has an unsupported extension; use .txt (one document), .jsonl or "
                              f".jsonl.gz (one {{\"text\": ...}} per line), .parquet (a text column) or a folder.")
    return files


def source_parts(paths, text_field: str = "text", key: str = "data.corpus",
                 part_bytes: int = PART_BYTES, format: str = "text") -> list[SourcePart]:
    """The entries' files cut into preparation parts, in a fixed order."""
    if format == "chat":
        parts = source_parts(paths, text_field, key, part_bytes)
        for part in parts:
            if part.kind in ("pydoc", "txt"):
                raise RecipeError(f"{key}: a chat source reads .jsonl, .jsonl.gz or .parquet conversations, not "
                                  f"'{part.paths[0]}'; point its path at conversation files.")
        return [_replace(part, format=format) for part in parts]
    parts: list[SourcePart] = []
    txt_run: list[str] = []
    txt_bytes = 0

    def flush_txt():
        nonlocal txt_run, txt_bytes
        if txt_run:
            parts.append(SourcePart("txt", tuple(txt_run), text_field=text_field, key=key))
        txt_run, txt_bytes = [], 0

    for path in source_files(paths, key):
        if path.endswith(".txt"):
            txt_run.append(path)
            txt_bytes += os.path.getsize(path)
            if txt_bytes >= part_bytes:
                flush_txt()
            continue
        flush_txt()
        if path == PYDOC:
            parts.append(SourcePart("pydoc", (PYDOC,), text_field=text_field, key=key))
        elif path.endswith(".jsonl"):
            parts.extend(_jsonl_parts(path, text_field, key, part_bytes))
        elif path.endswith(".jsonl.gz"):
            parts.append(SourcePart("jsonl.gz", (path,), text_field=text_field, key=key))
        else:
            parts.extend(_parquet_parts(path, text_field, key, part_bytes))
    flush_txt()
    return parts


def read_part(part: SourcePart):
    """Yields the documents of one part, in order."""
    if part.kind == "pydoc":
        yield from pydoc_documents()
    elif part.kind == "txt":
        for path in part.paths:
            yield _read_text(path, part.key)
    elif part.kind == "jsonl":
        with open(part.paths[0], "rb") as f:
            f.seek(part.start)
            # A part that starts the file counts lines; a later part names byte offsets (it never read the lines before)
            line_number = 1 if part.start == 0 else None
            offset = part.start
            while offset < part.stop:
                raw = f.readline()
                if not raw:
                    break
                text = _decode(raw, part.paths[0], part.key)
                if text.strip():
                    yield _jsonl_text(part, f"byte {offset}" if line_number is None else f"line {line_number}", text)
                offset += len(raw)
                line_number = None if line_number is None else line_number + 1
    elif part.kind == "jsonl.gz":
        with gzip.open(part.paths[0], "rb") as f:
            for line_number, raw in enumerate(f, start=1):
                text = _decode(raw, part.paths[0], part.key)
                if text.strip():
                    yield _jsonl_text(part, f"line {line_number}", text)
    else:
        yield from _read_parquet(part)


def _is_document_file(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(DOCUMENT_SUFFIXES)


def _document_files_under(folder: str) -> list[str]:
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found.extend(os.path.join(root, name) for name in names if name.endswith(DOCUMENT_SUFFIXES))
    return sorted(found)


def _jsonl_parts(path: str, text_field: str, key: str, part_bytes: int) -> list[SourcePart]:
    """Byte ranges of about `part_bytes`, each ending just after a newline, so every line lies in exactly one."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + part_bytes < size:
            f.seek(bounds[-1] + part_bytes)
            f.readline()
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [SourcePart("jsonl", (path,), start, stop, text_field, key) for start, stop in zip(bounds, bounds[1:])]


def _parquet_parts(path: str, text_field: str, key: str, part_bytes: int) -> list[SourcePart]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises several types for a file that is not parquet
        raise RecipeError(f"{key}: '{path}' is not a readable parquet file ({err}); fix or remove it.") from None
    names = list(meta.schema.to_arrow_schema().names)  # top-level columns (a chat column is a list of structs)
    if text_field not in names:
        raise RecipeError(f"{key}: parquet file '{path}' has no column '{text_field}' (columns: {', '.join(names)}); "
                          f"set the source's text_field (messages_field for chat) to the column that holds it.")
    parts, start, run_bytes = [], 0, 0
    for group in range(meta.num_row_groups):
        run_bytes += meta.row_group(group).total_byte_size
        if run_bytes >= part_bytes:
            parts.append(SourcePart("parquet", (path,), start, group + 1, text_field, key))
            start, run_bytes = group + 1, 0
    if start < meta.num_row_groups or not parts:
        parts.append(SourcePart("parquet", (path,), start, meta.num_row_groups, text_field, key))
    return parts


def _read_parquet(part: SourcePart):
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(part.paths[0])
    for group in range(part.start, part.stop):
        column = reader.read_row_group(group, columns=[part.text_field]).column(0)
        for value in column.to_pylist():
            if value is None:
                continue
            if part.format == "chat":
                yield value
                continue
            if not isinstance(value, str):
                raise RecipeError(f"{part.key}: parquet file '{part.paths[0]}' column '{part.text_field}' holds "
                                  f"{type(value).__name__} values, not text; set text_field to a string column.")
            yield value


def _read_text(path: str, key: str) -> str:
    with open(path, "rb") as f:
        return _decode(f.read(), path, key)


def _decode(raw: bytes, path: str, key: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError(f"{key}: '{path}' is not valid UTF-8 ({err.reason} at byte {err.start}); "
                          f"re-encode it as UTF-8.") from None


def _jsonl_text(part: SourcePart, where: str, line: str) -> str:
    where = f"{part.key}: '{part.paths[0]}' {where}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecipeError(f"{where} is not valid JSON ({err.msg}); write one JSON object per line.") from None
    field = part.text_field
    if not isinstance(record, dict) or field not in record:
        raise RecipeError(f"{where} has no \"{field}\" field; every line must be an object like "
                          f"{{\"{field}\": \"...\"}}, or set the source's text_field.")
    if part.format == "chat":
        return record[field]
    if not isinstance(record[field], str):
        raise RecipeError(f"{where}: \"{field}\" must be a string, got {type(record[field]).__name__}.")
    return record[field]
