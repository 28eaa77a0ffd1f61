"""The unit every CP plan is written in: a `Piece` is one mask-free kernel call (plan_pieces.py cuts blocks into
them; the kernels, accumulators and exchanges read them). A leaf, so every floor of the package can import it."""
from __future__ import annotations

from dataclasses import dataclass

FULL = slice(None)


@dataclass(frozen=True)
class BlockTask:
    q_rows: slice
    kv_rows: slice
    is_causal: bool  # top-left aligned; only ever used with as many Q rows as K/V rows


@dataclass(frozen=True)
class Piece:
    """One mask-free kernel call: `batch` rows, `q_rows` of the local queries against `kv_rows` of the source's K/V.
    Causal pieces are squares (Lq == Lk), so top-left (CPU) and bottom-right (CUDA flash) alignment agree."""
    batch: slice
    q_rows: slice
    kv_rows: slice
    is_causal: bool
