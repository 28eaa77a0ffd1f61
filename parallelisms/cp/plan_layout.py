"""The "documents" context-parallel layout: each row's documents placed on the CP ranks by attention work.

With document masking a rank's attention work is the visible pairs of the documents it holds (~len^2 / 2 each), not
its share of one causal triangle, so zigzag leaves ranks unbalanced and ships K/V that no query on the receiving rank
can see. The plan below is computed on the host from a row's document ids, which every CP rank already holds, so every
rank computes the same plan with no collective:

1. every rank holds exactly S / P tokens of each row (equal shapes for every collective and for sequence parallel);
2. a document longer than a share, or whose work exceeds a fraction of a rank's ideal work (the largest of
   SPREAD_FRACTIONS that balances the plan's ranks and ring steps), is split head-tail over all ranks as zigzag
   splits one sequence (rank r holds its r-th head piece and its r-th tail piece), which balances its work and every
   ring step of it; a row that is one document therefore gets exactly zigzag's layout;
3. the other documents are placed whole, largest first, each on the least-loaded rank (by len^2) that has room
   (LPT); a document that fits on no rank whole fills the roomiest ranks in turn (only documents that straddle a
   share's boundary are split).

Each rank's positions are kept in increasing order, so a document is a run of rows in a shard, RoPE sees true
positions (position_ids are sharded with the tokens) and the loss, a sum over tokens, is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from config.errors import Refusal


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of equal ids of one row."""
    starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    return starts, np.diff(np.append(starts, ids.size))


def _split_over_all(start: int, length: int, room: np.ndarray, owned: list[list[np.ndarray]]) -> None:
    """Head-tail split of [start, start + length) over every rank: rank r gets floor or ceil of length / P tokens
    (the extra tokens go to the roomiest ranks), half of them among the heads in rank order, the rest among the
    tails in reverse rank order (zigzag's chunks r and 2P-1-r when length = S)."""
    size = room.size
    counts = np.full(size, length // size)
    extra = length - counts.sum()
    counts[np.argsort(-room, kind="stable")[:extra]] += 1
    heads, tails = counts // 2, counts - counts // 2
    at = start
    for r in range(size):
        owned[r].append(np.arange(at, at + heads[r]))
        at += heads[r]
    for r in reversed(range(size)):
        owned[r].append(np.arange(at, at + tails[r]))
        at += tails[r]
    room -= counts


SPREAD_FRACTIONS = tuple(Fraction(1, 2**k) for k in range(7))
"""A document is split over all ranks when its work exceeds this fraction of a rank's ideal work; the largest
fraction whose plan is balanced (BALANCED, STEP_EFFICIENCY) is used (a split document's K/V goes to every rank)."""
BALANCED, STEP_EFFICIENCY = Fraction(102, 100), Fraction(95, 100)


def _total(values: np.ndarray, axis: int | None = None):
    """Every sum the planner takes goes through here. Work is int64 (integer units), so the sum is exact in any
    order: ranks whose CPUs sum in a different order still plan the same layout (a test shuffles the order)."""
    return values.sum(axis=axis)


def _place(starts: np.ndarray, lengths: np.ndarray, spread: np.ndarray, cp_size: int, share: int):
    """(per-rank position arrays, (P ranks, P shifts) int64 work estimate) with the `spread` documents split over
    all ranks and the others placed whole by LPT (straddling documents fill the roomiest ranks in turn).

    Work units: one visible pair is P^2 units, so a spread document's len^2 / P^2 per (rank, shift) is an integer
    and every comparison below is exact (no float rounding can make two ranks disagree)."""
    units = cp_size * cp_size
    work = lengths.astype(np.int64) ** 2
    room = np.full(cp_size, share, dtype=np.int64)
    steps = np.zeros((cp_size, cp_size), dtype=np.int64)  # [rank, shift]: work of rank against rank - shift's K/V
    owned: list[list[np.ndarray]] = [[] for _ in range(cp_size)]
    for i in np.flatnonzero(spread):
        _split_over_all(int(starts[i]), int(lengths[i]), room, owned)
        steps += work[i]  # zigzag's split: len^2 / P^2 pairs at every rank and shift
    whole = np.flatnonzero(~spread)
    for i in whole[np.argsort(-lengths[whole], kind="stable")]:
        start, length = int(starts[i]), int(lengths[i])
        fits = np.flatnonzero(room >= length)
        if fits.size:
            r = fits[np.argmin(_total(steps[fits], axis=1))]
            owned[r].append(np.arange(start, start + length))
            room[r] -= length
            steps[r, 0] += work[i] * units
            continue
        placed: list[tuple[int, int]] = []  # (rank, tokens) of this document's earlier pieces: later ones see them
        while length:  # straddles: fill the roomiest ranks in turn
            r = int(np.argmax(room))
            take = min(length, int(room[r]))
            owned[r].append(np.arange(start, start + take))
            room[r] -= take
            steps[r, 0] += take * take * units
            for earlier, n in placed:
                steps[r, (r - earlier) % cp_size] += 2 * n * take * units
            placed.append((r, take))
            start, length = start + take, length - take
    assert not room.any(), room  # every share filled exactly (the lengths sum to S)
    return owned, steps


@dataclass(frozen=True)
class _Quality:
    """Exact (integer) balance of a work estimate: busiest / mean rank = busiest * P / total, ring-step efficiency
    = total / (P * sum over shifts of the busiest rank)."""
    total: int
    busiest: int
    step_busiest: int
    cp_size: int

    @classmethod
    def of(cls, steps: np.ndarray) -> "_Quality":
        load = _total(steps, axis=1)
        return cls(int(_total(load)), int(load.max()), int(_total(steps.max(axis=0))), steps.shape[0])

    @property
    def imbalance(self) -> Fraction:
        return Fraction(self.busiest * self.cp_size, self.total)

    @property
    def efficiency(self) -> Fraction:
        return Fraction(self.total, self.cp_size * self.step_busiest)

    @property
    def score(self) -> Fraction:
        """efficiency / imbalance: higher is better."""
        return self.efficiency / self.imbalance

    @property
    def balanced(self) -> bool:
        return self.imbalance <= BALANCED and self.efficiency >= STEP_EFFICIENCY


def _spread(lengths: np.ndarray, share: int, cp_size: int, fraction: Fraction) -> np.ndarray:
    """Documents split over all ranks: longer than a share, or len^2 > fraction * (total len^2 / P), exactly."""
    work = lengths.astype(np.int64) ** 2
    total = int(_total(work))
    exceeds = [w * cp_size * fraction.denominator > fraction.numerator * total for w in work.tolist()]
    return (lengths > share) | np.array(exceeds, dtype=bool)


def plan_row(ids: np.ndarray, cp_size: int) -> np.ndarray:
    """(P, S / P) int64: the increasing global positions each rank holds of one row with document ids `ids`."""
    share = ids.size // cp_size
    starts, lengths = _runs(ids)
    best = None
    for fraction in SPREAD_FRACTIONS:
        owned, steps = _place(starts, lengths, _spread(lengths, share, cp_size, fraction), cp_size, share)
        quality = _Quality.of(steps)
        if best is None or quality.score > best[0]:
            best = (quality.score, owned)
        if quality.balanced:
            break
    return np.stack([np.sort(np.concatenate(parts)) for parts in best[1]])


@dataclass(frozen=True)
class DocumentLayout:
    """The plan of a (B, S) batch: `positions[r, b]` are the global positions rank r holds of row b, increasing."""
    positions: torch.Tensor  # (P, B, S / P) int64, on the host

    @classmethod
    def plan(cls, document_ids: torch.Tensor, cp_size: int) -> "DocumentLayout":
        """From (B, S) document ids (one host transfer); S must be divisible by 2 * cp_size."""
        host = document_ids.detach().cpu().numpy()
        rows = [plan_row(row, cp_size) for row in host]
        return cls(torch.from_numpy(np.stack(rows, axis=1)))

    @property
    def cp_size(self) -> int:
        return self.positions.size(0)

    def rank_positions(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, S / P) positions of `rank`."""
        return self.positions[rank].to(device)

    def shard(self, x: torch.Tensor, seq_dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s tokens of x (batch dim 0, sequence dim `seq_dim` = 1), a new tensor."""
        _check_dims(x, seq_dim)
        pos = self.rank_positions(rank, x.device)
        rows = torch.arange(x.size(0), device=x.device)[:, None]
        return x[rows, pos]

    def unshard(self, parts: list[torch.Tensor], seq_dim: int) -> torch.Tensor:
        """The full (B, S, ...) tensor from every rank's shard."""
        _check_dims(parts[0], seq_dim)
        device = parts[0].device
        pos = torch.cat([self.rank_positions(r, device) for r in range(self.cp_size)], dim=1)
        gathered = torch.cat(parts, dim=1)
        full = torch.empty_like(gathered)
        full[torch.arange(full.size(0), device=device)[:, None], pos] = gathered
        return full


def _check_dims(x: torch.Tensor, seq_dim: int) -> None:
    if seq_dim != 1 or x.dim() < 2:
        raise Refusal(f"the documents layout is per row: it needs (batch, seq, ...) tensors with seq_dim = 1, "
                         f"got shape {tuple(x.shape)} with seq_dim = {seq_dim}")
