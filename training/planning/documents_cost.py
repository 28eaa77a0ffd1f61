"""What packed documents cost at CP 1: one packed-sequence call per layer and direction (parallelisms/cp/
packed_documents.py), priced document piece by piece and corrected by what such a call measured on a GPU.

Why not the visible pairs at one block length (the CP ring's pricing): a packed call's time is the sum of its
documents' tiles, and a short document runs far below a long one's rate, so a row of one 8K document and a row of
sixty 130-token ones cost very differently for the same pair count. Each piece is priced at the dense kernel's rate
for its own length (accelerators.attention_rate), and the sum is multiplied by the kernel's measured overhead:
seconds of one packed call over web-like documents (cuda_path_probe.web_like_row) over this same sum for them. The
overhead carries what the per-piece sum leaves out (the scheduling of ragged tiles, launch and host time, a small
problem underfilling the GPU) at the call's total tokens; it comes from the device's rates file when that holds
packed rows (rates.py), else from PUBLISHED: one H200 measurement, applied to every Hopper GPU (an assumption).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from training.planning.accelerators import ACCELERATORS, AcceleratorSpec, attention_rate

BACKWARD_FLOPS = 2.5
"""Backward FLOPs per forward FLOP (five GEMMs to two), as everywhere in the step model."""


@dataclass(frozen=True)
class PackedCall:
    """One measured packed call, forward + backward, over web-like documents filling `tokens`."""
    kernel: str
    tokens: int
    seconds: float
    accelerator: str
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128


PUBLISHED = (
    PackedCall("flash_varlen", 8192, 1.20e-3, "h200"), PackedCall("cudnn_thd", 8192, 1.14e-3, "h200"),
    PackedCall("flash_varlen", 65536, 9.09e-3, "h200"), PackedCall("cudnn_thd", 65536, 5.81e-3, "h200"),
)
"""bench/bench_attention_kernels.py --seqs 8192,65536 --reps 5 on one H200 (torch 2.11, cuDNN 9.19, cudnn-frontend
1.32.0), fastest of 5, q (1, 16, seq, 128) with 8 K/V heads, bf16: bench/measurements/h200_documents_2026-11-28/
thd_recheck/attention_kernels_thd.txt ("packed call, flash varlen" / "packed call, cuDNN THD")."""


def dense_family(kernel: str) -> str:
    """The dense kernel family whose per-length rate a packed call's pieces are priced at."""
    return "cudnn" if kernel == "cudnn_thd" else "flash"


def pieces_seconds(acc: AcceleratorSpec, kernel: str, pieces: dict[int, float], heads: float, head_dim: int,
                   forwards: float = 1.0) -> float:
    """Seconds of the pieces ({length: count}) at the dense kernel's rate for each piece's length: `forwards`
    forward passes (1 + recomputation) and one backward, causal inside each piece."""
    family = dense_family(kernel)
    seconds = 0.0
    for length, count in pieces.items():
        fwd = 4.0 * length * (length + 1) / 2 * heads * head_dim * count
        seconds += forwards * fwd / attention_rate(acc, family, "fwd", head_dim, True, length)
        seconds += BACKWARD_FLOPS * fwd / attention_rate(acc, family, "bwd", head_dim, True, length)
    return seconds


@lru_cache(maxsize=64)
def _web_like_pieces(tokens: int) -> tuple[tuple[int, int], ...]:
    from training.planning.cuda_path_probe import web_like_row

    lengths = np.bincount(web_like_row(tokens))
    values, counts = np.unique(lengths[lengths > 0], return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist()))


def call_overhead(kernel: str, tokens: float, measured: tuple[PackedCall, ...] = PUBLISHED) -> float:
    """Measured seconds / per-piece seconds of the kernel's packed call at `tokens` per call (log-interpolated
    between the measured totals, flat beyond them); 1.0 when nothing was measured for this kernel."""
    points = []
    for call in sorted((c for c in measured if c.kernel == kernel), key=lambda c: c.tokens):
        model = pieces_seconds(ACCELERATORS[call.accelerator], kernel, dict(_web_like_pieces(call.tokens)),
                               call.heads, call.head_dim)
        points.append((math.log2(call.tokens), call.seconds / model))
    if not points:
        return 1.0
    return float(np.interp(math.log2(max(tokens, 1.0)), *zip(*points)))


def packed_attention_seconds(acc: AcceleratorSpec, kernel: str, pieces: dict[int, float], heads: float,
                             head_dim: int, forwards: float, measured: tuple[PackedCall, ...] = PUBLISHED,
                             rows: int = 1) -> float:
    """One layer's packed calls (forward passes and backward) over `rows` rows of `pieces` each: one call takes
    every row of the micro-batch, so its overhead is read at rows x the row's tokens."""
    tokens = rows * sum(length * count for length, count in pieces.items())
    per_row = pieces_seconds(acc, kernel, pieces, heads, head_dim, forwards)
    return rows * per_row * call_overhead(kernel, tokens, measured)


def row_pieces(document_lengths: np.ndarray, seq_len: int, rows: int = 64) -> dict[int, float]:
    """{piece length: pieces per row} of rows packed from the documents in order, as the packer fills rows (a
    document crossing a row's end is cut there and goes on in the next row), averaged over the first `rows` rows
    (the corpus repeated when it is shorter). A step's time is linear in its pieces, so the average row prices it."""
    lengths = np.asarray(document_lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        return {seq_len: 1.0}
    need = rows * seq_len
    repeats = -(-need // int(lengths.sum()))
    ends = np.cumsum(np.tile(lengths, repeats))
    ends = ends[ends < need]
    cuts = np.union1d(ends, np.arange(seq_len, need, seq_len))  # document ends and row ends
    pieces = np.diff(np.concatenate([[0], cuts, [need]]))
    values, counts = np.unique(pieces[pieces > 0], return_counts=True)
    return {int(v): c / rows for v, c in zip(values, counts)}
