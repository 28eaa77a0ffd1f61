"""Single-process checks of the CP layouts and of the ring's block plan, against explicit position arithmetic."""
import pytest
import torch

from parallelisms.context_parallel import check_sequence_length, local_positions, shard_sequence
from parallelisms.cp.plan_piece import BlockTask, FULL
from parallelisms.cp.plan_pieces import DocumentShards, block_tasks, document_runs, task_pieces
from config import RecipeError


def _expected_positions(seq_len, rank, size, balancer):
    if balancer == "striped":
        return [t for t in range(seq_len) if t % size == rank]
    if balancer == "contiguous":
        n = seq_len // size
        return list(range(rank * n, (rank + 1) * n))
    c = seq_len // (2 * size)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * size - 1 - rank) * c, (2 * size - rank) * c))


@pytest.mark.parametrize("balancer", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6])
def test_shards_hold_the_layouts_tokens_and_cover_the_sequence(balancer, size):
    seq_len = 2 * size * 5
    x = torch.arange(3 * seq_len).view(3, seq_len) * 10  # batch 3, token t has value 10*t in row 0
    seen = []
    for rank in range(size):
        expected = _expected_positions(seq_len, rank, size, balancer)
        assert local_positions(seq_len, rank, size, balancer).tolist() == expected
        shard = shard_sequence(x, 1, rank, size, balancer)
        assert shard[0].tolist() == [10 * t for t in expected]
        assert torch.equal(shard[1], shard[0] + 10 * seq_len)
        seen += expected
    assert sorted(seen) == list(range(seq_len))


def test_shard_along_another_dim():
    x = torch.randn(2, 4, 16, 3)  # (B, H, S, D)
    shard = shard_sequence(x, 2, 1, 2, "zigzag")
    assert torch.equal(shard, torch.cat([x[:, :, 4:8], x[:, :, 8:12]], dim=2))


@pytest.mark.parametrize("seq_len,size,balancer,nearest", [
    (101, 4, "zigzag", 104), (100, 4, "zigzag", 96), (97, 4, "zigzag", 96), (10, 3, "striped", 9), (5, 4, "contiguous", 4),
    (3, 4, "zigzag", 8)])
def test_indivisible_length_names_length_degree_and_nearest_valid(seq_len, size, balancer, nearest):
    with pytest.raises(RecipeError) as err:
        check_sequence_length(seq_len, size, balancer)
    message = str(err.value)
    assert str(seq_len) in message and f"cp degree {size}" in message
    assert f"nearest valid length: {nearest}" in message
    assert "\n" not in message
    with pytest.raises(RecipeError):
        shard_sequence(torch.zeros(1, seq_len), 1, 0, size, balancer)


def test_unknown_load_balancer_is_a_recipe_error():
    with pytest.raises(RecipeError, match="cp_load_balancer.*zigzag"):
        check_sequence_length(16, 2, "round_robin")


def _plan_visibility(tasks, local_len):
    """The (q, k) pairs a plan computes, as a bool matrix."""
    seen = torch.zeros(local_len, local_len, dtype=torch.bool)
    for task in tasks:
        rows = torch.arange(local_len)[task.q_rows]
        cols = torch.arange(local_len)[task.kv_rows]
        block = torch.ones(len(rows), len(cols), dtype=torch.bool)
        if task.is_causal:
            assert len(rows) == len(cols)
            block = block.tril()
        seen[rows[:, None], cols[None, :]] |= block
    return seen


@pytest.mark.parametrize("balancer", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("is_causal", [True, False])
def test_block_plan_computes_exactly_the_visible_pairs(balancer, size, is_causal):
    seq_len = 2 * size * 4
    local_len = seq_len // size
    for rank in range(size):
        pos_q = local_positions(seq_len, rank, size, balancer)
        for src in range(size):
            pos_k = local_positions(seq_len, src, size, balancer)
            want = pos_k[None, :] <= pos_q[:, None] if is_causal else torch.ones(local_len, local_len, dtype=torch.bool)
            tasks = block_tasks(rank, src, size, local_len, balancer, is_causal)
            assert torch.equal(_plan_visibility(tasks, local_len), want), (rank, src)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_zigzag_off_diagonal_steps_do_half_a_block(size):
    local_len = 8
    for rank in range(size):
        for src in range(size):
            if src == rank:
                continue
            (task,) = block_tasks(rank, src, size, local_len, "zigzag", True)
            rows = len(range(local_len)[task.q_rows])
            cols = len(range(local_len)[task.kv_rows])
            assert not task.is_causal and rows * cols == local_len * local_len // 2


def _documents_with_singletons(batch, seq_len, gen):
    """(B, S) ids of consecutive documents: random lengths, with 1-token documents forced in, crossing shards. Two
    rows reuse ids (a document in several runs): keys of a document before its query run, and (document 0 around
    1-token documents) runs one shard sees whole and another broken, so a key run ends inside a query run."""
    rows = []
    for _ in range(batch - 2):
        lengths = torch.randint(1, max(2, seq_len // 3), (seq_len,), generator=gen)
        lengths[::3] = 1
        rows.append(torch.repeat_interleave(torch.arange(seq_len), lengths)[:seq_len])
    rows.append(rows[-1] % 3)
    position = torch.arange(seq_len)
    rows.append(torch.where(position % 7 == 4, 1 + position, 0))
    return torch.stack(rows)


def _piece_cover(pieces, batch, local_len):
    """How often each (batch, q, k) pair is computed by `pieces`; causal pieces must be squares."""
    cover = torch.zeros(batch, local_len, local_len, dtype=torch.int64)
    for p in pieces:
        rows, cols = torch.arange(local_len)[p.q_rows], torch.arange(local_len)[p.kv_rows]
        block = torch.ones(len(rows), len(cols), dtype=torch.int64)
        if p.is_causal:
            assert len(rows) == len(cols), p
            block = block.tril()
        cover[p.batch, rows[:, None], cols[None, :]] += block
    return cover


@pytest.mark.parametrize("balancer", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("is_causal", [True, False])
def test_document_pieces_cover_exactly_the_visible_pairs_once(balancer, size, is_causal):
    """Union of the pieces == same document (and causal by global position), built densely here; pieces disjoint."""
    gen = torch.Generator().manual_seed(size * 7 + len(balancer))
    batch, seq_len = 4, 2 * size * 9
    local_len = seq_len // size
    docs = _documents_with_singletons(batch, seq_len, gen)
    shards = DocumentShards.from_full(docs, size, balancer)
    for rank in range(size):
        pos_q = torch.tensor(_expected_positions(seq_len, rank, size, balancer))
        for src in range(size):
            pos_k = torch.tensor(_expected_positions(seq_len, src, size, balancer))
            want = docs[:, pos_q][:, :, None] == docs[:, pos_k][:, None, :]
            if is_causal:
                want &= pos_k[None, None, :] <= pos_q[None, :, None]
            tasks = block_tasks(rank, src, size, local_len, balancer, is_causal)
            cover = _piece_cover(shards.pieces(rank, src, tasks, local_len), batch, local_len)
            assert cover.max() <= 1, (rank, src)  # disjoint: every pair merged at most once
            assert torch.equal(cover.bool(), want), (rank, src)


def test_pieces_of_a_causal_block_split_a_partly_overlapping_run_into_rectangle_and_square():
    """Query run [2, 6) and key run [0, 4) of one document under j <= i: keys before the queries (full), the shared
    rows (causal square), the shared keys seen by the later queries (full). Rows 0-1 (document 0) see nothing."""
    q_runs = document_runs(torch.tensor([[0, 0, 1, 1, 1, 1]]))
    k_runs = document_runs(torch.tensor([[1, 1, 1, 1, 2, 2]]))
    pieces = task_pieces(BlockTask(FULL, FULL, True), q_runs, k_runs, 6)
    got = [(p.q_rows.indices(6)[:2], p.kv_rows.indices(6)[:2], p.is_causal) for p in pieces]
    assert got == [((2, 6), (0, 2), False), ((2, 4), (2, 4), True), ((4, 6), (2, 4), False)]
    assert task_pieces(BlockTask(FULL, FULL, False), q_runs, document_runs(torch.tensor([[5] * 6])), 6) == []


def test_pieces_are_cut_once_per_batch_and_reused():
    shards = DocumentShards.from_full(torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]]), 2, "zigzag")
    tasks = block_tasks(1, 0, 2, 4, "zigzag", True)
    first = shards.pieces(1, 0, tasks, 4)
    assert shards.pieces(1, 0, list(tasks), 4) is first
