"""data.loader: the global row stream, its split over dp ranks, determinism, and resuming at another dp size."""
import numpy as np
import pytest
import torch

from data.loader import build_dataloader
from tests.data.test_packing import _brute_force_row
from config import RecipeError

SEQ_LEN = 8
FIELDS = ("input_ids", "labels", "position_ids", "document_ids")


class NumberedTokenizer:
    """Document "i n" becomes n tokens 1 + 1000*i + j: every token (bar EOS) is unique, so rows identify themselves."""

    eos_id = 0

    def encode(self, text):
        doc, length = map(int, text.split())
        return [1 + 1000 * doc + j for j in range(length)]


LENGTHS = [int(n) for n in np.random.default_rng(123).integers(3, 30, size=20)]
DOCUMENTS = [f"{i} {n}" for i, n in enumerate(LENGTHS)]


def _loader(**overrides):
    kwargs = dict(seq_len=SEQ_LEN, local_batch_size=1, dp_rank=0, dp_size=1, seed=5)
    kwargs.update(overrides)
    return build_dataloader(NumberedTokenizer(), DOCUMENTS, **kwargs)


def _take(loader, steps):
    iterator = iter(loader)
    return [next(iterator) for _ in range(steps)]


def _rows(batches):
    """The batches' rows as (seq_len + 1)-token tuples, in order."""
    out = []
    for batch in batches:
        for inputs, labels in zip(batch["input_ids"], batch["labels"]):
            out.append(tuple(inputs.tolist()) + (int(labels[-1]),))
    return out


def _all_packed_rows():
    """Every row of one epoch, rebuilt without the loader: the stream a fresh single-rank loader packs."""
    packed = _loader().packed
    stream = packed.stream.tolist()
    return [tuple(stream[r * (SEQ_LEN + 1):(r + 1) * (SEQ_LEN + 1)]) for r in range(packed.num_rows)]


def test_batches_are_int64_and_match_the_brute_force_row():
    for masking in (False, True):
        batches = _take(_loader(local_batch_size=3, document_masking=masking), 4)
        for batch in batches:
            assert set(batch) == set(FIELDS)
            for name in FIELDS:
                assert batch[name].dtype == torch.int64 and batch[name].shape == (3, SEQ_LEN)
        for batch in batches:
            for i, row in enumerate(_rows([batch])):
                expected = _brute_force_row(list(row), SEQ_LEN, masking, eos=NumberedTokenizer.eos_id)
                for name in FIELDS:
                    assert batch[name][i].tolist() == expected[name], name


def test_each_epoch_visits_every_row_once_in_a_new_order():
    all_rows = _all_packed_rows()
    n = len(all_rows)
    assert n == sum(length + 1 for length in LENGTHS) // (SEQ_LEN + 1)
    stream = _rows(_take(_loader(), 2 * n))
    first, second = stream[:n], stream[n:]
    assert sorted(first) == sorted(all_rows) and len(set(first)) == n
    assert sorted(second) == sorted(all_rows)
    assert first != second


def test_dp_ranks_partition_the_global_batches():
    steps, dp_size, local = 5, 4, 2
    per_rank = [_rows(_take(_loader(local_batch_size=local, dp_rank=r, dp_size=dp_size), steps))
                for r in range(dp_size)]
    single_big = _rows(_take(_loader(local_batch_size=local * dp_size), steps))
    global_stream = _rows(_take(_loader(), steps * local * dp_size))  # one row per step
    for b in range(steps):
        union = [row for r in range(dp_size) for row in per_rank[r][b * local:(b + 1) * local]]
        assert union == single_big[b * local * dp_size:(b + 1) * local * dp_size]
        assert union == global_stream[b * local * dp_size:(b + 1) * local * dp_size]


def test_same_seed_same_stream_other_seed_differs():
    a = _take(_loader(local_batch_size=4, seed=7), 3)
    b = _take(_loader(local_batch_size=4, seed=7), 3)
    c = _take(_loader(local_batch_size=4, seed=8), 3)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in FIELDS)
    assert _rows(a) != _rows(c)


@pytest.mark.parametrize("new_local_batch", [2, 3])
def test_resume_on_fewer_dp_ranks_continues_the_global_stream(new_local_batch):
    old_dp, old_local, old_steps = 4, 2, 3
    old_loaders = [_loader(local_batch_size=old_local, dp_rank=r, dp_size=old_dp) for r in range(old_dp)]
    old_rows = [_rows(_take(loader, old_steps)) for loader in old_loaders]
    states = [loader.state_dict() for loader in old_loaders]
    assert all(state["global_rows_consumed"] == old_dp * old_local * old_steps for state in states)

    new_dp, new_steps = 2, 5
    new_rows = []
    for r in range(new_dp):
        loader = _loader(local_batch_size=new_local_batch, dp_rank=r, dp_size=new_dp)
        loader.load_state_dict(states[0])
        new_rows.append(_rows(_take(loader, new_steps)))

    consumed = []
    for b in range(old_steps):
        consumed += [row for r in range(old_dp) for row in old_rows[r][b * old_local:(b + 1) * old_local]]
    for b in range(new_steps):
        consumed += [row for r in range(new_dp) for row in new_rows[r][b * new_local_batch:(b + 1) * new_local_batch]]
    uninterrupted = _rows(_take(_loader(), len(consumed)))
    assert consumed == uninterrupted  # no repeat, no skip, across an epoch boundary too
    assert len(consumed) > len(_all_packed_rows())


def test_state_counts_only_batches_handed_out_with_workers():
    loader = _loader(local_batch_size=2, num_workers=2)
    first = _take(loader, 3)  # the workers prefetch further than this
    assert loader.state_dict()["global_rows_consumed"] == 6
    resumed = _loader(local_batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert _rows(first + _take(resumed, 2)) == _rows(_take(_loader(local_batch_size=2), 5))


def test_state_before_iterating_and_empty_state():
    loader = _loader(local_batch_size=2)
    assert loader.state_dict()["global_rows_consumed"] == 0
    loader.load_state_dict({})
    assert _rows(_take(loader, 1)) == _rows(_take(_loader(local_batch_size=2), 1))
    assert _rows(_take(loader, 1)) == _rows(_take(_loader(local_batch_size=2), 2))[2:]  # iter() continues


def test_counts_and_errors():
    loader = _loader(local_batch_size=2)
    total = sum(length + 1 for length in LENGTHS)
    assert loader.num_tokens == total
    assert loader.rows_per_epoch == total // (SEQ_LEN + 1)
    assert loader.tokens_per_epoch == loader.rows_per_epoch * SEQ_LEN
    with pytest.raises(RecipeError, match="training.seq_len"):
        _loader(seq_len=1)
    with pytest.raises(RecipeError, match="training.local_batch_size"):
        _loader(local_batch_size=0)


def test_tiny_corpus_at_long_seq_len_still_yields_batches():
    loader = build_dataloader(NumberedTokenizer(), ["0 3", "1 2"], seq_len=64, local_batch_size=2, dp_rank=0,
                              dp_size=1, seed=0, document_masking=True)
    (batch,) = _take(loader, 1)
    assert loader.rows_per_epoch == 1 and batch["input_ids"].shape == (2, 64)
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])  # the same single row, twice
