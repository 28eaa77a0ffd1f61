"""Plans made on ranks with different float rounding cannot differ (issue 27, item 4): the documents layout planner
works in integer units, so summing its work in any order gives the same layout. The test sums every reduction of the
planner in a shuffled order (what a CPU with other SIMD widths or another BLAS does) and compares the layouts."""
import functools
import operator

import numpy as np
import pytest

from harness.cp_balance_counts import MIXES, packed_row
from parallelisms.cp import plan_layout as document_layout
from parallelisms.cp.plan_layout import plan_row

pytestmark = pytest.mark.timeout(120)


def shuffled_total(rng: np.random.Generator):
    """A drop-in for the planner's `_total` that adds the elements one by one, in a random order, in their own dtype
    (float64 rounding would depend on that order; int64 cannot)."""
    def total(values: np.ndarray, axis: int | None = None):
        if axis is None:
            flat = values.reshape(-1)
            return functools.reduce(operator.add, flat[rng.permutation(flat.size)], values.dtype.type(0))
        moved = np.moveaxis(values, axis, -1)
        rows = moved.reshape(-1, moved.shape[-1])
        sums = [functools.reduce(operator.add, row[rng.permutation(row.size)], values.dtype.type(0)) for row in rows]
        return np.array(sums, dtype=values.dtype).reshape(moved.shape[:-1])
    return total


def near_tie_rows(seq: int) -> list[np.ndarray]:
    """Rows in which several ranks tie in work: a long document split over every rank (len^2 / P^2 per rank and
    shift, which float64 cannot hold exactly when P is not a power of two) and many documents of equal length."""
    rows = []
    for long_share, n_docs in ((0.41, 12), (0.5, 9), (0.37, 20), (0.6, 7)):
        long = int(seq * long_share) | 1
        lengths = np.full(n_docs, (seq - long) // n_docs)
        lengths = np.concatenate([[long], lengths])
        lengths[-1] += seq - lengths.sum()
        rows.append(np.repeat(np.arange(lengths.size), lengths))
    return rows


@pytest.mark.parametrize("cp", [3, 5, 6, 12])
def test_shuffled_summation_order_gives_the_same_layout(monkeypatch, cp):
    seq = 7680  # divisible by 2 x every cp above
    rng = np.random.default_rng(cp)
    rows = near_tie_rows(seq) + [packed_row(mix, seq, rng).numpy() for mix in MIXES.values() for _ in range(3)]
    reference = [plan_row(ids, cp) for ids in rows]
    for trial in range(3):
        monkeypatch.setattr(document_layout, "_total", shuffled_total(np.random.default_rng([cp, trial])))
        for ids, expected in zip(rows, reference):
            assert np.array_equal(plan_row(ids, cp), expected)
