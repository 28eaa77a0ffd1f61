"""The sparse CP paths' own branches against references: rows whose documents make most rank pairs see nothing.

On the rows of test_document_layout.py every rank sees rows of every other rank, so a skipped ring step, a pair with
nothing to send, a rank that sends but receives nothing (or the reverse) and the all-gather's "nothing arrived from
this source" branch are never run. The rows here are chosen for exactly those cases; what they contain is checked
first by a count from a dense document mask (not the plan's own `visible_rows`). Then:
- ring, all-gather, Ulysses and hybrid match every document run alone, forward and backward, within 1e-5;
- the bytes each rank hands to torch.distributed (tests.distributed.WireBytes, measured at the collective calls)
  equal, exactly, the bytes of the K/V rows that the dense mask says the receivers can see (and, in the backward,
  those rows again plus the float32 dK/dV of the rows received): a bug that ships every row, or drops one, fails.
"""
import pytest
import torch

from parallelisms.cp.plan_layout import DocumentLayout
from tests.distributed import run_ranks
from tests.nccl_rules import run_ring_ranks
from tests.parallelisms.attention_reference import per_document_attention, relative_error
from tests.parallelisms.test_document_layout import (_documents_hybrid, _documents_ring, _documents_ulysses,
                                                     _mixed_rows, _row)

pytestmark = pytest.mark.timeout(180)

CP = 4
# Rows of 96 tokens (24 per rank at cp 4), found by search; the comments say what the dense count below finds.
PARTIAL_ROWS = {
    # one pair: rank 1 sees 2 rows of rank 0; shifts 2 and 3 are skipped; rank 0 only sends, rank 1 only receives
    "one_pair": [10, 8, 8, 10, 6, 5, 8, 11, 3, 6, 6, 3, 11, 1],
    # 2 of 3 shifts active, 10 of 12 pairs empty: 0 -> 1 and 1 -> 3; rank 0 only sends, rank 3 only receives
    "two_of_three_steps": [7, 3, 5, 7, 7, 5, 8, 4, 9, 7, 9, 9, 5, 3, 7, 1],
}
EXPECTED_SHAPE = {"one_pair": ([1], 11, [0], [1]), "two_of_three_steps": ([1, 2], 10, [0], [3])}


def visible_row_counts(ids: torch.Tensor, cp: int) -> torch.Tensor:
    """[dst, src]: K/V rows (token positions of all batch rows) held by src that some query held by dst may attend to,
    counted from the dense causal document mask over the positions each rank holds."""
    positions = DocumentLayout.plan(ids, cp).positions
    counts = torch.zeros(cp, cp, dtype=torch.long)
    for dst in range(cp):
        for src in range(cp):
            if src == dst:
                continue
            for b in range(ids.size(0)):
                q_pos, k_pos = positions[dst, b], positions[src, b]
                seen = (ids[b][q_pos][:, None] == ids[b][k_pos][None, :]) & (k_pos[None, :] <= q_pos[:, None])
                counts[dst, src] += int(seen.any(0).sum())
    return counts


def _shape(counts: torch.Tensor):
    """(active shifts, empty ordered pairs, send-only ranks, receive-only ranks)."""
    cp = counts.size(0)
    active = [s for s in range(1, cp) if any(counts[(r + s) % cp, r] for r in range(cp))]
    empty = sum(int(counts[t, s] == 0) for t in range(cp) for s in range(cp) if t != s)
    send_only = [r for r in range(cp) if counts[:, r].sum() and not counts[r, :].sum()]
    receive_only = [r for r in range(cp) if counts[r, :].sum() and not counts[:, r].sum()]
    return active, empty, send_only, receive_only


def _ids(case: str) -> torch.Tensor:
    return _row(PARTIAL_ROWS[case])[None]


@pytest.mark.parametrize("case", sorted(PARTIAL_ROWS))
def test_the_rows_have_the_partial_visibility_they_claim(case):
    assert _shape(visible_row_counts(_ids(case), CP)) == EXPECTED_SHAPE[case]


def _inputs(seq: int, q_heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(1, q_heads, seq, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, seq, 8, generator=gen) for _ in range(2))
    return q, k, v, grad_out


RUNNERS = {
    "ring": lambda ids, q, k, v, g_out: lambda g: _documents_ring(g, q, k, v, g_out, ids, "ring")[0],
    "allgather": lambda ids, q, k, v, g_out: lambda g: _documents_ring(g, q, k, v, g_out, ids, "allgather")[0],
    "ulysses": lambda ids, q, k, v, g_out: lambda g: _documents_ulysses(g, q, k, v, g_out, ids),
    "hybrid": lambda ids, q, k, v, g_out: lambda g: _documents_hybrid(g, q, k, v, g_out, ids),
}


@pytest.mark.parametrize("impl", sorted(RUNNERS))
@pytest.mark.parametrize("case", sorted(PARTIAL_ROWS))
def test_partial_visibility_matches_every_document_alone(monkeypatch, impl, case):
    ids = _ids(case)
    q, k, v, grad_out = _inputs(ids.size(1), 12 if impl in ("ulysses", "hybrid") else 4, seed=len(case))
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = per_document_attention(*full, True, ids)
    expected.backward(grad_out.double())
    per_rank = run_ring_ranks(RUNNERS[impl](ids, q, k, v, grad_out), CP, monkeypatch)
    layout = DocumentLayout.plan(ids, CP)
    for name, got, want in zip(("out", "dq", "dk", "dv"), zip(*per_rank), [expected, *(t.grad for t in full)]):
        for r in range(CP):
            error = relative_error(got[r], layout.shard(want.transpose(1, 2), 1, r).transpose(1, 2))
            assert error <= 1e-5, f"{impl} on {case}: {name} of rank {r} is {error:.1e} from every document alone"


def _wire_body(rank, size, cases, impls):
    """Per (case, impl): bytes at the collective calls after the forward and after the backward, and CommStats'."""
    import torch.distributed as dist

    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.counters import CommStats
    from parallelisms.cp.plan_pieces import DocumentShards
    from tests.distributed import WireBytes

    out = {}
    for case, ids in cases.items():
        layout = DocumentLayout.plan(ids, size)
        q, k, v, grad_out = _inputs(ids.size(1), 4, seed=3)

        def shard(x):
            return layout.shard(x.transpose(1, 2), 1, rank).transpose(1, 2)

        for impl in impls:
            local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
            attention = ring_attention if impl == "ring" else allgather_attention
            stats = CommStats()
            with WireBytes() as wire:
                result = attention(*local, dist.group.WORLD, is_causal=True, load_balancer="documents", stats=stats,
                                   _documents=DocumentShards.from_layout(ids, layout))
                forward = wire.sent
                result.backward(shard(grad_out))
            out[case, impl] = (forward, wire.sent, stats.forward_bytes_sent, stats.backward_bytes_sent)
    return out


def test_bytes_on_the_wire_are_exactly_the_visible_rows():
    """Float32 K/V of 2 heads x 8 dims: a row is 64 bytes of K and 64 of V; its dK/dV go back in float32 too."""
    cases = {case: _ids(case) for case in PARTIAL_ROWS}
    cases["mixed"] = _mixed_rows(24 * CP, torch.Generator().manual_seed(5))
    impls = ("ring", "allgather")
    per_rank = run_ranks(_wire_body, CP, args=(cases, impls), timeout=150)
    kv_row = 2 * (2 * 8 * 4)  # K and V, 2 kv heads x head dim 8 x float32
    for case, ids in cases.items():
        counts = visible_row_counts(ids, CP)
        for impl in impls:
            for r in range(CP):
                sent_rows, received_rows = int(counts[:, r].sum()), int(counts[r, :].sum())
                forward, total, stats_forward, stats_backward = per_rank[r][case, impl]
                where = f"{impl} on {case}, rank {r} ({sent_rows} rows seen by others, {received_rows} received)"
                assert forward == sent_rows * kv_row, where
                assert total - forward == sent_rows * kv_row + received_rows * kv_row, where
                assert (stats_forward, stats_backward) == (forward, total - forward), where
        if case != "mixed":
            assert any(per_rank[r][case, "ring"][0] == 0 for r in range(CP))  # some rank sends nothing at all
