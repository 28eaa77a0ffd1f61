"""The recipe's data sources, from config to rows: `[[data.sources]]` (or `data.corpus` as one source) -> a prepared
store per source -> packed rows per source -> one row stream for a ramp stage (a weighted mixture when there are
several sources, with the stage's own weights when it sets them).

What each piece does lives in its own module: reading files (corpus.py), preparing stores (prepare.py), the store
format (token_store.py), packing from a store (store_rows.py), mixing (mixture.py). This module only follows the
recipe, so the trainer, `--prepare-data` and the preflight check all read the recipe the same way.
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from data.corpus import PART_BYTES, read_part, source_files, source_parts
from data.mixture import BlockPlan, MixtureRows, check_weights
from data.prepare import StoreSpec, ensure_store, open_store, prepare_store
from data.store_rows import StoreRows
from config.schema import ChatTruncation, SourceConfig, SourceFormat, choices
from data.chat import load_chat_template
from data.chat_packing import DEFAULT_PACK_WINDOW
from config import RecipeError

TOKENIZER_SAMPLE_BYTES = 32 << 20  # a tokenizer we train ourselves learns from the first 32 MiB of text


def source_list(cfg) -> list[SourceConfig]:
    """`data.sources`, or `data.corpus` as a single source named "corpus"."""
    if cfg.data.sources:
        return list(cfg.data.sources)
    return [SourceConfig(name="corpus", path=list(cfg.data.corpus))]


def check_sources(cfg) -> None:
    """Names, weights and paths of every source and the tokenizer's path, without reading any file."""
    where = cfg.recipe_path
    sources = source_list(cfg)
    names = [s.name for s in sources]
    for i, source in enumerate(sources):
        key = f"data.sources[{i}]" if cfg.data.sources else "data.corpus"
        if not source.name:
            raise RecipeError(f"{where}: {key} needs a name (name = \"books\"); metrics report tokens per name.")
        if names.count(source.name) > 1:
            raise RecipeError(f"{where}: {key}: the name '{source.name}' is used twice; give each source its own.")
        if not source.path:
            raise RecipeError(f"{where}: {key}.path is empty; give a file, folder, glob or \"pydoc\".")
        for field in ("min_doc_tokens", "long_doc_tokens"):
            if getattr(source, field) < 0:
                raise RecipeError(f"{where}: {key}.{field} must be >= 0, got {getattr(source, field)}.")
        if source.long_doc_upsample < 1:
            raise RecipeError(f"{where}: {key}.long_doc_upsample must be >= 1 (how many times as often long "
                              f"documents are seen), got {source.long_doc_upsample}.")
        source_files(source.path, f"{where}: {key}.path")
        check_chat_source(cfg, source, f"{where}: {key}")
    check_weights(names, [s.weight for s in sources], f"{where}: data.sources")
    if cfg.data.tokenizer_path and not os.path.exists(cfg.data.tokenizer_path):
        raise RecipeError(f"{where}: data.tokenizer_path '{cfg.data.tokenizer_path}' does not exist. Point it at a "
                          f"SentencePiece .model, a tokenizer.json or a Hugging Face model folder, or leave it empty "
                          f"to train one.")


def check_chat_source(cfg, source: SourceConfig, key: str) -> None:
    """A chat source's format keys and its tokenizer's chat template (one small JSON read)."""
    if source.format not in choices(SourceFormat):
        raise RecipeError(f"{key}.format = {source.format!r} is not one of {', '.join(choices(SourceFormat))}.")
    if source.truncate not in choices(ChatTruncation):
        raise RecipeError(f"{key}.truncate = {source.truncate!r} is not one of {', '.join(choices(ChatTruncation))}.")
    if source.format == "chat":
        if source.pack_window < 1:
            raise RecipeError(f"{key}.pack_window must be >= 1 (conversations packed together into rows), got "
                              f"{source.pack_window}; leave it out for the default {DEFAULT_PACK_WINDOW:,}.")
        if not source.messages_field:
            raise RecipeError(f"{key}.messages_field is empty; name the field that holds the messages list.")
        load_chat_template(cfg.data.tokenizer_path, key)


def chat_template_of(cfg, source: SourceConfig) -> str:
    return load_chat_template(cfg.data.tokenizer_path, source.name)[0] if source.format == "chat" else ""


def tokenizer_training_documents(cfg) -> list[str]:
    """The text a tokenizer we train ourselves learns from: every source's documents in order, up to a budget."""
    documents, size = [], 0
    for source in source_list(cfg):
        if source.format == "chat":  # chat sources need a Hugging Face tokenizer with a template: none is trained
            continue
        for part in source_parts(source.path, source.text_field, f"data.sources '{source.name}'", PART_BYTES):
            for text in read_part(part):
                documents.append(text)
                size += len(text)
                if size >= TOKENIZER_SAMPLE_BYTES:
                    return documents
    return documents


def build_run_tokenizer(cfg, vocab_size: int):
    """The recipe's tokenizer: data.tokenizer_path loaded, or a SentencePiece model trained (and cached) on a sample."""
    from data.tokenizer import build_tokenizer

    path = cfg.data.tokenizer_path or None
    return build_tokenizer(path, [] if path else tokenizer_training_documents(cfg), vocab_size, cfg.data.cache_dir)


def store_specs(cfg) -> list[StoreSpec]:
    return [StoreSpec(s.name, tuple(s.path), s.messages_field if s.format == "chat" else s.text_field,
                      cfg.data.cache_dir, f"data.sources '{s.name}'", format=s.format,
                      chat_template=chat_template_of(cfg, s)) for s in source_list(cfg)]


def prepare_workers(cfg) -> int:
    return cfg.data.prepare_workers if cfg.data.prepare_workers > 0 else (os.cpu_count() or 1)


def open_stores(cfg, tokenizer, log=print) -> dict:
    """{source name: TokenStore}, preparing any store that is missing (one process per store, the others wait)."""
    return {spec.name: ensure_store(spec, tokenizer, prepare_workers(cfg), log=log) for spec in store_specs(cfg)}


def prepare_data(cfg, vocab_size: int, log=print) -> dict:
    """`--prepare-data`: every source's store prepared (a stale one made again, a partial one resumed)."""
    tokenizer = build_run_tokenizer(cfg, vocab_size)
    stores = {}
    for spec in store_specs(cfg):
        try:
            store = open_store(spec, tokenizer)
        except RecipeError:  # made from files that changed since: make it again
            shutil.rmtree(spec.folder(tokenizer))
            store = None
        if store is None:
            prepare_store(spec, tokenizer, prepare_workers(cfg), log=log)
            store = open_store(spec, tokenizer)
        else:
            log(f"data: source '{spec.name}' is already prepared ({store.folder})")
        stores[spec.name] = store
    log(describe_stores(stores))
    return stores


def heldout_fraction(cfg) -> float:
    """Documents held out of training for the long-document evaluation (none when it is off)."""
    return cfg.eval.long_doc_heldout if cfg.eval.long_doc_loss or cfg.eval.niah else 0.0


def stage_rows(cfg, stores: dict):
    """The row stream of one ramp stage (`cfg` is the stage's config, with its weights): a single source's packed
    rows, or the weighted mixture of all of them."""
    t, seed = cfg.training, cfg.job.seed
    sources = source_list(cfg)
    rows = [StoreRows(stores[s.name], seq_len=t.seq_len, seed=seed, document_masking=cfg.data.document_masking,
                      min_doc_tokens=s.min_doc_tokens, long_doc_tokens=s.long_doc_tokens,
                      long_doc_upsample=s.long_doc_upsample, heldout_fraction=heldout_fraction(cfg),
                      key=f"data.sources '{s.name}'", truncate=s.truncate, pack_window=s.pack_window)
            for s in sources]
    if len(rows) == 1:
        return rows[0]
    return MixtureRows([s.name for s in sources], rows, [s.weight for s in sources], seed=seed,
                       where=f"{cfg.recipe_path}: data.sources")


def heldout_rows(cfg, stores: dict) -> list:
    """Per source, rows of its held-out documents at the stage's seq_len (longest documents first)."""
    return [StoreRows.heldout(stores[s.name], seq_len=cfg.training.seq_len, seed=cfg.job.seed,
                              fraction=heldout_fraction(cfg), document_masking=cfg.data.document_masking,
                              pack_window=s.pack_window) for s in source_list(cfg)]


def labels_every_token(cfg) -> bool:
    """Every token of every row carries a label (text sources only), so a step's label count needs no counting."""
    return cfg.data.dataset == "text" and all(s.format == "text" for s in source_list(cfg))


def describe_chat_rows(cfg, rows) -> list[str]:
    """Start-up lines of the chat sources of a stage's row stream (conversations used, dropped, cut; efficiency)."""
    parts = rows.sources if hasattr(rows, "sources") else [rows]
    return [line for s, part in zip(source_list(cfg), parts) if (line := part.describe(s.name))]


def packing_efficiency(cfg, rows) -> dict[str, float]:
    """{chat source name: tokens of conversations / row tokens} of a stage's row stream (empty without chat)."""
    parts = rows.sources if hasattr(rows, "sources") else [rows]
    return {s.name: part.packing_efficiency for s, part in zip(source_list(cfg), parts)
            if getattr(part, "packing_efficiency", None) is not None}


def heldout_haystack(cfg, stores: dict, tokens: int) -> np.ndarray | None:
    """Up to `tokens` token ids of the text sources' held-out documents, in turn (None when there are none)."""
    pieces, total = [], 0
    for s in source_list(cfg):
        if s.format != "text" or s.name not in stores or heldout_fraction(cfg) <= 0:
            continue
        rows = StoreRows.heldout(stores[s.name], seq_len=cfg.training.seq_len, seed=cfg.job.seed,
                                 fraction=heldout_fraction(cfg))
        for doc in rows.order:
            pieces.append(np.asarray(rows.store.document(int(doc)), dtype=np.int64))
            total += len(pieces[-1])
            if total >= tokens:
                return np.concatenate(pieces)
    return np.concatenate(pieces) if pieces else None


def rows_per_source(cfg, start: int, stop: int) -> dict[str, int]:
    """Rows each source supplies in global rows [start, stop) of a stage's stream (no data is read)."""
    sources = source_list(cfg)
    names = [s.name for s in sources]
    if len(names) == 1:
        return {names[0]: stop - start}
    counts = BlockPlan([s.weight for s in sources]).rows_per_source(start, stop)
    return dict(zip(names, map(int, counts)))


def describe_stores(stores: dict) -> str:
    tokens = sum(s.num_tokens for s in stores.values())
    documents = sum(s.num_documents for s in stores.values())
    per = ", ".join(f"{name} {s.num_tokens:,}" for name, s in stores.items())
    return (f"data: {len(stores)} source(s), {tokens:,} tokens in {documents:,} documents "
            f"(memory-mapped stores; tokens per source: {per})")

