"""Prepare once: a source's documents tokenized by worker processes into a store (data/token_store.py).

Resumable and atomic. Work happens in `<store>.partial/`; each `SourcePart` becomes one shard whose completion record
is written last, so after Ctrl-C or a SIGKILL a rerun keeps every finished shard and redoes only the rest. When all
shards are done the manifest is written and the folder renamed to its final name in one step: a reader sees a whole
store or none. Shards depend only on their part, so the result is byte-identical however it was interrupted.

Keys. The store's folder name hashes what defines its content (the source entries, text_field and the tokenizer);
the manifest also records every source file's size and mtime. A store whose files changed since it was made is
refused with a one-line error that says to prepare again, rather than silently training on stale tokens.

Concurrency. `ensure_store` is what the trainer calls on every rank: the first process to take the store's file lock
prepares it, the others wait (with a message) and then open the published store, so no two processes tokenize the
same data. On a shared file system one rank in the whole job prepares; on node-local disks one per node.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import signal
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

from data.corpus import PART_BYTES, PYDOC, read_part, source_files, source_parts
from data.token_store import (FORMAT, MANIFEST, TokenStore, finished_shard, token_dtype, write_manifest,
                              write_shard)
from config import RecipeError

ENCODE_BATCH = 64  # documents per encode_batch call: large enough for the Rust tokenizer's threads, small in memory


@dataclass(frozen=True)
class StoreSpec:
    """One source to prepare: what it reads and how it is tokenized."""
    name: str
    entries: tuple[str, ...]
    text_field: str
    cache_dir: str
    key: str = "data.corpus"
    part_bytes: int = PART_BYTES
    """Source bytes per shard: the unit of parallel work and of resumption."""
    format: str = "text"
    """text | chat (conversations in `text_field`, rendered with the tokenizer's chat template, data/chat.py)."""
    chat_template: str = ""
    """chat: the template source, part of the store's key (the same tokenizer.json with another template differs)."""

    def folder(self, tokenizer) -> str:
        key = [FORMAT, list(self.entries), self.text_field, tokenizer.fingerprint, self.part_bytes]
        if self.format == "chat":
            key += ["chat", hashlib.sha256(self.chat_template.encode()).hexdigest()]
        ident = json.dumps(key)
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        return os.path.join(self.cache_dir, "stores", f"{_safe(self.name)}-{digest}")


def files_fingerprint(spec: StoreSpec) -> list[list]:
    """[path, size, mtime_ns] of every source file (pydoc: the Python version that ships it); reads no file."""
    rows = []
    for path in source_files(list(spec.entries), spec.key):
        if path == PYDOC:
            rows.append([PYDOC, sys.version.split()[0], 0])
        else:
            stat = os.stat(path)
            rows.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])
    return rows


def open_store(spec: StoreSpec, tokenizer) -> TokenStore | None:
    """The published store of `spec`, None when there is none; a stale one (sources changed) is a RecipeError."""
    folder = spec.folder(tokenizer)
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        return None
    store = TokenStore(folder)
    if store.manifest["files"] != files_fingerprint(spec):
        raise RecipeError(f"{spec.key}: the files of source '{spec.name}' changed since its store '{folder}' was "
                          f"prepared; run ./run_train.sh RECIPE --prepare-data again.")
    return store


def ensure_store(spec: StoreSpec, tokenizer, workers: int, log=print) -> TokenStore:
    """Opens the store, preparing it first under a file lock if no process has yet (see module docstring)."""
    store = open_store(spec, tokenizer)
    if store is not None:
        return store
    folder = spec.folder(tokenizer)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(f"{folder}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: waiting for another process to prepare source '{spec.name}' ({folder}) ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        store = open_store(spec, tokenizer)
        if store is None:
            prepare_store(spec, tokenizer, workers, log=log)
            store = open_store(spec, tokenizer)
    return store


def prepare_store(spec: StoreSpec, tokenizer, workers: int, *, log=print, progress: bool = True) -> str:
    """Tokenizes `spec`'s sources into its store (resuming a partial one) and publishes it; returns the folder."""
    folder = spec.folder(tokenizer)
    files = files_fingerprint(spec)
    parts = source_parts(list(spec.entries), spec.text_field, spec.key, spec.part_bytes, spec.format)
    partial = f"{folder}.partial"
    _start_or_resume(partial, files, len(parts))
    todo = [i for i in range(len(parts)) if finished_shard(partial, i) is None]
    kept = len(parts) - len(todo)
    log(f"data: preparing source '{spec.name}': {len(parts)} parts ({kept} already done), "
        f"{max(1, min(workers, len(todo) or 1))} worker(s) -> {folder}")
    dtype = token_dtype(tokenizer.vocab_size)
    started = time.perf_counter()
    tokens = _run_parts(parts, todo, partial, tokenizer, dtype, workers, progress, spec)
    shards = [finished_shard(partial, i) for i in range(len(parts))]
    manifest = {"format": FORMAT, "name": spec.name, "entries": list(spec.entries), "text_field": spec.text_field,
                "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
                "eos_id": tokenizer.eos_id, "bos_added": bool(getattr(tokenizer, "add_bos", False)), "files": files,
                "shards": shards, "tokens": sum(s["tokens"] for s in shards),
                "documents": sum(s["documents"] for s in shards),
                "source_format": spec.format, "label_mask": spec.format == "chat"}
    write_manifest(partial, manifest)
    _publish(partial, folder)
    seconds = time.perf_counter() - started
    log(f"data: source '{spec.name}' ready: {manifest['tokens']:,} tokens in {manifest['documents']:,} documents "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s this run)")
    return folder


def _start_or_resume(partial: str, files: list, num_parts: int) -> None:
    plan_path = os.path.join(partial, "plan.json")
    plan = {"files": files, "parts": num_parts}
    if os.path.isdir(partial):
        try:
            with open(plan_path) as f:
                if json.load(f) == plan:
                    for name in os.listdir(partial):  # leftovers of writes a kill interrupted
                        if name.endswith(".tmp"):
                            os.remove(os.path.join(partial, name))
                    return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        shutil.rmtree(partial)  # made from other files: nothing in it can be kept
    os.makedirs(partial)
    with open(plan_path, "w") as f:
        json.dump(plan, f)


def _run_parts(parts, todo, partial, tokenizer, dtype, workers, progress, spec) -> int:
    from tqdm import tqdm

    name = spec.name
    bar = tqdm(total=len(parts), initial=len(parts) - len(todo), unit="part", desc=f"prepare {name}",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    done_tokens, started = 0, time.perf_counter()
    jobs = [(parts[i], i, partial, dtype.str) for i in todo]
    workers = max(1, min(workers, len(jobs) or 1))
    try:
        if workers == 1:
            _init_worker(_tokenizer_recipe(tokenizer), spec.format == "chat")
            results = map(_prepare_part, jobs)
            pool = None
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_pool_worker,
                                                                 (_tokenizer_recipe(tokenizer), spec.format == "chat"))
            results = pool.imap_unordered(_prepare_part, jobs)
        for record in results:
            done_tokens += record["tokens"]
            bar.update(1)
            bar.set_postfix_str(f"{done_tokens / max(time.perf_counter() - started, 1e-9):,.0f} tok/s", refresh=False)
        if pool is not None:
            pool.close()
            pool.join()
    except BaseException:
        if pool is not None:
            pool.terminate()  # Ctrl-C or an error: finished shards stay, unfinished ones are redone next time
        raise
    finally:
        bar.close()
    return done_tokens


_WORKER_TOKENIZER = {}  # one tokenizer per worker process, built by the pool initializer (process-local by nature)


def _tokenizer_recipe(tokenizer) -> tuple:
    if hasattr(tokenizer, "model_proto"):
        return ("spm", tokenizer.model_proto)
    return ("hf", tokenizer.source)


def _init_pool_worker(recipe: tuple, chat: bool = False) -> None:
    """A pool worker ignores Ctrl-C: the parent alone takes the KeyboardInterrupt and terminates the pool. A worker
    interrupted while it holds the pool's task-queue lock would never release it, and the parent's terminate() would
    then wait on that lock forever (seen once in CI: a Ctrl-C'd preparation that never exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(recipe, chat)


def _init_worker(recipe: tuple, chat: bool = False) -> None:
    # One core per worker: data.prepare_workers is the one knob for parallelism (the Rust tokenizer reads this
    # before its thread pool starts, which is later, in this fresh process).
    os.environ["RAYON_NUM_THREADS"] = "1"
    kind, value = recipe
    if kind == "spm":
        from data.tokenizer import Tokenizer
        _WORKER_TOKENIZER["tokenizer"] = Tokenizer(value)
    else:
        from data.hf_tokenizer import HFTokenizer
        _WORKER_TOKENIZER["tokenizer"] = HFTokenizer(value)
    if chat:
        from data.chat import build_renderer
        _WORKER_TOKENIZER["chat"] = build_renderer(_WORKER_TOKENIZER["tokenizer"], "data.sources")


def _prepare_part(job) -> dict:
    part, index, partial, dtype = job
    if part.format == "chat":
        return _prepare_chat_part(part, index, partial, dtype)
    tokenizer = _WORKER_TOKENIZER["tokenizer"]
    prefix = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
    documents, batch = [], []

    def encode_pending():
        for ids in tokenizer.encode_batch(batch, threads=1):
            if ids:
                documents.append(np.asarray(prefix + ids, dtype=dtype))
        batch.clear()

    for text in read_part(part):
        batch.append(text)
        if len(batch) >= ENCODE_BATCH:
            encode_pending()
    encode_pending()
    return write_shard(partial, index, documents, np.dtype(dtype))


def _prepare_chat_part(part, index, partial, dtype) -> dict:
    """Each conversation rendered with the chat template: its ids and its mask (labels on assistant turns)."""
    from data.chat import check_messages

    renderer = _WORKER_TOKENIZER["chat"]
    documents, masks = [], []
    where = f"{part.key}: '{part.paths[0]}'"
    for number, value in enumerate(read_part(part), start=1):
        messages = check_messages(value, part.text_field, f"{where} conversation {number} of this part")
        ids, mask = renderer.encode(messages, where)
        documents.append(np.asarray(ids, dtype=dtype))
        masks.append(mask)
    return write_shard(partial, index, documents, np.dtype(dtype), masks)


def _publish(partial: str, folder: str) -> None:
    try:
        os.rename(partial, folder)
    except OSError:
        if not os.path.exists(os.path.join(folder, MANIFEST)):
            raise
        shutil.rmtree(partial)  # someone published the same store first; theirs is byte-identical


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "source"
