"""The trainer's step loader (training/batch_plans.py): whole steps whose rows are the per-micro-batch loader's rows
(placed by work exactly as data/placement.StepPlacement placed them on the training thread), whose plans are those
context_parallel would make itself, made in a worker process; a loader resumed from the state taken while the worker
had already planned the next steps continues with bit-identical steps."""
import numpy as np
import pytest
import torch

from data.loader import build_dataloader
from data.placement import StepPlacement, StepSlots
from parallelisms.cp.plan_layout import DocumentLayout
from tests.data.test_loader import DOCUMENTS, NumberedTokenizer
from training.batch_plans import CpPlanning, step_loader

pytestmark = pytest.mark.timeout(120)

SEQ, MICRO, DP, LOCAL, CP = 24, 2, 2, 1, 3


def _micro_loader(placed: bool, dp_rank: int = 1):
    if placed:  # every rank reads the whole global micro-batch (training/build.py)
        return build_dataloader(NumberedTokenizer(), DOCUMENTS, seq_len=SEQ, local_batch_size=LOCAL * DP, dp_rank=0,
                                dp_size=1, seed=5, document_masking=True)
    return build_dataloader(NumberedTokenizer(), DOCUMENTS, seq_len=SEQ, local_batch_size=LOCAL, dp_rank=dp_rank,
                            dp_size=DP, seed=5, document_masking=True)


def _steps(placed: bool, count: int, workers: int, state: dict | None = None, dp_rank: int = 1):
    slots = StepSlots(MICRO, DP, LOCAL, SEQ) if placed else None
    loader = step_loader(_micro_loader(placed, dp_rank), MICRO, slots, dp_rank, CpPlanning(CP, 2, "ring"),
                         num_workers=workers, pin_memory=False)
    if state is not None:
        loader.load_state_dict(state)
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)], loader


def _same_step(a: dict, b: dict) -> bool:
    if a["whole_rows"] != b["whole_rows"]:
        return False
    for x, y in zip(a["micro_batches"], b["micro_batches"]):
        fields = [n for n in x if n != "plan"]
        if not all(torch.equal(x[n], y[n]) for n in fields) or not torch.equal(x["plan"].positions,
                                                                                y["plan"].positions):
            return False
        if not all(np.array_equal(p, q) for p, q in zip(x["plan"].ring.pieces, y["plan"].ring.pieces)):
            return False
    return True


@pytest.mark.parametrize("placed", [True, False])
def test_steps_hold_todays_rows_and_the_plans_context_parallel_would_make(placed):
    steps, _ = _steps(placed, 3, workers=1)
    micro = iter(_micro_loader(placed))
    expected = (StepPlacement(StepSlots(MICRO, DP, LOCAL, SEQ), 1).take(micro) if placed else
                [next(micro) for _ in range(MICRO)] for _ in range(3))
    for step, want in zip(steps, expected):
        assert len(step["micro_batches"]) == MICRO
        for got, batch in zip(step["micro_batches"], want):
            for name, values in batch.items():
                assert torch.equal(got[name], values), name
            layout = DocumentLayout.plan(batch["document_ids"], CP)
            assert torch.equal(got["plan"].positions, layout.positions)
            assert got["plan"].cp_rank == 2


@pytest.mark.parametrize("placed", [True, False])
def test_resume_from_a_state_taken_with_steps_planned_ahead_continues_bit_identically(placed):
    straight, _ = _steps(placed, 6, workers=1)
    first, loader = _steps(placed, 3, workers=2)  # two workers: several steps were planned ahead of the state
    state = loader.state_dict()
    assert state["global_rows_consumed"] == 3 * MICRO * LOCAL * DP
    resumed, _ = _steps(placed, 3, workers=1, state=state)
    assert all(_same_step(a, b) for a, b in zip(first + resumed, straight))
