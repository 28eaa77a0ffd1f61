"""The offload host arena (parallelisms/host_arena.py): one buffer per stage, exactly the bytes of the block inputs
the stage holds at once (no power-of-two rounding), released at a stage switch.

This machine's torch is a CPU build, where nothing can be pinned (`pin_memory` needs an accelerator): the tests check
the arena's own accounting (its buffer's bytes, its slots, the pinned bytes it reports: 0 here) against sizes
computed from the model's shapes; tests/gpu/test_gpu_host_arena.py checks real pinned memory on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.host_arena import (HostArena, arena_pinned_bytes, caching_allocator_pinned_bytes, slot_bytes,
                                     span_bytes, stage_pinned_bytes)
from tests.trainer_runs import read_metrics, run_train

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)


def _offloaded_model():
    model = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(model, "full", 2, True)
    model.init_weights(0)
    return model, model.activation_offloader


def _step(model, batch: int, seq: int) -> float:
    tokens = torch.randint(0, TINY["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(seq))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def test_the_arena_holds_exactly_the_stage_block_inputs_and_is_released_at_the_switch():
    model, offloader = _offloaded_model()
    stage_one = TINY["n_layers"] * 2 * 32 * TINY["dim"] * 4  # every block's fp32 (2, 32, dim) input, held at once
    _step(model, 2, 32)  # the stage's first step counts its block inputs into plain host buffers
    assert offloader.arena_bytes == offloader.needed_bytes == stage_one
    assert offloader.pinned_bytes == 0  # a CPU run pins nothing; on CUDA: whole pages of the arena
    buffer = offloader.arena.buffer
    _step(model, 2, 32)
    assert offloader.arena.buffer is buffer and offloader.arena_bytes == stage_one  # reused, nothing added
    assert not any(offloader._pool.values())  # every block input went to an arena slot

    offloader.release_arena()  # the stage switch
    assert offloader.arena is None and offloader.arena_bytes == offloader.pinned_bytes == 0
    _step(model, 1, 96)  # the next stage: its own size only
    assert offloader.arena_bytes == TINY["n_layers"] * 96 * TINY["dim"] * 4


def test_offloaded_steps_with_the_arena_equal_plain_checkpointing():
    model, _ = _offloaded_model()
    plain = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(plain, "full", 2, False)
    plain.init_weights(0)
    for _ in range(2):  # the counting step, then the arena's
        assert _step(model, 2, 32) == _step(plain, 2, 32)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
        model.zero_grad(), plain.zero_grad()


def test_slots_are_carved_views_and_sizes_round_only_to_pages():
    key = ((3, 5), (5, 1), torch.bfloat16)
    arena = HostArena({key: 2, ((4,), (1,), torch.float32): 1}, pin=False)
    assert span_bytes(*key) == 30 and slot_bytes(key) == 64 and arena.nbytes == 2 * 64 + 64
    a, b = arena.take(key), arena.take(key)
    assert arena.take(key) is None and a.shape == (3, 5) and a.dtype == torch.bfloat16
    assert a.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()  # views of one buffer
    a.fill_(1), b.fill_(2)
    assert a.sum().item() == 15 and b.sum().item() == 30  # disjoint slots
    block = 1_179_648_000  # an 8B block input at 72K tokens in bf16 (1.1 GiB)
    assert arena_pinned_bytes(block) == block  # whole pages: already a multiple of 4096
    assert caching_allocator_pinned_bytes([block]) == 2 ** 31  # torch's host allocator: the next power of two
    assert stage_pinned_bytes(5000) == 8192 and stage_pinned_bytes(0) == 0  # what the dry run reports
    with pytest.raises(RuntimeError, match="released while"):
        _, offloader = _offloaded_model()
        offloader.host_bytes = 1
        offloader.release_arena()


RAMP = """
[model]
name = "debug"
n_layers = 2
[training]
steps = 4
seq_len = 64
local_batch_size = 1
tokens_per_step = 256
dtype = "float32"
[parallelism]
dp_shard = 1
[activation_checkpoint]
mode = "full"
offload = true
[metrics]
enable_tensorboard = false
[[ramp]]
start_step = 0
seq_len = 64
[[ramp]]
start_step = 2
seq_len = 128
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainer_reports_each_stage_arena_and_keeps_nothing_of_the_previous_stage(tmp_path):
    """The real trainer, 2 stages offloading: each stage's arena is its own block inputs (the debug model's 256-wide
    fp32 rows, 2 blocks), the first stage's is gone after the switch; pinned bytes 0 on a CPU run."""
    recipe = tmp_path / "ramp.toml"
    recipe.write_text(RAMP)
    out = str(tmp_path / "run")
    done = run_train(str(recipe), "--job.dump_folder", out, nproc=1, timeout=180, forked=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = read_metrics(out)
    per_stage = [2 * 64 * 256 * 4, 2 * 128 * 256 * 4]
    assert [r["offload_arena_bytes"] for r in records] == [per_stage[0]] * 2 + [per_stage[1]] * 2
    assert [r["offload_host_peak_bytes"] for r in records] == [per_stage[0]] * 2 + [per_stage[1]] * 2
    assert [r["offload_pinned_bytes"] for r in records] == [0] * 4
