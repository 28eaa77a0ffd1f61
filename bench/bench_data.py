"""The token store at corpus scale, measured side by side in one run:

1. a generated English corpus of >= --tokens tokens (pydoc paragraphs drawn at random into documents of log-normal
   length) written in three formats: a .jsonl file, a .parquet file and a folder of .txt files;
2. `--prepare-data`'s work on it with 1 worker and with 2 workers: tokens/s each and the ratio (the two stores are
   checked byte-identical);
3. the trainer on 2 ranks (debug model, 3 steps) reading that store vs a 1M-token store: time from launch to the first
   step and peak RSS per rank (the max over ranks of ru_maxrss, from metrics.jsonl), best of --rounds alternating runs.

    python bench/bench_data.py [--tokens 100000000] [--rounds 2] [--work DIR]

Both trainer runs use the same SentencePiece model (trained on pydoc), so only the store differs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
from data.corpus import load_documents  # noqa: E402
from data.prepare import StoreSpec, prepare_store  # noqa: E402
from data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

CHARS_PER_TOKEN = 3.1  # pydoc text under the debug tokenizer (148,414 tokens for 465k characters)


def generate_documents(target_chars: int, seed: int = 0):
    """Documents of pydoc paragraphs in random order, lengths log-normal around 12K characters (some 200K+)."""
    paragraphs = [p for doc in load_documents(["pydoc"]) for p in doc.split("\n\n") if p.strip()]
    rng = np.random.default_rng(seed)
    written = 0
    while written < target_chars:
        length = int(min(400_000, rng.lognormal(np.log(12_000), 1.0)))
        parts, size = [], 0
        while size < length:
            p = paragraphs[int(rng.integers(len(paragraphs)))]
            parts.append(p)
            size += len(p) + 2
        text = "\n\n".join(parts)
        written += len(text)
        yield text


def write_corpus(folder: str, tokens: int) -> list[str]:
    """A third of the text each as corpus.jsonl, corpus.parquet and txt/*.txt; returns the three entries."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(folder, "txt"), exist_ok=True)
    third = int(tokens * 1.05 * CHARS_PER_TOKEN / 3) + 1  # 5% over: the estimate of characters per token is rough
    docs = generate_documents(3 * third)
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        size = 0
        while size < third:
            text = next(docs)
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text)
    batch, size = [], 0
    with pq.ParquetWriter(os.path.join(folder, "corpus.parquet"), pa.schema([("text", pa.string())])) as writer:
        while size < third:
            batch.append(next(docs))
            size += len(batch[-1])
            if len(batch) == 256:
                writer.write_table(pa.table({"text": batch}))
                batch = []
        if batch:
            writer.write_table(pa.table({"text": batch}))
    for i, text in enumerate(docs):
        with open(os.path.join(folder, "txt", f"{i:06d}.txt"), "w") as f:
            f.write(text)
    return [os.path.join(folder, name) for name in ("corpus.jsonl", "corpus.parquet", "txt")]


def prepare(entries: list[str], cache: str, tokenizer, workers: int) -> tuple[int, float, str]:
    spec = StoreSpec("bench", tuple(entries), "text", cache)
    start = time.perf_counter()
    folder = prepare_store(spec, tokenizer, workers, progress=False, log=lambda *_: None)
    seconds = time.perf_counter() - start
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    return manifest["tokens"], seconds, json.dumps(manifest["shards"])


def trainer_run(recipe: str, out: str) -> tuple[float, float]:
    """(seconds from launch to the first step's line, peak RSS GiB per rank) of a 3-step 2-rank run."""
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2")
    start = time.perf_counter()
    proc = subprocess.Popen([os.path.join(ROOT, "run_train.sh"), recipe, "--job.dump_folder", out],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    first_step = None
    for line in proc.stdout:
        if first_step is None and line.startswith("step ") and "/3" in line:
            first_step = time.perf_counter() - start
    if proc.wait() != 0 or first_step is None:
        raise SystemExit(f"trainer run failed ({recipe})")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        memory = max(json.loads(line)["memory"] for line in f)
    return first_step, memory


def write_recipe(path: str, name: str, entries: list[str], model: str, cache: str) -> str:
    """One source named `name` with `entries`: the store `prepare` made under that name is the one the run opens."""
    paths = ", ".join(f"\"{e}\"" for e in entries)
    sources = f"[[data.sources]]\nname = \"{name}\"\npath = [{paths}]\n"
    with open(path, "w") as f:
        f.write(f"[training]\nsteps = 3\nseq_len = 512\nlocal_batch_size = 4\n[parallelism]\ndp_shard = 2\n"
                f"[metrics]\nenable_tensorboard = false\n[data]\ntokenizer_path = \"{model}\"\ncache_dir = "
                f"\"{cache}\"\n{sources}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=None, help="folder for the corpus and stores (default: a temp folder)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench_data_")
    try:
        tokenizer = build_tokenizer(None, load_documents(["pydoc"]), 2048, os.path.join(work, "spm"))
        model = os.path.join(work, "tok.model")
        with open(model, "wb") as f:
            f.write(tokenizer.model_proto)
        start = time.perf_counter()
        entries = write_corpus(os.path.join(work, "corpus"), args.tokens)
        size = sum(os.path.getsize(os.path.join(r, n)) for e in entries
                   for r, _, names in (os.walk(e) if os.path.isdir(e) else [(os.path.dirname(e), 0,
                                                                             [os.path.basename(e)])]) for n in names)
        print(f"corpus: {size / 2**20:,.0f} MiB in jsonl + parquet + {len(os.listdir(entries[2])):,} txt files, "
              f"generated in {time.perf_counter() - start:.0f} s", flush=True)
        results = {}
        for workers in (1, 2):
            tokens, seconds, shards = prepare(entries, os.path.join(work, f"cache{workers}"), tokenizer, workers)
            results[workers] = (tokens, seconds, shards)
            print(f"prepare, {workers} worker(s): {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} "
                  f"tokens/s", flush=True)
        assert results[1][2] == results[2][2], "1-worker and 2-worker stores differ"
        print(f"prepare speed-up 2 workers / 1: {results[1][1] / results[2][1]:.2f}x (stores byte-identical)")

        small = os.path.join(work, "small.jsonl")
        with open(entries[0]) as src, open(small, "w") as dst:
            chars = 0
            for line in src:
                dst.write(line)
                chars += len(line)
                if chars >= CHARS_PER_TOKEN * 1_000_000:
                    break
        big_recipe = write_recipe(os.path.join(work, "big.toml"), "bench", entries, model, os.path.join(work, "cache2"))
        small_recipe = write_recipe(os.path.join(work, "small.toml"), "small", [small], model,
                                    os.path.join(work, "cache2"))
        for recipe in (small_recipe, big_recipe):  # the big one must find its store ready: nothing is prepared twice
            done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), recipe, "--prepare-data"],
                                  check=True, capture_output=True, text=True, env=child_env())
            assert recipe == small_recipe or "already prepared" in done.stdout, done.stdout + done.stderr
        best = {"big": (1e9, 1e9), "small": (1e9, 1e9)}
        for r in range(args.rounds):
            for name in (("big", "small") if r % 2 == 0 else ("small", "big")):
                recipe = big_recipe if name == "big" else small_recipe
                seconds, memory = trainer_run(recipe, os.path.join(work, f"out-{name}-{r}"))
                best[name] = (min(best[name][0], seconds), min(best[name][1], memory))
                print(f"trainer on the {name} store: first step after {seconds:.1f} s, peak RSS {memory:.3f} GiB "
                      f"per rank", flush=True)
        (bs, bm), (ss, sm) = best["big"], best["small"]
        print(f"start-up to first step, {results[2][0] / 1e6:.0f}M-token store / 1M-token store: {bs:.1f} / "
              f"{ss:.1f} s = {bs / ss:.2f}; peak RSS per rank {bm:.3f} vs {sm:.3f} GiB, difference "
              f"{(bm - sm) * 1024:+.0f} MiB")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
