"""Work, balance and bytes of a CP layout of packed rows, counted from the layout's own plan (no processes): the
numbers bench/bench_cp_balance.py prints for zigzag and documents side by side.

- pairs[r, src]: the visible (query, key) pairs rank r computes against rank src's K/V, summed from the mask-free
  pieces the ring itself runs (cp/plan_pieces.py);
- busiest / mean: the busiest rank's pairs over the mean rank's, over the whole step;
- ring-step efficiency: sum over ring steps of the mean rank's pairs / sum over ring steps of the busiest rank's
  (every step waits for its slowest rank; steps in which nobody computes are skipped and count for neither);
- CP bytes per rank and step: zigzag's dense ring sends P - 1 K/V blocks forward, P - 1 again backward and P float32
  dK/dV accumulators; the documents ring sends each visible row once forward, once backward and its float32 dK/dV
  once (cp/exchange_ring_sparse.py). Both in units of one token's K+V at 2 bytes per element, so the ratio needs no
  model shape.
"""
from __future__ import annotations

import numpy as np
import torch

from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.layouts import DOCUMENTS
from parallelisms.cp.plan_piece import Piece
from parallelisms.cp.plan_pieces import DocumentShards, block_tasks

KV_BYTES, GRAD_BYTES = 2, 4  # bf16 K/V, float32 dK/dV accumulators (per element)


def web_like(rng, n):
    return np.ceil(rng.lognormal(6.5, 1.0, n))


def heavy_tail(rng, n):
    return np.ceil(256 * (1 + rng.pareto(1.1, n)))


def long_doc_mix(rng, n):
    long = rng.random(n) < 0.05
    return np.where(long, rng.integers(64 * 1024, 512 * 1024 + 1, n), web_like(rng, n))


MIXES = {"web-like": web_like, "heavy tail": heavy_tail, "long-doc mix": long_doc_mix}


def packed_row(mix, seq_len: int, rng) -> torch.Tensor:
    """(S,) ids of documents drawn from `mix` packed into one row (the last one cut at the row's end);
    mix None: one document."""
    if mix is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    lengths = []
    while sum(lengths) < seq_len:
        lengths += [int(x) for x in mix(rng, 64)]
    lengths = np.array(lengths)
    ends = np.cumsum(lengths)
    lengths = lengths[:np.searchsorted(ends, seq_len) + 1]
    lengths[-1] -= lengths.sum() - seq_len
    return torch.repeat_interleave(torch.arange(lengths.size), torch.from_numpy(lengths))


def piece_pairs(p: Piece) -> int:
    n_q, n_k = p.q_rows.stop - p.q_rows.start, p.kv_rows.stop - p.kv_rows.start
    return n_q * (n_q + 1) // 2 if p.is_causal else n_q * n_k


def _shards(ids: torch.Tensor, cp: int, balancer: str) -> DocumentShards:
    if balancer == DOCUMENTS:
        return DocumentShards.from_layout(ids, DocumentLayout.plan(ids, cp))
    return DocumentShards.from_full(ids, cp, balancer)


def pair_matrix(ids: torch.Tensor, cp: int, balancer: str) -> tuple[np.ndarray, DocumentShards]:
    """(P, P) visible pairs of rank r (row) against src (column), summed over the rows of ids (B, S)."""
    shards = _shards(ids, cp, balancer)
    local = ids.size(1) // cp
    pairs = np.zeros((cp, cp))
    for r in range(cp):
        for src in range(cp):
            if balancer == DOCUMENTS:
                pieces = shards.layout_pieces(r, src, True)
            else:
                pieces = shards.pieces(r, src, block_tasks(r, src, cp, local, balancer, True), local)
            pairs[r, src] = sum(piece_pairs(p) for p in pieces)
    return pairs, shards


def balance(pairs: np.ndarray) -> tuple[float, float]:
    """(busiest / mean over the step, ring-step efficiency); step s: rank r against rank r - s."""
    cp = pairs.shape[0]
    per_rank = pairs.sum(axis=1)
    steps = [np.array([pairs[r, (r - s) % cp] for r in range(cp)]) for s in range(cp)]
    busy = sum(w.max() for w in steps)
    return per_rank.max() / per_rank.mean(), sum(w.mean() for w in steps) / busy


def cp_bytes(ids: torch.Tensor, cp: int, balancer: str, shards: DocumentShards | None = None) -> float:
    """Bytes the busiest rank sends in one attention forward + backward, per K/V element of one token (see above)."""
    rows, local = ids.size(0), ids.size(1) // cp
    if balancer != DOCUMENTS:
        return rows * ((cp - 1) * local * 2 * KV_BYTES + cp * local * GRAD_BYTES)
    shards = shards or _shards(ids, cp, balancer)
    sent = [sum(shards.visible_rows((r + s) % cp, r, True).numel() for s in range(1, cp)) for r in range(cp)]
    return max(sent) * (2 * KV_BYTES + GRAD_BYTES)


def layout_figures(ids: torch.Tensor, cp: int, balancer: str) -> dict:
    pairs, shards = pair_matrix(ids, cp, balancer)
    busiest, efficiency = balance(pairs)
    return {"busiest/mean": busiest, "ring-step eff": efficiency, "bytes": cp_bytes(ids, cp, balancer, shards),
            "pairs": pairs.sum()}
