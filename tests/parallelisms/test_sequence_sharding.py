"""Single-process checks of the CP layouts and of the ring's block plan, against explicit position arithmetic."""
import pytest
import torch

from parallelisms.context_parallel import check_sequence_length, local_positions, shard_sequence
from parallelisms.ring_plan import BlockTask, block_tasks, mask_task
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


def test_documents_that_cannot_meet_skip_the_block_and_partial_blocks_get_a_float_mask():
    full = BlockTask(slice(None), slice(None), False)
    doc_q = torch.tensor([[0, 0, 1, 1]])
    assert mask_task(full, doc_q, torch.tensor([[2, 2, 3, 3]]), torch.float32) is None
    same = mask_task(BlockTask(slice(None), slice(None), True), doc_q, doc_q.clone(), torch.float32)
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert not same.is_causal and torch.equal(same.mask[0, 0] == 0, want)  # causal and documents in one mask
    one_doc = mask_task(BlockTask(slice(None), slice(None), True), doc_q * 0, doc_q * 0, torch.float32)
    assert one_doc.is_causal and one_doc.mask is None  # documents hide nothing: keep the kernel's causal path
    plain = mask_task(full, torch.tensor([[5, 5]]), torch.tensor([[5, 5, 5]]), torch.float32)
    assert plain.mask is None and not plain.is_causal
    partial = mask_task(full, doc_q, torch.tensor([[1, 1, 7, 7]]), torch.bfloat16)
    assert partial.mask.dtype == torch.bfloat16 and partial.mask.shape == (1, 1, 4, 4)
    assert partial.empty_rows[0, 0].tolist() == [True, True, False, False]
    assert torch.isinf(partial.mask[0, 0, 2, 2:]).all() and (partial.mask[0, 0, 2, :2] == 0).all()
