"""The registered CP attention op pair (parallelisms/cp/op.py, issue 47): torch.library.opcheck on both ops (schema,
fake implementation against the real one, autograd registration, AOT dispatch with dynamic shapes), on a group of
one and in lockstep on 2 gloo ranks; and a whole transformer block compiled under CP 2 for every variant and
checkpoint mode: one graph, no break, one CP op per block and no point-to-point collective in the graph, and the
same numbers as the eager CP path; and the op's exchanges under tests/nccl_rules.py's NCCL double."""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.parallelisms.cp_block_probe import VARIANTS, block_explanation, block_graph_report, document_ids

AC_MODES = ("none", "full", "selective", "op")


def _opcheck_variant(group, variant: str, seq: int = 16) -> dict:
    """opcheck of both ops of `variant` inside its context_parallel block; {test: result} per op."""
    import torch
    from torch.library import opcheck

    from parallelisms.context_parallel import context_parallel

    load_balancer, cp_impl, with_ids = VARIANTS[variant]
    tokens = torch.zeros(2, seq, dtype=torch.long)
    buffers = [tokens] + ([document_ids(2, seq)] if with_ids else [])
    generator = torch.Generator().manual_seed(3)
    with context_parallel(group, buffers, [1] * len(buffers), load_balancer=load_balancer, cp_impl=cp_impl,
                          document_ids=buffers[1] if with_ids else None) as _:
        from parallelisms.cp.op import ACTIVE
        run = ACTIVE.current(group.group_name)
        local = tokens.size(1)
        q, k, v = (torch.randn(2, heads, local, 8, generator=generator) for heads in (4, 2, 2))
        constants = (True, None, group.group_name, run.op_variant)
        out, lse = torch.ops.titan_cp.attention(q, k, v, *constants)
        dout = torch.randn(out.shape, generator=generator)
        forward = opcheck(torch.ops.titan_cp.attention.default,
                          tuple(x.clone().requires_grad_() for x in (q, k, v)) + constants)
        backward = opcheck(torch.ops.titan_cp.attention_backward.default, (dout, q, k, v, out, lse, *constants))
    return {"variant": run.op_variant, "forward": forward, "backward": backward}


def _opcheck_ranks(rank, world_size, variants):
    import torch.distributed as dist

    return [_opcheck_variant(dist.group.WORLD, variant) for variant in variants]


def _all_succeeded(reports: list) -> bool:
    return all(result == "SUCCESS" for report in reports for op in ("forward", "backward")
               for result in report[op].values())


def test_opcheck_on_a_group_of_one():
    """Dense ring and, with document ids at CP 1, the packed-documents variant."""
    (reports,) = run_ranks(_opcheck_ranks, 1, args=(("ring", "documents"),), timeout=240)
    assert [r["variant"] for r in reports] == ["ring", "packed"]
    assert _all_succeeded(reports), reports


@pytest.mark.slow
def test_opcheck_in_lockstep_on_two_ranks():
    """Every exchange with real collectives: both ranks run opcheck's calls in the same order."""
    results = run_ranks(_opcheck_ranks, 2, args=(tuple(VARIANTS),), timeout=400)
    for reports in results:
        assert [r["variant"] for r in reports] == ["ring", "allgather", "ring", "ulysses", "hybrid"]
        assert _all_succeeded(reports), reports


def _block_reports(rank, world_size):
    import torch.distributed as dist

    reports = {}
    for variant in VARIANTS:  # dynamo's explanation of the inner block, once per variant: AC only wraps the block
        explained = block_explanation(dist.group.WORLD, variant)
        reports.update({(variant, ac): block_graph_report(dist.group.WORLD, variant, ac, explained=explained)
                        for ac in AC_MODES})
    return reports


@pytest.mark.slow
def test_a_compiled_block_is_one_graph_for_every_variant_and_checkpoint_mode():
    """CP 2 on gloo: ring (zigzag), all-gather, documents, Ulysses, hybrid x AC none, full, selective, op. dynamo's
    explanation (graph and break counts, the graph's ops) is of the inner block, which no AC mode changes (the
    checkpoint wraps it, eager), so it is made once per variant, not once per mode (20 -> 5 traces); each mode's own
    compile through its wrapper (the AOT forward and backward graphs, the numbers) still runs for all 20."""
    for reports in run_ranks(_block_reports, 2, timeout=600):
        for key, report in reports.items():
            assert report["graphs"] == 1 and report["breaks"] == 0, (key, report)
            assert report["cp_ops"] == 1 and not report["p2p"], (key, report)
            assert report["aot_forward_cp_ops"] == [1] and report["aot_backward_cp_ops"] == [1], (key, report)
            assert not report["aot_p2p"], (key, report)
            assert report["max_error"] <= 1e-6, (key, report)


def _op_and_eager(group, variant: str) -> list:
    """This rank's (out, dq, dk, dv) through the op pair and through the eager CP path, in one context_parallel
    block on `group` (the NCCL double's: every exchange inside the op under NCCL's rules)."""
    import torch
    import torch.nn.functional as F

    from parallelisms.context_parallel import context_parallel
    from parallelisms.cp.op import ACTIVE
    from parallelisms.cp.groups import group_name

    load_balancer, cp_impl, with_ids = VARIANTS[variant]
    seq, generator = 32, torch.Generator().manual_seed(11)
    tokens = torch.zeros(2, seq, dtype=torch.long)
    buffers = [tokens] + ([document_ids(2, seq)] if with_ids else [])
    q, k, v, dout = (torch.randn(2, heads, seq // group.size, 8, generator=generator) for heads in (4, 2, 2, 4))
    with context_parallel(group, buffers, [1] * len(buffers), load_balancer=load_balancer, cp_impl=cp_impl,
                          document_ids=buffers[1] if with_ids else None, ulysses_degree=1 if variant == "hybrid"
                          else None):
        constants = (True, None, group_name(group), ACTIVE.current(group_name(group)).op_variant)
        out, lse = torch.ops.titan_cp.attention(q, k, v, *constants)
        op_grads = torch.ops.titan_cp.attention_backward(dout, q, k, v, out, lse, *constants)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        eager = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        eager.backward(dout)
    return [(a - b).abs().max().item() for a, b in zip((out, *op_grads), (eager, *(x.grad for x in leaves)))]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_ops_exchanges_keep_nccls_rules(monkeypatch, variant):
    """Ranks as threads under tests/nccl_rules.py's double (it raises where NCCL would hang or misread a buffer):
    the op pair's forward and backward equal the eager path's on every rank."""
    from tests.nccl_rules import run_ring_ranks

    for errors in run_ring_ranks(lambda group: _op_and_eager(group, variant), 2, monkeypatch):
        assert max(errors) <= 1e-6, (variant, errors)
