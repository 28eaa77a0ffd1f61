"""Data-parallel placement (data/placement.py) checked against the packed rows it starts from: every token exactly
once, every row exactly seq_len, each token's label and the keys it may see unchanged (a brute-force mask), the
same plan on every call."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.packing import FIELDS, row_fields
from data.placement import StepPlacement, StepSlots, place_step, plan_segments, plan_whole_rows, segments

EOS = 0


def step_rows(lengths: list[int], slots: StepSlots) -> tuple[dict, np.ndarray]:
    """Rows packed like data/packing.py from documents of `lengths` (EOS included), with unique token values so
    that each token can be followed; returns the rows and the token stream."""
    stream = np.arange(1, sum(lengths) + 1, dtype=np.int64)
    stream[np.cumsum(lengths) - 1] = EOS
    need = slots.count * (slots.seq_len + 1)
    assert len(stream) >= need
    rows = [row_fields(r, EOS, document_masking=True) for r in stream[:need].reshape(slots.count, -1)]
    return {name: np.stack([r[name] for r in rows]) for name in FIELDS}, stream


def random_lengths(rng, slots: StepSlots, mean: float) -> list[int]:
    lengths, need = [], slots.count * (slots.seq_len + 1)
    while sum(lengths) < need:
        lengths.append(max(1, int(rng.lognormal(np.log(mean), 1.0))))
    return lengths


def visible_keys(fields: dict) -> dict[int, frozenset]:
    """Brute force: for every non-EOS input token, the set of input tokens it may attend to (same document id,
    not later), from the full (S, S) mask of its row."""
    seen = {}
    for ids, docs in zip(fields["input_ids"], fields["document_ids"]):
        mask = (docs[:, None] == docs[None, :]) & np.tril(np.ones((len(ids), len(ids)), dtype=bool))
        for q in range(len(ids)):
            if ids[q] != EOS:
                seen[int(ids[q])] = frozenset(int(k) for k in ids[mask[q]])
    return seen


@pytest.mark.parametrize("micro_steps, dp, local_rows, mean", [(2, 2, 1, 8.0), (2, 3, 2, 6.0), (1, 4, 1, 6.0)])
def test_placement_keeps_every_token_its_label_and_what_it_sees(micro_steps, dp, local_rows, mean):
    slots = StepSlots(micro_steps, dp, local_rows, seq_len=48)
    fields, stream = step_rows(random_lengths(np.random.default_rng(micro_steps * dp), slots, mean), slots)
    placed = place_step(fields, slots)
    assert not placed.whole_rows
    out = placed.fields
    assert all(out[name].shape == (slots.count, 48) for name in FIELDS)
    key = lambda f: sorted(zip(f["input_ids"].ravel(), f["labels"].ravel(), f["position_ids"].ravel()))  # noqa: E731
    assert key(out) == key(fields)  # every (token, label, position) exactly once
    successor = dict(zip(stream[:-1].tolist(), stream[1:].tolist()))
    non_eos = out["input_ids"] != EOS
    assert all(successor[int(t)] == int(lab) for t, lab in zip(out["input_ids"][non_eos], out["labels"][non_eos]))
    assert visible_keys(out) == visible_keys(fields)
    for row_ids, row_pos in zip(out["document_ids"], out["position_ids"]):  # ids renumbered 0, 1, ... per row
        starts = np.flatnonzero(np.diff(row_ids, prepend=-1))
        assert list(row_ids[starts]) == list(range(len(starts))) and (row_pos[starts] == 0).all()
    assert any((out["input_ids"][i] != fields["input_ids"][i]).any() for i in range(slots.count))


def test_placement_is_deterministic_and_evens_out_the_busiest_rank():
    slots = StepSlots(2, 4, 1, seq_len=256)
    rng = np.random.default_rng(3)
    lengths = random_lengths(rng, slots, 20.0)
    lengths[5] = 150  # one long document, the step's heaviest piece of work
    fields, _ = step_rows(lengths, slots)
    first, second = place_step(fields, slots), place_step(fields, slots)
    assert all(np.array_equal(first.fields[n], second.fields[n]) for n in FIELDS)

    def summed_busiest(positions):
        pairs = (positions + 1).sum(axis=1).reshape(slots.micro_steps, slots.dp_size)
        return pairs.max(axis=1).sum()
    assert summed_busiest(first.fields["position_ids"]) < summed_busiest(fields["position_ids"])


def test_segments_are_runs_of_one_document_id():
    row, start, length = segments(np.array([[0, 0, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1]]))
    assert row.tolist() == [0, 0, 0, 1, 1] and start.tolist() == [0, 2, 3, 0, 1]
    assert length.tolist() == [2, 1, 3, 1, 5]


def test_no_exact_fill_falls_back_to_whole_rows():
    """The planner is a heuristic: rows 3+3+2 / 4+4 lead it to 4+3 / 4+3 with 2 left over, so the step moves whole
    rows (still exact); 5+3 / 5+3 it refills."""
    assert plan_segments(np.array([5, 5, 3, 3]), num_slots=2, capacity=8) is not None
    assert plan_segments(np.array([3, 3, 2, 4, 4]), num_slots=2, capacity=8) is None
    slots = StepSlots(1, 2, 1, seq_len=8)
    fields = {name: np.zeros((2, 8), dtype=np.int64) for name in FIELDS}
    fields["document_ids"] = np.array([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]])
    fields["position_ids"] = np.array([[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]])
    fields["input_ids"] = np.arange(16).reshape(2, 8)
    placed = place_step(fields, slots)
    assert placed.whole_rows
    assert sorted(map(tuple, placed.fields["input_ids"])) == sorted(map(tuple, fields["input_ids"]))


def test_whole_rows_put_the_heaviest_rows_in_one_micro_step():
    slots = StepSlots(2, 2, 1, seq_len=4)
    slot = plan_whole_rows(np.array([1, 9, 2, 8]), slots)
    assert sorted(slot[[1, 3]]) == [0, 1] and sorted(slot[[0, 2]]) == [2, 3]


def test_every_dp_rank_takes_its_own_slots_of_the_same_plan():
    slots = StepSlots(2, 2, 1, seq_len=32)
    fields, _ = step_rows(random_lengths(np.random.default_rng(7), slots, 10.0), slots)
    batches = [{n: torch.from_numpy(fields[n][m * 2:(m + 1) * 2]) for n in FIELDS} for m in range(2)]
    taken = [StepPlacement(slots, rank).take(iter(batches)) for rank in range(2)]
    expected = place_step(fields, slots).fields
    for rank in range(2):
        for m in range(2):
            assert torch.equal(taken[rank][m]["input_ids"], torch.from_numpy(expected["input_ids"][slots.of(m, rank)]))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_step_reads_the_same_rows_whatever_the_dp_degree(dp):
    """The trainer's loader under placement (built for one rank, dp x local rows a micro-step, as
    training/build.py builds it) with the global batch held at 4 rows: every dp degree's ranks together train on
    the tokens of the same 4 loader rows each step, and the loader's checkpoint count is the same."""
    from data.loader import build_dataloader
    from data.packing import pack_token_documents

    rng = np.random.default_rng(0)
    documents = [list(rng.integers(1, 50, size=n)) for n in rng.integers(1, 40, size=200)]
    packed = pack_token_documents(documents, eos_id=EOS, seq_len=32, seed=0, document_masking=True)
    slots = StepSlots(4 // dp, dp, 1, 32)

    def loader(rows_per_batch: int):
        return build_dataloader(None, None, seq_len=32, local_batch_size=rows_per_batch, dp_rank=0, dp_size=1,
                                seed=0, document_masking=True, rows=packed)
    rank_loaders = [loader(dp) for _ in range(dp)]  # every rank reads dp rows (one per rank) per micro-step
    rank_iters = [iter(r) for r in rank_loaders]
    placements = [StepPlacement(slots, rank) for rank in range(dp)]
    reference = loader(4)
    for step in iter(reference):
        trained = [b["input_ids"] for p, it in zip(placements, rank_iters) for b in p.take(it)]
        assert sorted(torch.cat(trained).flatten().tolist()) == sorted(step["input_ids"].flatten().tolist())
        if reference.global_rows_consumed == 12:
            break
    assert all(r.state_dict()["global_rows_consumed"] == 12 for r in rank_loaders)
