"""The host side of the documents layout for one batch, made from numpy ids before the step (issue 27): the layout's
positions, one rank's mask-free pieces against every source, the K/V rows every exchange carries.

Why. Planned inside the step, the layout cost a device-to-host copy of the ids, pageable copies of positions and
rows, and seconds of Python loops per micro-step at 1M tokens (a GPU idling). Made here, in the data loader's workers
one batch ahead and with whole-array numpy operations, the step only moves finished integer arrays to the device
(non_blocking) and nothing inside the attention reads a device tensor back. Everything is integer arithmetic on the
ids, so every rank makes the same plan by construction.

The arrays describe what `plan_pieces.segment_pieces` and `DocumentShards.visible_rows` describe (tests compare them):
- a segment is a run of one document at consecutive global positions inside one rank's shard of one row;
- query segment (doc, a..b, position qpos) of rank r sees key segment (doc, c..d, kpos) of source s whole when the
  keys end before the queries start (kpos + d - c <= qpos), as a causal square when it is the same segment (s == r,
  kpos == qpos), else not at all (two segments of one document on different ranks hold disjoint positions);
- so a key segment of s is read by rank r != s iff r holds a token of its document at a position >= its end: the
  visible rows of every (r, s) pair follow from one (rank, document) table of the last position held.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from parallelisms.cp.kernel_varlen import HostCall, host_calls
from parallelisms.cp.plan_layout import plan_row

PIECE_COLUMNS = ("batch", "q_start", "q_end", "kv_start", "kv_end", "causal")
"""The columns of a piece array, one row per mask-free kernel call (as plan_piece.Piece)."""


@dataclass(frozen=True)
class Segments:
    """Every segment of an (R, B, L) arrangement of ids and positions, in (rank, batch row, local row) order."""
    rank: np.ndarray
    batch: np.ndarray
    start: np.ndarray
    end: np.ndarray
    position: np.ndarray
    key: np.ndarray
    """(batch row, document id) as one dense integer: segments of one document of one row share it."""

    @classmethod
    def of(cls, ids: np.ndarray, positions: np.ndarray) -> "Segments":
        ranks, batch, length = ids.shape
        starts = np.ones(ids.shape, dtype=bool)
        starts[..., 1:] = (ids[..., 1:] != ids[..., :-1]) | (positions[..., 1:] != positions[..., :-1] + 1)
        rank, row, start = np.nonzero(starts)
        flat = (rank * batch + row) * length + start
        end = np.append(flat[1:], ids.size) - (rank * batch + row) * length
        docs = ids[rank, row, start]
        _, key = np.unique(row.astype(np.int64) * (int(ids.max()) + 1) + docs, return_inverse=True)
        return cls(rank, row, start, end, positions[rank, row, start], key.reshape(-1))

    def of_rank(self, r: int) -> np.ndarray:
        """Indices of rank r's segments (a contiguous, ordered range)."""
        lo, hi = np.searchsorted(self.rank, [r, r + 1])
        return np.arange(lo, hi)


def pieces_between(seg: Segments, rank: int, src: int, is_causal: bool) -> np.ndarray:
    """(n, 6) int64 pieces (PIECE_COLUMNS) of `rank`'s queries against `src`'s keys, in segment_pieces' order: by
    batch row, query segment, then key segment in local order."""
    q, k = seg.of_rank(rank), seg.of_rank(src)
    by_key = k[np.argsort(seg.key[k], kind="stable")]
    lo = np.searchsorted(seg.key[by_key], seg.key[q], side="left")
    hi = np.searchsorted(seg.key[by_key], seg.key[q], side="right")
    counts = hi - lo
    qi = np.repeat(q, counts)
    ki = by_key[np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))]
    if is_causal:
        before = seg.position[ki] + seg.end[ki] - seg.start[ki] <= seg.position[qi]
        square = (rank == src) & (seg.position[ki] == seg.position[qi])
        keep = before | square
        qi, ki, causal = qi[keep], ki[keep], square[keep] & ~before[keep]
    else:
        causal = np.zeros(qi.size, dtype=bool)
    return np.stack([seg.batch[qi], seg.start[qi], seg.end[qi], seg.start[ki], seg.end[ki],
                     causal.astype(np.int64)], axis=1).astype(np.int64)


def last_position_held(seg: Segments, ranks: int) -> np.ndarray:
    """(R, documents) the last global position each rank holds of each (row, document), -1 where none."""
    last = np.full((ranks, int(seg.key.max()) + 1), -1, dtype=np.int64)
    np.maximum.at(last, (seg.rank, seg.key), seg.position + seg.end - seg.start - 1)
    return last


def readers(seg: Segments, ranks: int, is_causal: bool) -> np.ndarray:
    """(R, segments) bool: rank r reads segment k's rows as keys (for r != the segment's rank)."""
    last = last_position_held(seg, ranks)[:, seg.key]
    if is_causal:
        return last >= (seg.position + seg.end - seg.start)[None]
    return last >= 0


def rows_of(seg: Segments, chosen: np.ndarray, local_len: int) -> np.ndarray:
    """Flat (batch * L + row) indices, increasing, of the chosen segments' rows."""
    lengths = seg.end[chosen] - seg.start[chosen]
    first = seg.batch[chosen] * local_len + seg.start[chosen]
    return (np.repeat(first - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))).astype(np.int64)


@dataclass
class RankPlan:
    """One rank's documents plan over an arrangement of R shards (R = P for the ring and all-gather, 1 for Ulysses):
    its pieces against every source and the K/V rows it receives from and sends to every rank. Integer arrays on the
    host; `to(device)` moves the rows (one copy, non_blocking) for the exchanges' index_select / index_copy."""
    ranks: int
    rank: int
    pieces: list[np.ndarray]
    """pieces[src]: (n, 6) int64 (PIECE_COLUMNS) for is_causal = True."""
    recv_rows: list[np.ndarray]
    """recv_rows[src]: flat rows of src's K/V this rank reads (empty for src == rank)."""
    send_rows: list[np.ndarray]
    """send_rows[dst]: flat rows of this rank's K/V that dst reads (empty for dst == rank)."""
    pair_rows: np.ndarray
    """(R, R) int64: rows rank r reads of rank s's K/V (0 on the diagonal): which shifts carry anything."""
    varlen: list[list[HostCall]] = field(default_factory=list)
    """varlen[src]: the CUDA varlen calls of pieces[src] (kernel_varlen.py), their indices moved with the rows."""
    device_rows: dict = field(default_factory=dict)
    device_calls: dict = field(default_factory=dict)
    """{device: varlen calls per source on that device}, set by `to`: the first layer copies nothing to the GPU."""

    @classmethod
    def build(cls, ids: np.ndarray, positions: np.ndarray, rank: int, varlen: bool = True) -> "RankPlan":
        """`varlen`: also plan the CUDA varlen calls of every source's pieces (a CPU run has no use for them)."""
        ranks, _, local_len = ids.shape
        seg = Segments.of(ids, positions)
        read = readers(seg, ranks, True)
        read[seg.rank, np.arange(seg.rank.size)] = False  # a rank's own rows are not exchanged
        pair_rows = np.zeros((ranks, ranks), dtype=np.int64)
        lengths = seg.end - seg.start
        for r in range(ranks):
            pair_rows[r] = np.bincount(seg.rank, weights=lengths * read[r], minlength=ranks).astype(np.int64)
        mine = seg.rank == rank
        recv = [rows_of(seg, np.flatnonzero(read[rank] & (seg.rank == s)), local_len) for s in range(ranks)]
        send = [rows_of(seg, np.flatnonzero(read[d] & mine), local_len) for d in range(ranks)]
        pieces = [pieces_between(seg, rank, s, True) for s in range(ranks)]
        calls = [host_calls(p.tolist()) for p in pieces] if varlen else []
        return cls(ranks, rank, pieces, recv, send, pair_rows, calls)

    def _int64_parts(self) -> list[np.ndarray]:
        return self.recv_rows + self.send_rows + [a for calls in self.varlen for c in calls for a in c.index_parts]

    def _int32_parts(self) -> list[np.ndarray]:
        return [a for calls in self.varlen for c in calls for a in (c.cum_q, c.cum_k)]

    @property
    def flat_rows(self) -> torch.Tensor:
        """Every receive then send row list, then the varlen calls' indices, in one int64 tensor (made once, in the
        worker; pinned with the batch)."""
        if "flat" not in self.device_rows:
            self.device_rows["flat"] = torch.from_numpy(np.concatenate(self._int64_parts()).astype(np.int64))
        return self.device_rows["flat"]

    @property
    def flat_offsets(self) -> torch.Tensor:
        """The varlen calls' int32 sequence offsets in one tensor (made once, in the worker; pinned with the batch)."""
        if "flat32" not in self.device_rows:
            parts = self._int32_parts()
            self.device_rows["flat32"] = torch.from_numpy(
                np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32))
        return self.device_rows["flat32"]

    def pin_memory(self) -> "RankPlan":
        self.device_rows["flat"] = self.flat_rows.pin_memory()
        self.device_rows["flat32"] = self.flat_offsets.pin_memory()
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RankPlan":
        """The exchange rows and the varlen calls' indices as device tensors, in two host-to-device copies (views
        into them afterwards)."""
        moved = self.flat_rows.to(device, non_blocking=non_blocking)
        moved32 = self.flat_offsets.to(device, non_blocking=non_blocking)
        views64, views32 = _views(moved, self._int64_parts()), _views(moved32, self._int32_parts())
        plan = RankPlan(self.ranks, self.rank, self.pieces, self.recv_rows, self.send_rows, self.pair_rows,
                        self.varlen)
        key = str(moved.device)
        plan.device_rows[key] = (views64[:self.ranks], views64[self.ranks:2 * self.ranks])
        calls, at, at32 = [], 2 * self.ranks, 0
        for host in self.varlen:
            calls.append([])
            for call in host:
                calls[-1].append(call.on_device(tuple(views64[at:at + 4]), tuple(views32[at32:at32 + 2])))
                at, at32 = at + 4, at32 + 2
        if self.varlen:
            plan.device_calls[key] = calls
        return plan


def _views(flat: torch.Tensor, parts: list[np.ndarray]) -> list[torch.Tensor]:
    """Consecutive views of `flat`, one per part, with the parts' sizes."""
    views, at = [], 0
    for part in parts:
        views.append(flat[at:at + part.size])
        at += part.size
    return views


@dataclass
class BatchPlan:
    """Everything the host decides about one micro-batch of the documents layout, made before the step: every
    rank's positions and ids (host) and this rank's `RankPlan` for the variant that runs (ring / all-gather over the
    P ranks, or Ulysses over the concatenated sequence); hybrid keeps planning its ring shards from the host ids."""
    positions: torch.Tensor
    """(P, B, S / P) int64 host: the global positions each rank holds of each row."""
    per_rank_ids: torch.Tensor
    """(P, B, S / P) host document ids of every rank's shard."""
    cp_rank: int
    ring: RankPlan | None = None
    ulysses: RankPlan | None = None
    rank_positions: torch.Tensor | None = None
    """This rank's (B, S / P) positions on the run's device (set by `to`)."""

    @classmethod
    def build(cls, document_ids: np.ndarray, cp_size: int, cp_rank: int, cp_impl: str = "ring",
              varlen: bool = True) -> "BatchPlan":
        """From (B, S) numpy ids: the layout (plan_layout.plan_row per row) and the variant's rank plan (with the
        CUDA varlen calls' indices when `varlen`)."""
        positions = np.stack([plan_row(row, cp_size) for row in document_ids], axis=1)
        ids = np.take_along_axis(document_ids[None], positions, axis=2)
        plan = cls(torch.from_numpy(positions), torch.from_numpy(ids), cp_rank)
        if cp_impl in ("ring", "allgather", "auto"):
            plan.ring = RankPlan.build(ids, positions, cp_rank, varlen)
        elif cp_impl == "ulysses":
            concat = lambda x: np.concatenate(list(x), axis=1)[None]  # noqa: E731 (rank order, one shard)
            plan.ulysses = RankPlan.build(concat(ids), concat(positions), 0, varlen)
        for rank_plan in (plan.ring, plan.ulysses):
            if rank_plan is not None:
                rank_plan.flat_rows  # noqa: B018 (made here, in the worker, not on the training thread)
                rank_plan.flat_offsets  # noqa: B018
        return plan

    def pin_memory(self) -> "BatchPlan":
        """Called by the DataLoader's pin-memory thread: page-locks the positions for a non_blocking copy."""
        self.positions = self.positions.pin_memory()
        for plan in (self.ring, self.ulysses):
            if plan is not None:
                plan.pin_memory()
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "BatchPlan":
        """This rank's positions and exchange rows on `device` (host-to-device copies only, no sync)."""
        moved = BatchPlan(self.positions, self.per_rank_ids, self.cp_rank,
                          self.ring.to(device, non_blocking) if self.ring is not None else None,
                          self.ulysses.to(device, non_blocking) if self.ulysses is not None else None)
        moved.rank_positions = self.positions[self.cp_rank].to(device, non_blocking=non_blocking)
        return moved


@dataclass(frozen=True)
class HostDocumentIds:
    """A fixed layout's batch plan (zigzag, contiguous, striped with document masking, any CP variant): the batch's
    full (B, S) document ids, kept on the host. Those layouts place tokens by position alone, so there is nothing
    else to plan ahead; but every rank cuts its attention pieces from the ids of every rank, and read from the
    device that was one device-to-host copy per micro-step (a GPU idling). Made by the data workers from the numpy
    ids (training/batch_plans.py); moving the batch leaves it on the host, where the step reads it."""
    ids: torch.Tensor

    def pin_memory(self) -> "HostDocumentIds":
        return self  # read on the host only: never copied to the device

    def to(self, device, non_blocking: bool = False) -> "HostDocumentIds":
        return self
