"""Weighted mixtures of sources, interleaved deterministically so each source's share of rows is exact.

Rows of every source have the same length, so shares of rows are shares of tokens. The global row stream is cut into
blocks of `block_rows` rows; in each block source s gets `counts[s]` rows (its weight times the block, rounded by
largest remainder so the counts add up), spread through the block by the rule Megatron's blended datasets use (the
next row goes to the source furthest behind its target share). Global row g is therefore a pure function of g: any
data-parallel degree, a resume, and a stage with another mix (its own `MixtureRows`) index the same stream.

Inside a source, its k-th row of the mixture is row `permutation(seed, source, epoch)[k % rows]` of that source's
packed rows: every source is shuffled per epoch of its own, and a small source repeats while a large one is still in
its first pass, which is what a weight means.
"""
from __future__ import annotations

import numpy as np

from config import RecipeError

DEFAULT_BLOCK_ROWS = 4096
_SOURCE_SHUFFLE_STREAM = 13


def block_counts(weights: list[float], block_rows: int) -> np.ndarray:
    """Rows per source in one block: weights x block, rounded by largest remainder (the counts sum to the block)."""
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    exact = shares * block_rows
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:block_rows - int(counts.sum())]] += 1
    return counts


def interleave(counts: np.ndarray) -> np.ndarray:
    """The source of each row of a block: always the source with the largest deficit against its target share."""
    total = int(counts.sum())
    taken = np.zeros(len(counts), dtype=np.int64)
    sources = np.empty(total, dtype=np.int64)
    for row in range(total):
        deficit = counts * (row + 1) / total - taken
        deficit[taken >= counts] = -np.inf
        chosen = int(np.argmax(deficit))
        sources[row] = chosen
        taken[chosen] += 1
    return sources


def check_weights(names: list[str], weights: list[float], where: str) -> None:
    for name, weight in zip(names, weights):
        if not np.isfinite(weight) or weight < 0:
            raise RecipeError(f"{where}: source '{name}' has weight {weight}; weights must be >= 0 (a share of the "
                              f"tokens seen).")
    if not sum(weights) > 0:
        raise RecipeError(f"{where}: every source weight is 0; give at least one source a positive weight.")


class BlockPlan:
    """Which source each row of the endless stream comes from, and its rank among that source's rows."""

    def __init__(self, weights: list[float], block_rows: int = DEFAULT_BLOCK_ROWS):
        self.counts = block_counts(weights, block_rows)
        self.block_sources = interleave(self.counts)
        self.rank_in_source = np.zeros(len(self.block_sources), dtype=np.int64)
        seen = np.zeros(len(self.counts), dtype=np.int64)
        for row, source in enumerate(self.block_sources):
            self.rank_in_source[row] = seen[source]
            seen[source] += 1

    def place(self, global_row: int) -> tuple[int, int]:
        """(source, k): global row `global_row` is the k-th row the mixture takes from that source."""
        block, offset = divmod(int(global_row), len(self.block_sources))
        source = int(self.block_sources[offset])
        return source, block * int(self.counts[source]) + int(self.rank_in_source[offset])

    def rows_per_source(self, start: int, stop: int) -> np.ndarray:
        """How many of global rows [start, stop) each source supplies (exact, without visiting the rows)."""
        return self._rows_before(stop) - self._rows_before(start)

    def _rows_before(self, row: int) -> np.ndarray:
        block, offset = divmod(int(row), len(self.block_sources))
        return block * self.counts + np.bincount(self.block_sources[:offset], minlength=len(self.counts))


class MixtureRows:
    """One endless row stream over several sources' packed rows, indexed by global row number (`row_at`)."""

    needs_shuffle = False  # rows are placed by the block plan and shuffled per source

    def __init__(self, names: list[str], sources: list, weights: list[float], *, seed: int,
                 block_rows: int = DEFAULT_BLOCK_ROWS, where: str = "data.sources"):
        check_weights(names, weights, where)
        self.names = list(names)
        self.sources = list(sources)
        self.seed = seed
        self.plan = BlockPlan(weights, block_rows)
        first = self.sources[0]
        self.seq_len, self.document_masking = first.seq_len, first.document_masking
        self.num_rows = 1 << 62  # endless: the loader indexes with row_at
        self.corpus_tokens = sum(s.corpus_tokens for s in self.sources)
        self.num_documents = sum(s.num_documents for s in self.sources)
        self.repeated = False
        self._permutations: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens of one pass over every source's rows (the mixture itself has no end)."""
        return sum(s.tokens_per_epoch for s in self.sources)

    def locate(self, global_row: int) -> tuple[int, int]:
        """(source index, row of that source's packed rows) of global row `global_row`."""
        source, k = self.plan.place(global_row)
        rows = self.sources[source].num_rows
        epoch, index = divmod(k, rows)
        cached = self._permutations.get(source)
        if cached is None or cached[0] != epoch:
            order = np.random.default_rng([_SOURCE_SHUFFLE_STREAM, self.seed, source, epoch]).permutation(rows)
            cached = self._permutations[source] = (epoch, order)
        return source, int(cached[1][index])

    def row_at(self, global_row: int) -> dict[str, np.ndarray]:
        source, row = self.locate(global_row)
        return self.sources[source].row_fields(row)
