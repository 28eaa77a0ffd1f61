"""How full chat rows are (data/chat_packing.py): packing efficiency (tokens of conversations / row tokens) of
best-fit decreasing for three conversation-length mixes and two window sizes, with the packer's time per 1,000
conversations; beside it, what the alternatives would do: one conversation per row (padded), and the old cut-anywhere
stream (every row full, but the share of conversations a row boundary cuts).

Lengths are token counts drawn with a fixed seed; conversations longer than seq_len are dropped first, as a chat
source drops them (truncate = "drop"). No tokenizer or store is needed: the packer sees lengths only.

    python bench/bench_chat_packing.py [--seq-len 8192] [--conversations 50000] [--windows 1000,10000]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.chat_packing import pack_conversations  # noqa: E402


def length_mixes(count: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """Three mixes: the issue's lognormal(6.0, 1.0), short chats lognormal(5.0, 0.7), and log-uniform 20..0.9 x
    seq_len (as many long conversations as short ones per octave)."""
    rng = np.random.default_rng(seed)
    mixes = {
        "lognormal(6.0, 1.0)": rng.lognormal(6.0, 1.0, size=count),
        "lognormal(5.0, 0.7)": rng.lognormal(5.0, 0.7, size=count),
        f"log-uniform 20..{int(0.9 * seq_len)}": 20 * (0.9 * seq_len / 20) ** rng.random(count),
    }
    out = {}
    for name, values in mixes.items():
        lengths = np.maximum(1, np.rint(values)).astype(np.int64)
        out[name] = lengths[lengths <= seq_len]
    return out


def cut_share(lengths: np.ndarray, seq_len: int) -> float:
    """Share of conversations the old stream (conversations and an EOS each, cut every seq_len + 1 tokens) cuts."""
    ends = np.cumsum(lengths + 1)
    starts = ends - lengths - 1
    return float(np.mean(starts // (seq_len + 1) != (ends - 2) // (seq_len + 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--conversations", type=int, default=50_000)
    parser.add_argument("--windows", default="1000,10000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    print(f"seq_len {args.seq_len}, {args.conversations:,} conversations drawn per mix (those over seq_len dropped)")
    print(f"{'length mix':<24} {'kept':>7} {'mean':>6} {'window':>7} {'rows':>7} {'efficiency':>10} "
          f"{'s / 1k conv':>11} {'1 per row':>9} {'old: cut':>8}")
    for name, lengths in length_mixes(args.conversations, args.seq_len, args.seed).items():
        order = np.arange(len(lengths))
        one_per_row = lengths.mean() / args.seq_len
        for window in windows:
            start = time.perf_counter()
            layout = pack_conversations(order, lengths, args.seq_len, window)
            per_thousand = (time.perf_counter() - start) / len(lengths) * 1000
            print(f"{name:<24} {len(lengths):>7,} {lengths.mean():>6.0f} {window:>7,} {layout.num_rows:>7,} "
                  f"{layout.efficiency:>10.4f} {per_thousand:>11.4f} {one_per_row:>9.3f} "
                  f"{cut_share(lengths, args.seq_len):>8.3f}")


if __name__ == "__main__":
    main()
