"""Chunked loss + tiled MLP on vs off in real trainer runs on this CPU: peak memory per rank, tokens/s, and the longest
sequence that trains under a fixed memory cap.

Every row is the real trainer (train.py under torchrun, 1 rank, the debug model's shape with a 32K vocabulary, fp32,
one row per step), run in its own process with malloc returning large blocks at once, so the peak resident set the
trainer reports follows the peak of live tensors. The first step is dropped from tokens/s (warm-up).

    python bench/bench_memory_features.py [--seq 8192] [--long 16384,24576] [--steps 3] [--vocab 32768]

The cap is the features-off peak at --seq: without the features nothing longer than --seq fits under it; every
--long length is run with the features on and reported against the cap.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/bench_memory_features.py` puts bench/ first on the path, not the root
    sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

OFF = ["--training.loss_chunk_tokens", "0", "--model.mlp_chunk_tokens", "0"]
ON = ["--training.loss_chunk_tokens", "2048", "--model.mlp_chunk_tokens", "2048"]


def pydoc_tokenizer(pieces: int) -> str:
    """A SentencePiece model trained on the debug recipe's corpus (cached in data.cache_dir): Python's docs hold
    too little text for 32K pieces, and a model's vocabulary may exceed its tokenizer's, as Llama 3's does."""
    sys.path.insert(0, ROOT)
    from config.recipe import load_config
    from data.sources import build_run_tokenizer

    return build_run_tokenizer(load_config(os.path.join(ROOT, "recipes/debug.toml")), pieces).source


def run(seq_len: int, features: list[str], steps: int, vocab: int, ac: str, tokenizer: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes/debug.toml"),
               "--parallelism.dp_shard", "1", "--training.steps", str(steps), "--training.seq_len", str(seq_len),
               "--training.local_batch_size", "1", "--model.vocab_size", str(vocab),
               "--data.tokenizer_path", tokenizer, "--activation_checkpoint.mode", ac, "--job.dump_folder", out, "--metrics.enable_tensorboard", "false",
               *features]
        env = child_env(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536")
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = read_metrics(out)
    return {"seq": seq_len, "peak_gib": max(r["memory"] for r in records),
            "tok_s": statistics.median(r["tokens_per_sec"] for r in records[1:] or records),
            "loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--long", default="16384,24576", help="lengths run with the features on against the cap")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--ac", default="none", help="activation_checkpoint.mode for every run")
    args = parser.parse_args()
    tokenizer = pydoc_tokenizer(min(args.vocab, 16000))
    off = run(args.seq, OFF, args.steps, args.vocab, args.ac, tokenizer)
    on = run(args.seq, ON, args.steps, args.vocab, args.ac, tokenizer)
    print(f"debug model shape, vocab {args.vocab}, fp32, 1 rank, batch 1, AC {args.ac}; peak = the trainer's peak "
          f"resident set per rank (GiB)")
    print(f"{'features':<10} {'seq':>7} {'peak GiB':>9} {'tok/s':>8} {'last loss':>10}")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:<10} {r['seq']:>7} {r['peak_gib']:>9.2f} {r['tok_s']:>8.0f} {r['loss']:>10.5f}")
    print(f"at seq {args.seq}: peak on / off = {on['peak_gib'] / off['peak_gib']:.3f}, "
          f"tok/s on / off = {on['tok_s'] / off['tok_s']:.3f}")
    cap = off["peak_gib"]
    longest = args.seq
    for seq_len in (int(s) for s in args.long.split(",") if s):
        r = run(seq_len, ON, 2, args.vocab, args.ac, tokenizer)
        fits = r["peak_gib"] <= cap
        print(f"{'on':<10} {seq_len:>7} {r['peak_gib']:>9.2f} {r['tok_s']:>8.0f}   {'fits' if fits else 'over'} the "
              f"{cap:.2f} GiB cap")
        if fits:
            longest = max(longest, seq_len)
    print(f"longest sequence under the {cap:.2f} GiB cap: {args.seq} without the features (its own peak), "
          f"{longest} with them: {longest / args.seq:.1f}x")


if __name__ == "__main__":
    main()
