"""Where the pieces' results meet: `LseAccumulator` merges (out, lse) pieces through their log-sum-exp in float32 at
their (batch rows, query rows); `RowBuffer` accumulates the backward's dQ / dK / dV the same way."""
from __future__ import annotations

import numpy as np
import torch

from parallelisms.cp.plan_piece import FULL, Piece


def covers_all_rows(piece: Piece) -> bool:
    return piece.batch == FULL and piece.q_rows == FULL and piece.kv_rows == FULL


def unwritten_runs(written: np.ndarray) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of the runs of False in a host (B, L) bool array, row by row in order. One pass over
    the whole array (a loop over rows cost ~4 ms per call at 48 rows: 9% of a 2-rank CP passkey run's CPU)."""
    if written.all():
        return []
    padded = np.ones((written.shape[0], written.shape[1] + 2), dtype=np.int8)  # written on both sides of each row
    padded[:, 1:-1] = written
    steps = np.diff(padded, axis=1)  # -1 where a run of False starts, +1 just past its end
    rows, starts = np.nonzero(steps == -1)
    _, ends = np.nonzero(steps == 1)
    return list(zip(rows.tolist(), starts.tolist(), ends.tolist()))


def float32_rows(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An uninitialised float32 (B, H, L, ...) tensor laid out in memory like `like`: (B, L, H, ...) when `like` is
    the model's (B, L, H, D) projection seen as (B, H, L, D), as the attention kernels lay out their outputs and
    gradients. The model's transpose back to (B, L, H * D) is then a view, not a copy (nor a second saved tensor)."""
    if like.dim() == 4 and len(shape) >= 3 and like.stride(1) < like.stride(2):
        order = (shape[0], shape[2], shape[1], *shape[3:])
        return torch.empty(order, dtype=torch.float32, device=like.device).transpose(1, 2)
    return torch.empty(shape, dtype=torch.float32, device=like.device)


class RowBuffer:
    """A float32 (B, H, L, ...) buffer written piece by piece at (batch rows, sequence rows) and left uninitialised
    until then: a row's first piece is copied in, later ones add to it, rows no piece wrote get `fill` at the end.
    With documents nearly every row has exactly one piece, so one copy replaces a fill pass plus an add pass. Which
    rows were written is kept on the host in numpy (no device sync, and nothing the dry run's fake tensors would
    turn into shapes without values). Laid out in memory like `like` (`float32_rows`)."""

    def __init__(self, like: torch.Tensor, shape, fill: float):
        self.like, self.shape, self.fill = like, tuple(shape), fill
        self.data: torch.Tensor | None = None
        self.written = np.zeros((self.shape[0], self.shape[2]), dtype=bool)
        self.filled = False  # every row not written holds `fill` (writers by row index need that)

    def view(self, batch: slice, rows: slice) -> torch.Tensor:
        return self.data[batch, :, rows]

    def claim(self, batch: slice, rows: slice) -> bool:
        """Marks the rows written; True when none was before (the caller copies), else the caller accumulates (rows
        of the region not written before are set to `fill` first)."""
        if self.data is None:
            self.data = float32_rows(self.like, self.shape)
        region = self.written[batch, rows]
        new = not bool(region.any())
        if not new and not self.filled and not bool(region.all()):
            b0, r0 = batch.indices(self.shape[0])[0], rows.indices(self.shape[2])[0]
            for b, a, e in unwritten_runs(region):
                self.data[b0 + b, :, r0 + a:r0 + e].fill_(self.fill)
        region[...] = True
        return new

    def ensure_filled(self) -> None:
        """Rows not written yet hold `fill` from now on (one kernel when the buffer is new): the varlen blocks
        (kernel_varlen.py) merge by row index, so they cannot fill the rows a piece touches first."""
        if self.filled:
            return
        if self.data is None:
            self.data = float32_rows(self.like, self.shape).fill_(self.fill)
        else:
            for b, a, e in unwritten_runs(self.written):
                self.data[b, :, a:e].fill_(self.fill)
        self.filled = True

    def adopt(self, value: torch.Tensor) -> None:
        """The whole buffer at once (a piece over every row, written first)."""
        self.data = value
        self.written[...] = True

    def add(self, grad: torch.Tensor, batch: slice, rows: slice) -> None:
        if self.data is None and batch == FULL and rows == FULL:
            self.adopt(grad.float())
        elif self.claim(batch, rows):
            self.view(batch, rows).copy_(grad)
        else:
            self.view(batch, rows).add_(grad)

    def finish(self) -> torch.Tensor:
        if self.data is None:
            return float32_rows(self.like, self.shape).fill_(self.fill)
        if self.filled:
            return self.data
        for b, a, e in unwritten_runs(self.written):
            self.data[b, :, a:e].fill_(self.fill)
        return self.data


class LseAccumulator:
    """The float32 output and log-sum-exp of this rank's queries, merged piece by piece (a row's first piece is
    copied in: see RowBuffer)."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        self.q = q
        self.out = RowBuffer(q, q.shape[:-1] + (v.size(-1),), 0.0)
        self.lse = RowBuffer(q, q.shape[:-1], float("-inf"))

    def merge(self, out: torch.Tensor, lse: torch.Tensor, piece: Piece) -> None:
        """Adds a piece's (out, lse) into the accumulators at the piece's batch and query rows, in place."""
        if self.out.data is None and covers_all_rows(piece):
            # Copies: the kernel outputs may be cached by selective activation checkpointing, and later merges
            # update the accumulators in place.
            self.out.adopt(out.to(torch.float32, copy=True))
            self.lse.adopt(lse.to(torch.float32, copy=True))
            return
        b, rows = piece.batch, piece.q_rows
        new = self.out.claim(b, rows)
        self.lse.claim(b, rows)
        a_out, a_lse = self.out.view(b, rows), self.lse.view(b, rows)
        if new:
            a_out.copy_(out)
            a_lse.copy_(lse)
            return
        lse = lse.float()
        new_lse = torch.logaddexp(a_lse, lse)
        ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)  # rows nobody has seen yet stay at zero
        a_out.mul_(torch.exp(a_lse - ref).unsqueeze(-1)).addcmul_(out.float(), torch.exp(lse - ref).unsqueeze(-1))
        a_lse.copy_(new_lse)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output in the query dtype, float32 lse); rows no piece reached get 0 and -inf (with documents, rows
        that see nothing in any block)."""
        return self.out.finish().to(self.q.dtype), self.lse.finish()


def lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Rows that saw nothing get lse +inf, so the kernels' exp(score - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))
