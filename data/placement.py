"""Data-parallel placement: the rows of one optimizer step re-packed by attention work ([data] placement = "work").

Why. With document masking a token sees only the earlier tokens of its own document, so a row's attention work is
the sum of len^2 / 2 over its document segments, and rows differ by up to ~seq_len x. Every micro-step waits for its
busiest data-parallel rank. The loss is a sum over the step's label tokens divided by their count, and a segment
(a run of one document id in a packed row: its tokens, labels and positions, which restart at the run's start, see
data/packing.py) sees nothing outside itself. So the step's segments may be moved between its rows (any dp rank, any
micro-step) as long as every row keeps exactly seq_len tokens: the loss is unchanged up to summation order.

How. Every rank reads the whole step (micro-steps x dp x local rows, the same rows whatever the dp degree) and runs
the same deterministic planner, so no collective is needed. The step waits for the sum over micro-steps of each
micro-step's busiest rank, so the planner fills the step's row slots:
1. the long segments, longest first, each into the slot whose micro-step's busiest work grows least (then the slot
   with the least work, then the lowest index): the heaviest work gathers in one micro-step, evened out inside it;
   a long segment leaves its slot full or with room for short ones;
2. the short segments then fill every slot's remaining room exactly (a subset sum per slot, all but the last).
A few long/short splits are tried (`_TRIES`). If none fills every slot exactly, the step falls back to whole-row
moves: rows sorted by work, the heaviest micro-step first, each micro-step's rows dealt to the ranks by least work,
which is always exact. Segments in a slot keep the loader's order; document ids are renumbered 0, 1, ... per row so
that two segments of one document never see each other. With several local rows per rank the planner balances rows,
which balances ranks too but does not use a rank's freedom to pair a heavy row with a light one.

The planner maps segments onto slots given as (micro-step, dp rank, local row); a CP level could be added as one more
slot axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.packing import FIELDS


@dataclass(frozen=True)
class StepSlots:
    """The rows of one optimizer step: slot index = (micro_step * dp_size + dp_rank) * local_rows + local_row."""
    micro_steps: int
    dp_size: int
    local_rows: int
    seq_len: int

    @property
    def count(self) -> int:
        return self.micro_steps * self.dp_size * self.local_rows

    def of(self, micro_step: int, dp_rank: int) -> slice:
        first = (micro_step * self.dp_size + dp_rank) * self.local_rows
        return slice(first, first + self.local_rows)


def segments(document_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, start, length) of every run of one document id in the (rows, seq_len) ids, in row-major order."""
    rows, seq_len = document_ids.shape
    starts_mask = np.ones_like(document_ids, dtype=bool)
    starts_mask[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    row, start = np.nonzero(starts_mask)
    flat = row * seq_len + start
    ends = np.append(flat[1:], rows * seq_len)
    return row, start, ends - flat


def segment_work(lengths: np.ndarray) -> np.ndarray:
    """Visible (query, key) pairs of causal segments of these lengths: len (len + 1) / 2."""
    lengths = lengths.astype(np.int64)
    return lengths * (lengths + 1) // 2


_TRIES = ((0.05, 4), (0.05, 1), (0.15, 4), (0.15, 1), (0.3, 4), (0.3, 1))
"""(the share of the step's tokens held by "short" segments, the room a long one must leave as a multiple of the
longest short one), tried in turn."""


def plan_segments(lengths: np.ndarray, num_slots: int, capacity: int, micro_slots: int | None = None
                  ) -> np.ndarray | None:
    """The slot of each segment, every slot holding exactly `capacity` tokens; None when no exact fill was found.

    Tries a few short/long splits: more short segments give the exact fill more pieces to choose from and the work
    balance fewer. `micro_slots`: slots per micro-step (consecutive slots), by default all in one."""
    if int(lengths.sum()) != num_slots * capacity:
        raise ValueError(f"{int(lengths.sum())} tokens cannot fill {num_slots} rows of {capacity}")
    ascending = np.sort(lengths)
    for share, reserve in _TRIES:
        small = int(ascending[np.searchsorted(np.cumsum(ascending), share * capacity * num_slots)])
        slot = _plan(lengths, num_slots, capacity, small=small, reserve=reserve * small,
                     micro_slots=micro_slots or num_slots)
        if slot is not None:
            return slot
    return None


def _cheapest_slot(work: np.ndarray, fits: np.ndarray, pairs: int, micro_slots: int) -> int:
    """The fitting slot whose micro-step's busiest work grows least with `pairs` added (the step waits for the sum of
    the micro-steps' busiest ranks); among equals the one with the least work, then the lowest index."""
    busiest = work.reshape(-1, micro_slots).max(axis=1).repeat(micro_slots)
    growth = np.maximum(work + pairs - busiest, 0)
    key = np.where(fits, growth, np.iinfo(np.int64).max)
    candidates = np.flatnonzero(key == key.min())
    return int(candidates[np.argmin(work[candidates])])


def _plan(lengths: np.ndarray, num_slots: int, capacity: int, small: int, reserve: int,
          micro_slots: int) -> np.ndarray | None:
    """Segments longer than `small` by work into slots, leaving each slot full or at least `reserve` tokens of room;
    then the short ones fill every slot's room exactly."""
    slot = np.full(len(lengths), -1, dtype=np.int64)
    room = np.full(num_slots, capacity, dtype=np.int64)
    work = np.zeros(num_slots, dtype=np.int64)
    segment_pairs = segment_work(lengths)
    long_ones = np.flatnonzero(lengths > small)
    for i in long_ones[np.argsort(-lengths[long_ones], kind="stable")]:
        left = room - lengths[i]
        fits = (left == 0) | (left >= reserve)
        if not fits.any():
            return None
        target = _cheapest_slot(work, fits, segment_pairs[i], micro_slots)
        slot[i] = target
        room[target] -= lengths[i]
        work[target] += segment_pairs[i]
    remaining = list(np.flatnonzero(slot < 0))
    order = np.argsort(work, kind="stable")
    for target in order[:-1]:  # the lightest slots pick first; the last one takes what is left
        chosen = _subset_with_sum([int(lengths[i]) for i in remaining], int(room[target]))
        if chosen is None:
            return None
        taken = {remaining[k] for k in chosen}
        slot[sorted(taken)] = target
        remaining = [i for i in remaining if i not in taken]
    slot[remaining] = order[-1]
    return slot


def _subset_with_sum(values: list[int], target: int) -> list[int] | None:
    """Indices of values summing to exactly `target`, or None: largest first when that lands exactly (most slots,
    cheaply), else a bitset subset sum."""
    greedy, room = [], target
    for k in sorted(range(len(values)), key=lambda k: -values[k]):
        if values[k] <= room:
            greedy.append(k)
            room -= values[k]
            if room == 0:
                return sorted(greedy)
    if room == 0:
        return sorted(greedy)
    mask = (1 << (target + 1)) - 1
    reachable = [1]
    for v in values:
        reachable.append((reachable[-1] | (reachable[-1] << v)) & mask)
    if not (reachable[-1] >> target) & 1:
        return None
    chosen = []
    for k in range(len(values) - 1, -1, -1):
        if not (reachable[k] >> target) & 1:  # target needs value k
            chosen.append(k)
            target -= values[k]
    return chosen[::-1]


def plan_whole_rows(row_work: np.ndarray, slots: StepSlots) -> np.ndarray:
    """The slot of each whole row: the heaviest rows share a micro-step (so only one micro-step waits for them), and
    within a micro-step rows go to the rank with the least work."""
    order = np.argsort(-row_work, kind="stable")
    per_micro = slots.dp_size * slots.local_rows
    slot = np.empty(len(row_work), dtype=np.int64)
    for m in range(slots.micro_steps):
        rank_work = np.zeros(slots.dp_size, dtype=np.int64)
        rank_rows = np.zeros(slots.dp_size, dtype=np.int64)
        for row in order[m * per_micro:(m + 1) * per_micro]:
            open_ranks = rank_rows < slots.local_rows
            rank = int(np.argmin(np.where(open_ranks, rank_work, np.iinfo(np.int64).max)))
            slot[row] = slots.of(m, rank).start + rank_rows[rank]
            rank_work[rank] += row_work[row]
            rank_rows[rank] += 1
    return slot


@dataclass
class Placement:
    """The placed rows of one step (slot order) and which plan made them."""
    fields: dict[str, np.ndarray]
    whole_rows: bool
    """True when the segment plan found no exact fill and rows were moved whole."""


def place_step(fields: dict[str, np.ndarray], slots: StepSlots) -> Placement:
    """Re-packs the step's rows (each field (slots.count, seq_len), loader order) into slot order by work."""
    doc = fields["document_ids"]
    row, start, length = segments(doc)
    slot = plan_segments(length, slots.count, slots.seq_len, slots.dp_size * slots.local_rows)
    if slot is None:
        row_work = np.bincount(row, weights=segment_work(length), minlength=slots.count).astype(np.int64)
        row_slot = plan_whole_rows(row_work, slots)
        placed = {name: np.empty_like(values) for name, values in fields.items()}
        for name, values in fields.items():
            placed[name][row_slot] = values
        return Placement(placed, whole_rows=True)
    # Slots are filled exactly, so the segments in (slot, loader) order are the placed rows, flattened.
    order = np.lexsort((np.arange(len(slot)), slot))
    lengths = length[order]
    source_starts = (row * slots.seq_len + start)[order]
    gather = np.repeat(source_starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    shape = (slots.count, slots.seq_len)
    placed = {name: fields[name].reshape(-1)[gather].reshape(shape) for name in FIELDS if name != "document_ids"}
    first_of_slot = np.searchsorted(slot[order], slot[order], side="left")
    placed["document_ids"] = np.repeat(np.arange(len(order)) - first_of_slot, lengths).reshape(shape)
    return Placement(placed, whole_rows=False)


class StepPlacement:
    """Reads all of an optimizer step's micro-batches (each the global micro-batch of dp_size x local rows, from a
    loader built for one rank) and hands this dp rank its placed micro-batches."""

    def __init__(self, slots: StepSlots, dp_rank: int):
        self.slots, self.dp_rank = slots, dp_rank
        self.whole_row_steps = 0
        """Steps that fell back to whole-row moves (reported by the benchmark and the tests)."""

    def take(self, data_iter) -> list[dict[str, torch.Tensor]]:
        batches = [next(data_iter) for _ in range(self.slots.micro_steps)]
        step_rows = {name: torch.cat([b[name] for b in batches]).numpy() for name in FIELDS}
        placement = place_step(step_rows, self.slots)
        self.whole_row_steps += placement.whole_rows
        return [{name: torch.from_numpy(np.ascontiguousarray(values[self.slots.of(m, self.dp_rank)]))
                 for name, values in placement.fields.items()} for m in range(self.slots.micro_steps)]
