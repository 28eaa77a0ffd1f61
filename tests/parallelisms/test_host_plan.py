"""The documents layout planned before the step (parallelisms/cp/plan_host.py, issue 27): its whole-array pieces and
exchange rows are exactly what the per-call planner (plan_pieces.segment_pieces, DocumentShards.visible_rows) finds,
and context_parallel handed the plan gives bit-identical outputs and gradients without planning anything itself."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.cp_balance_counts import MIXES, packed_row
from parallelisms import context_parallel as cp_module
from parallelisms.cp import plan_pieces as ring_plan
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_host import BatchPlan, RankPlan, Segments, pieces_between
from parallelisms.cp.plan_pieces import DocumentShards
from tests.nccl_rules import run_ring_ranks

pytestmark = pytest.mark.timeout(120)


def _rows(seq: int, count: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    mixes = list(MIXES.values())
    return torch.stack([packed_row(mixes[i % len(mixes)], seq, rng) for i in range(count)])


def _as_tuples(pieces) -> list[tuple]:
    return [(p.batch.start, p.q_rows.start, p.q_rows.stop, p.kv_rows.start, p.kv_rows.stop, p.is_causal)
            for p in pieces]


@pytest.mark.parametrize("cp", [2, 3, 5])
def test_whole_array_plan_equals_the_per_call_planner(cp):
    ids = _rows(960 * cp, 2, cp)
    layout = DocumentLayout.plan(ids, cp)
    reference = DocumentShards.from_layout(ids, layout)
    plan = BatchPlan.build(ids.numpy(), cp, 0)
    assert torch.equal(plan.positions, layout.positions)
    per_rank = plan.per_rank_ids.numpy()
    segments = Segments.of(per_rank, plan.positions.numpy())
    for rank in range(cp):
        rank_plan = RankPlan.build(per_rank, plan.positions.numpy(), rank)
        for src in range(cp):
            for causal in (True, False):
                got = [(b, qa, qb, ka, kb, bool(c)) for b, qa, qb, ka, kb, c in
                       pieces_between(segments, rank, src, causal).tolist()]
                assert got == _as_tuples(reference.layout_pieces(rank, src, causal))
            if src != rank:
                assert np.array_equal(rank_plan.recv_rows[src], reference.visible_rows(rank, src, True).numpy())
                assert np.array_equal(rank_plan.send_rows[src], reference.visible_rows(src, rank, True).numpy())
                assert rank_plan.pair_rows[rank, src] == reference.visible_rows(rank, src, True).numel()


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _run(group, ids, q, k, v, grad_out, impl, planned: bool):
    """This rank's (out, dq, dk, dv) through context_parallel on the documents layout, with or without a plan."""
    tensors = [t.transpose(1, 2).clone() for t in (q, k, v, grad_out)]  # (B, S, H, D): sharded along dim 1
    doc = ids.clone()
    plan = BatchPlan.build(ids.numpy(), group.size, group.rank, impl).to("cpu") if planned else None
    with cp_module.context_parallel(group, buffers=[*tensors, doc], buffer_seq_dims=[1] * 5,
                                    load_balancer="documents", document_ids=doc, cp_impl=impl, plan=plan):
        local = [t.transpose(1, 2).detach().requires_grad_() for t in tensors[:3]]
        out = _Attention()(*local)
        out.backward(tensors[3].transpose(1, 2))
    return [out.detach(), *(t.grad for t in local)]


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_with_the_plan_is_bit_identical_and_plans_nothing(monkeypatch, cp, impl):
    gen = torch.Generator().manual_seed(cp)
    seq = 96 * cp
    ids = _rows(seq, 2, 30 + cp)
    q, grad_out = (torch.randn(2, 6, seq, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 3 if impl != "ulysses" else 6, seq, 8, generator=gen) for _ in range(2))
    unplanned = run_ring_ranks(lambda g: _run(g, ids, q, k, v, grad_out, impl, False), cp, monkeypatch)

    def refuse(*args, **kwargs):
        raise AssertionError("planned inside the step although the batch brought its plan")

    monkeypatch.setattr(DocumentLayout, "plan", classmethod(refuse))
    monkeypatch.setattr(ring_plan, "position_segments", refuse)
    planned = run_ring_ranks(lambda g: _run(g, ids, q, k, v, grad_out, impl, True), cp, monkeypatch)
    for a, b in zip(unplanned, planned):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
