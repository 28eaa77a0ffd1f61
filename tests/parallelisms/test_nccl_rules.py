"""CP communication under NCCL's point-to-point rules (tests/nccl_rules.py), on CPU, against float64 references.

gloo buffers sends, so these rules never bite in the multi-process tests; here every rank is a thread and the double
refuses what NCCL would hang on, at any message size."""
import pytest
import torch

from tests.nccl_rules import NcclDeadlock, run_ring_ranks
from tests.parallelisms.attention_reference import reference_attention, relative_error


def _send_then_receive_ring(group):
    """The pattern NCCL hangs on: every rank posts a send-only group, then a receive-only group."""
    import torch.distributed as dist

    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    out, into = torch.full((4,), float(group.rank)), torch.empty(4)
    sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group)])
    receives = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, prv, group)])
    for work in sends + receives:
        work.wait()
    return into


def _fused_ring(group):
    from parallelisms.comm import RingLinks, wait_all

    out, into = torch.full((4,), float(group.rank)), torch.empty(4)
    wait_all(RingLinks(group).exchange([out], [into]))
    return into


def test_the_double_refuses_separate_send_and_receive_groups_and_accepts_fused_ones(monkeypatch):
    with pytest.raises(NcclDeadlock, match="rank 0 waits in its group #0: send to rank 1"):
        run_ring_ranks(_send_then_receive_ring, 3, monkeypatch)
    received = run_ring_ranks(_fused_ring, 3, monkeypatch)
    assert [int(t[0]) for t in received] == [2, 0, 1]


def _ring_fwd_bwd(group, q, k, v, grad_out, balancer, documents):
    from parallelisms.context_parallel import ring_attention, shard_sequence

    def shard(x, dim=2):
        return shard_sequence(x, dim, group.rank, group.size, balancer)

    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, is_causal=True, load_balancer=balancer,
                         document_ids=None if documents is None else shard(documents, 1))
    out.backward(shard(grad_out))
    return [out.detach(), *(t.grad for t in local)]


@pytest.mark.parametrize("size, balancer, with_documents", [(2, "zigzag", False), (4, "zigzag", False),
                                                            (3, "striped", True)])
def test_ring_forward_and_backward_keep_nccls_grouping_rule(monkeypatch, size, balancer, with_documents):
    from parallelisms.context_parallel import shard_sequence

    gen = torch.Generator().manual_seed(size)
    seq = 48
    q = torch.randn(2, 4, seq, 8, generator=gen)
    k, v = (torch.randn(2, 2, seq, 8, generator=gen) for _ in range(2))
    grad_out = torch.randn(2, 4, seq, 8, generator=gen)
    documents = (torch.arange(seq) // 10).expand(2, seq).clone() if with_documents else None
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, True, documents)
    expected.backward(grad_out.double())
    per_rank = run_ring_ranks(lambda g: _ring_fwd_bwd(g, q, k, v, grad_out, balancer, documents), size, monkeypatch)
    for got, want in zip(zip(*per_rank), [expected, *(t.grad for t in full)]):
        want_local = [shard_sequence(want, 2, r, size, balancer) for r in range(size)]
        assert max(relative_error(a, b) for a, b in zip(got, want_local)) < 1e-5


def _variable_all_to_all(group, lie: bool):
    import torch.distributed as dist

    from parallelisms.comm import all_to_all_rows

    # rank r sends r + 1 + j elements to rank j; rank 1 claims one element too many from rank 0 when `lie`
    send = torch.cat([torch.full((group.rank + 1 + j,), float(group.rank)) for j in range(group.size)])
    out_splits = [r + 1 + group.rank for r in range(group.size)]
    if lie and group.rank == 1:
        out_splits[0] += 1
    recv = torch.empty(sum(out_splits))
    all_to_all_rows(recv, send, out_splits, [group.rank + 1 + j for j in range(group.size)], group)
    return recv


def test_the_double_runs_all_to_all_with_variable_splits_and_refuses_mismatched_ones(monkeypatch):
    received = run_ring_ranks(lambda g: _variable_all_to_all(g, False), 3, monkeypatch)
    assert received[2].tolist() == [0.0] * 3 + [1.0] * 4 + [2.0] * 5
    with pytest.raises(Exception, match="rank 0 sends 2 elements to rank 1, which expects 3"):
        run_ring_ranks(lambda g: _variable_all_to_all(g, True), 3, monkeypatch)


# ---------------------------------------------------------------- rules the double added in issue 26 (each test
# fails on the double before it: data were copied as soon as a send met its receive, devices were not checked,
# new_group was local and reduce ops were not compared)

def _read_before_wait(group):
    import torch.distributed as dist

    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    out, into = torch.full((4,), float(group.rank)), torch.zeros(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group), dist.P2POp(dist.irecv, into, prv, group)])
    before = into.clone()
    for work in works:
        work.wait()
    return before, into


def test_a_receive_buffer_read_before_wait_holds_poison(monkeypatch):
    per_rank = run_ring_ranks(_read_before_wait, 3, monkeypatch)
    for rank, (before, after) in enumerate(per_rank):
        assert torch.isnan(before).all(), f"rank {rank} read {before.tolist()} before wait()"
        assert after.tolist() == [float((rank - 1) % 3)] * 4


def _write_after_post(group, posted):
    """Rank 0 posts, then overwrites its send buffer before its peer has even posted; the peer must still receive
    what was in the buffer at post (NCCL reads it asynchronously: writing it before wait() is a race)."""
    import torch.distributed as dist

    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    out, into = torch.full((4,), float(group.rank + 1)), torch.empty(4)
    if group.rank != 0:
        posted.wait(timeout=30)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt, group), dist.P2POp(dist.irecv, into, prv, group)])
    if group.rank == 0:
        out.fill_(-7.0)
        posted.set()
    for work in works:
        work.wait()
    return into


def test_a_send_buffer_written_after_post_does_not_change_what_is_received(monkeypatch):
    import threading

    posted = threading.Event()
    received = run_ring_ranks(lambda g: _write_after_post(g, posted), 3, monkeypatch)
    assert [t.tolist() for t in received] == [[3.0] * 4, [1.0] * 4, [2.0] * 4]


def _ring_with_buffer(group, make):
    from parallelisms.comm import RingLinks, wait_all

    out, into = make(group.rank), torch.empty(4)
    wait_all(RingLinks(group).exchange([out], [into]))
    return into


@pytest.mark.parametrize("make", [
    lambda r: torch.from_numpy(__import__("numpy").full(4, float(r), dtype="float32")),
    lambda r: torch.full((4,), float(r)).cpu(),
    lambda r: torch.full((4,), float(r), device="cpu"),
    lambda r: torch.from_numpy(__import__("numpy").full(8, float(r), dtype="float32"))[::2].contiguous() * 2,
], ids=["from_numpy", "cpu()", "device-cpu", "computed-from-from_numpy"])
def test_a_host_buffer_reaching_a_send_is_refused_wherever_it_was_made(monkeypatch, make):
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        run_ring_ranks(lambda g: _ring_with_buffer(g, make), 3, monkeypatch, run_device_type="cpu")


def test_a_buffer_brought_to_the_run_device_is_accepted(monkeypatch):
    device = torch.device("cpu")  # the run device object (what build.py hands out), as `.to(device)` gets it
    make = lambda r: torch.from_numpy(__import__("numpy").full(4, float(r), dtype="float32")).to(device)  # noqa: E731
    received = run_ring_ranks(lambda g: _ring_with_buffer(g, make), 3, monkeypatch, run_device_type="cpu")
    assert [int(t[0]) for t in received] == [2, 0, 1]


def _groups(group, everyone: bool):
    import torch.distributed as dist

    pair = [0, 1] if group.rank < 2 else [2, 3]
    if everyone or group.rank < 2:
        sub = dist.new_group(pair, use_local_synchronization=True)
        return sub.members
    return None


def test_group_creation_with_a_bound_device_is_a_collective_of_the_whole_world(monkeypatch):
    """ncclCommSplit: every world rank must take part in each group creation; the pairs [0, 1] and [2, 3] made at
    the same moment are one split (hybrid CP's pattern), [0, 1] made by ranks 0 and 1 alone waits forever."""
    assert run_ring_ranks(lambda g: _groups(g, True), 4, monkeypatch) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    with pytest.raises(NcclDeadlock, match=r"rank 0 waits in its group #0: new_group #0 on ranks \[0, 1, 2, 3\]"):
        run_ring_ranks(lambda g: _groups(g, False), 4, monkeypatch)
    # without a bound device, torch makes the group locally (the old double's only behaviour)
    assert run_ring_ranks(lambda g: _groups(g, False), 4, monkeypatch, bound_device=False)[:2] == [(0, 1), (0, 1)]


def _reduce_scatter(group, ops):
    import torch.distributed as dist

    out = torch.empty(2)
    dist.reduce_scatter_single(out, torch.arange(6.0) * (group.rank + 1), op=ops[group.rank], group=group)
    return out


def test_reduce_ops_must_agree_across_ranks(monkeypatch):
    import torch.distributed as dist

    maxed = run_ring_ranks(lambda g: _reduce_scatter(g, [dist.ReduceOp.MAX] * 3), 3, monkeypatch)
    assert [t.tolist() for t in maxed] == [[0.0, 3.0], [6.0, 9.0], [12.0, 15.0]]  # rank 2's input, 3 x arange
    with pytest.raises(NcclDeadlock, match="reduce ops differ"):
        run_ring_ranks(lambda g: _reduce_scatter(g, [dist.ReduceOp.SUM] + [dist.ReduceOp.MAX] * 2), 3, monkeypatch)
