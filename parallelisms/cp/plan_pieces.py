"""Which part of a K/V block a rank computes at each ring step, derived from the load balancer's layout, and how
document masking cuts that part into pieces that need no mask at all.

At step s rank r holds the K/V block of rank src = (r - s) mod P. Causal cases (L = local length, c = L / 2):
- contiguous: src == r -> causal; src < r -> full; src > r -> nothing.
- zigzag:     src == r -> causal over the local 2c (positions increase in local order);
              src < r  -> all of Q against the first half of K/V;  src > r -> second half of Q against all of K/V.
              Every off-diagonal step is exactly half a block.
- striped:    src <= r -> causal (j <= i);  src > r -> strictly lower (j < i): Q[1:] against K/V[:-1], causal.
Non-causal: every step is the full block.

Documents: every layout keeps positions increasing in local order, so a packed document is a run of equal ids in a
shard. A block's visible region is then a union of (query run x key run) rectangles of one document, cut by the
task's causal triangle. `task_pieces` writes it as `Piece`s (batch rows, query rows, key rows, causal): full
rectangles and top-left causal squares, which every kernel computes without a mask; pieces are disjoint, so their
(out, lse) merge exactly. A (S x S) mask would cost 32 GiB per block at 128K tokens per rank; pieces cost O(runs) and
the work is the visible pairs. Rows that see nothing get no piece (out 0, lse -inf in the accumulator).

The "documents" layout (plan_layout.py) is planned per row, so no fixed block task describes it. Its pieces come
from position segments instead (runs of one document at consecutive global positions): two segments of one document
on different ranks hold disjoint position intervals, so a query segment sees a key segment whole (keys earlier),
not at all (keys later), or as a causal square (the same segment). `visible_rows` lists the K/V rows of a source
that a rank's pieces read: all the sparse ring (exchange_ring_sparse.py) sends.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from config.errors import Refusal
from parallelisms.cp.layouts import CONTIGUOUS, STRIPED, ZIGZAG, fixed_positions
from parallelisms.cp.plan_piece import FULL, BlockTask, Piece

def block_tasks(rank: int, src: int, cp_size: int, local_len: int, load_balancer: str,
                is_causal: bool) -> list[BlockTask]:
    if not is_causal:
        return [BlockTask(FULL, FULL, False)]
    if src == rank:
        return [BlockTask(FULL, FULL, True)]
    if load_balancer == CONTIGUOUS:
        return [BlockTask(FULL, FULL, False)] if src < rank else []
    if load_balancer == ZIGZAG:
        half = local_len // 2
        if src < rank:
            return [BlockTask(FULL, slice(0, half), False)]
        return [BlockTask(slice(half, local_len), FULL, False)]
    if load_balancer == STRIPED:
        if src < rank:
            return [BlockTask(FULL, FULL, True)]
        return [BlockTask(slice(1, local_len), slice(0, local_len - 1), True)] if local_len > 1 else []
    raise Refusal(f"unknown load balancer {load_balancer!r}")


Run = tuple[int, int, int]  # (document id, first local row, end local row)


def _real_host(ids: torch.Tensor) -> bool:
    """Ids in host memory that hold values (not the dry run's fake tensors)."""
    return ids.device.type == "cpu" and not isinstance(ids, FakeTensor)


def document_runs(ids: torch.Tensor) -> list[list[Run]]:
    """Per batch row, the runs of equal ids of a (B, L) host tensor, in local order."""
    runs = []
    for row in ids:
        starts = [0, *(torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()]
        ends = starts[1:] + [row.numel()]
        docs = row[starts].tolist()
        runs.append(list(zip(docs, starts, ends)))
    return runs


def _clip(runs: list[Run], lo: int, hi: int) -> list[Run]:
    """The runs cut to local rows [lo, hi), made relative to lo."""
    return [(d, max(a, lo) - lo, min(b, hi) - lo) for d, a, b in runs if a < hi and b > lo]


def _causal_pieces(a: int, b: int, c: int, d: int) -> list[tuple[int, int, int, int, bool]]:
    """Query run [a, b) x key run [c, d) of one document under j <= i (relative rows), as mask-free pieces: the keys
    strictly before the query run (a full rectangle), the shared rows (a causal square), and the keys of the shared
    rows seen by later queries (a full rectangle)."""
    out = []
    if c < min(d, a):
        out.append((a, b, c, min(d, a), False))
    s, e = max(c, a), min(d, b)
    if s < e:
        out.append((s, e, s, e, True))
        if e < b:
            out.append((e, b, s, e, False))
    return out


def _row_pieces(task: BlockTask, q_runs: list[Run], k_runs: list[Run], local_len: int):
    """(q start, q end, k start, k end, causal) in local rows of one batch row's visible pairs in `task`."""
    q0, q1, _ = task.q_rows.indices(local_len)
    k0, k1, _ = task.kv_rows.indices(local_len)
    keys: dict[int, list[tuple[int, int]]] = {}
    for doc, c, d in _clip(k_runs, k0, k1):
        keys.setdefault(doc, []).append((c, d))
    pieces = []
    for doc, a, b in _clip(q_runs, q0, q1):
        for c, d in keys.get(doc, ()):
            rel = _causal_pieces(a, b, c, d) if task.is_causal else [(a, b, c, d, False)]
            pieces += [(qa + q0, qb + q0, ka + k0, kb + k0, causal) for qa, qb, ka, kb, causal in rel]
    return pieces


def task_pieces(task: BlockTask, q_runs: list[list[Run]], k_runs: list[list[Run]], local_len: int) -> list[Piece]:
    """The mask-free pieces of `task` for every batch row, given the document runs of the query and K/V shards."""
    return [Piece(slice(row, row + 1), slice(qa, qb), slice(ka, kb), causal)
            for row, (qr, kr) in enumerate(zip(q_runs, k_runs))
            for qa, qb, ka, kb, causal in _row_pieces(task, qr, kr, local_len)]


def plain_pieces(tasks: list[BlockTask]) -> list[Piece]:
    """Without documents: one piece per task over every batch row."""
    return [Piece(FULL, t.q_rows, t.kv_rows, t.is_causal) for t in tasks]


Segment = tuple[int, int, int, int]  # (document id, first local row, end local row, first global position)


def position_segments(ids: torch.Tensor, positions: torch.Tensor) -> list[list[Segment]]:
    """Per batch row of host (B, L) ids and global positions: the runs of one document at consecutive positions."""
    segments = []
    for row_ids, row_pos in zip(ids, positions):
        breaks = (row_ids[1:] != row_ids[:-1]) | (row_pos[1:] != row_pos[:-1] + 1)
        starts = [0, *(torch.nonzero(breaks).flatten() + 1).tolist()]
        ends = starts[1:] + [row_ids.numel()]
        segments.append(list(zip(row_ids[starts].tolist(), starts, ends, row_pos[starts].tolist())))
    return segments


def segment_pieces(q_segs: list[list[Segment]], k_segs: list[list[Segment]], same_rank: bool,
                   is_causal: bool) -> list[Piece]:
    """The mask-free pieces of one rank's query segments against a source's key segments, row by row."""
    pieces = []
    for row, (qs, ks) in enumerate(zip(q_segs, k_segs)):
        keys: dict[int, list[Segment]] = {}
        for seg in ks:
            keys.setdefault(seg[0], []).append(seg)
        for doc, a, b, qpos in qs:
            for _, c, d, kpos in keys.get(doc, ()):
                if not is_causal or kpos + (d - c) <= qpos:
                    pieces.append(Piece(slice(row, row + 1), slice(a, b), slice(c, d), False))
                elif same_rank and kpos == qpos:
                    pieces.append(Piece(slice(row, row + 1), slice(a, b), slice(c, d), True))
    return pieces


class DocumentShards:
    """Every CP rank's document ids (B, L_local), so any rank can cut any K/V block it receives into pieces.

    The runs are read on the host once (one device sync) and the pieces of each (rank, source) are cached here, so
    every layer of a step reuses them (context_parallel builds one DocumentShards per batch)."""

    def __init__(self, per_rank: list[torch.Tensor], positions: torch.Tensor | None = None, rank_plan=None):
        self.per_rank = per_rank
        self.positions = positions  # (P, B, L) host positions of the "documents" layout, else None
        self.rank_plan = rank_plan  # plan_host.RankPlan made before the step (its rank's pieces and rows), or None
        self.concatenated_plan = None  # the same for Ulysses over the rank-ordered concatenation (exchange_ulysses.py)
        self._runs: list[list[list[Run]]] | None = None
        self._segments: list[list[list[Segment]]] | None = None
        self._pieces: dict = {}

    @classmethod
    def from_layout(cls, full_ids: torch.Tensor, layout) -> "DocumentShards":
        """Every rank's ids and positions under a DocumentLayout (the documents load balancer)."""
        return cls([layout.shard(full_ids, 1, r) for r in range(layout.cp_size)], layout.positions)

    @classmethod
    def from_plan(cls, plan) -> "DocumentShards":
        """From a plan_host.BatchPlan made before the step: host ids and positions, and its rank's pieces and rows
        (nothing is planned or read back from the device here)."""
        shards = cls(list(plan.per_rank_ids), plan.positions, plan.ring)
        shards.concatenated_plan = plan.ulysses
        return shards

    def cached(self, key, build):
        """A value derived from this batch's plan, built once and reused by every layer (ShiftPlan, RowsPlan)."""
        if key not in self._pieces:
            self._pieces[key] = build()
        return self._pieces[key]

    def _planned(self, rank: int, src: int, is_causal: bool) -> bool:
        return self.rank_plan is not None and is_causal and self.rank_plan.rank in (rank, src)

    def pair_rows(self, is_causal: bool) -> np.ndarray:
        """(P, P) int64 rows rank r reads of rank s's K/V (0 on the diagonal), from the plan when there is one."""
        if self.rank_plan is not None and is_causal:
            return self.rank_plan.pair_rows
        size = len(self.per_rank)
        return self.cached(("pair rows", is_causal), lambda: np.array(
            [[self.visible_rows(r, s, is_causal).numel() if r != s else 0 for s in range(size)]
             for r in range(size)], dtype=np.int64))

    def segments(self, rank: int) -> list[list[Segment]]:
        if self._segments is None:
            host = torch.stack(self.per_rank).cpu()
            self._segments = [position_segments(ids, pos) for ids, pos in zip(host, self.positions)]
        return self._segments[rank]

    def layout_pieces(self, rank: int, src: int, is_causal: bool) -> list[Piece]:
        """The pieces of `rank`'s queries against `src`'s keys under the documents layout (cached)."""
        key = ("layout", rank, src, is_causal)
        if key not in self._pieces and self._planned(rank, src, is_causal) and rank == self.rank_plan.rank:
            self._pieces[key] = [Piece(slice(b, b + 1), slice(q0, q1), slice(k0, k1), bool(c))
                                 for b, q0, q1, k0, k1, c in self.rank_plan.pieces[src].tolist()]
            self._pieces[("planned source", id(self._pieces[key]))] = src
        if key not in self._pieces:
            self._pieces[key] = segment_pieces(self.segments(rank), self.segments(src), rank == src, is_causal)
        return self._pieces[key]

    def planned_varlen_calls(self, pieces: list[Piece], device: torch.device) -> list | None:
        """The varlen calls of `pieces` moved to `device` with the batch's plan (plan_host.RankPlan.to), when these
        are the plan's pieces; None otherwise (kernel_calls then plans them at the first layer)."""
        src = self._pieces.get(("planned source", id(pieces)))
        moved = self.rank_plan.device_calls.get(str(device)) if self.rank_plan is not None else None
        return None if src is None or moved is None else moved[src]

    def visible_rows(self, rank: int, src: int, is_causal: bool) -> torch.Tensor:
        """Flat (batch * L + row) indices, increasing, of `src`'s K/V rows that `rank`'s pieces read (int64, host)."""
        key = ("rows", rank, src, is_causal)
        if key not in self._pieces and self._planned(rank, src, is_causal) and rank != src:
            plan = self.rank_plan
            rows = plan.recv_rows[src] if rank == plan.rank else plan.send_rows[rank]
            self._pieces[key] = torch.from_numpy(rows)
        if key not in self._pieces:
            batch, local_len = self.per_rank[src].shape
            seen = np.zeros(batch * local_len, dtype=bool)
            for p in self.layout_pieces(rank, src, is_causal):
                seen[p.batch.start * local_len + p.kv_rows.start:p.batch.start * local_len + p.kv_rows.stop] = True
            self._pieces[key] = torch.from_numpy(np.flatnonzero(seen))
        return self._pieces[key]

    def visible_rows_on(self, device: torch.device, rank: int, src: int, is_causal: bool) -> torch.Tensor:
        """`visible_rows` on `device`, copied there once per batch (every layer reuses it, no copy per call)."""
        key = ("rows on", str(device), rank, src, is_causal)
        moved = self.rank_plan.device_rows.get(str(device)) if self._planned(rank, src, is_causal) else None
        if key not in self._pieces and moved is not None and rank != src:  # copied with the batch (non_blocking)
            self._pieces[key] = moved[0][src] if rank == self.rank_plan.rank else moved[1][rank]
        if key not in self._pieces:
            self._pieces[key] = self.visible_rows(rank, src, is_causal).to(device)
        return self._pieces[key]

    @classmethod
    def from_full(cls, full_ids: torch.Tensor, cp_size: int, load_balancer: str) -> "DocumentShards":
        """Every rank's ids under a fixed layout. Ids on the host (the batch plan's, plan_host.HostDocumentIds, or a
        CPU run's) are cut as real tensors even inside the dry run's fake mode (host integers, as exchange_alltoall's
        plans), so that `runs` reads them without a device."""
        seq_len = full_ids.size(1)
        with unset_fake_temporarily() if _real_host(full_ids) else contextlib.nullcontext():
            return cls([full_ids.index_select(1, fixed_positions(seq_len, r, cp_size, load_balancer,
                                                                  device=full_ids.device))
                        for r in range(cp_size)])

    def runs(self, rank: int) -> list[list[Run]]:
        if self._runs is None:
            if all(_real_host(ids) for ids in self.per_rank):  # a plan's host ids: no device read at all
                with unset_fake_temporarily():
                    self._runs = [document_runs(ids) for ids in self.per_rank]
            else:
                host = torch.stack(self.per_rank).cpu()  # one transfer for every rank
                self._runs = [document_runs(ids) for ids in host]
        return self._runs[rank]

    def pieces(self, rank: int, src: int, tasks: list[BlockTask], local_len: int) -> list[Piece]:
        key = (rank, src, local_len, tuple((t.q_rows.indices(local_len), t.kv_rows.indices(local_len), t.is_causal)
                                           for t in tasks))  # slices are not hashable before Python 3.12
        if key not in self._pieces:
            q_runs, k_runs = self.runs(rank), self.runs(src)
            self._pieces[key] = [p for t in tasks for p in task_pieces(t, q_runs, k_runs, local_len)]
        return self._pieces[key]
