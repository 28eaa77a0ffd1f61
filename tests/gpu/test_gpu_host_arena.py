"""Real pinned memory of the offload host arena (parallelisms/host_arena.py) on a GPU: the arena is page-locked
(cudaHostRegister), pins exactly its bytes (whole pages) without going through torch's CachingHostAllocator (whose
stats do not move), and nothing stays pinned after the stage switch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.devices import CUDA_ONLY, require

TINY = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)


def _host_allocator_bytes() -> int:
    return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_offload_arena_pins_exactly_the_stage_and_releases_it(device):
    from models.llama import Llama, LlamaConfig
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    cuda = require(device)
    model = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(model, "full", 2, True)
    model.to(cuda)
    model.init_weights(0)
    offloader = model.activation_offloader
    before = _host_allocator_bytes()
    for _ in range(2):  # the counting step, then the arena's
        tokens = torch.randint(0, TINY["vocab_size"], (2, 1025), device=cuda)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    torch.cuda.synchronize()
    need = TINY["n_layers"] * 2 * 1024 * TINY["dim"] * 4  # every block's fp32 (2, 1024, dim) input
    assert offloader.needed_bytes == offloader.arena_bytes == offloader.pinned_bytes == need
    assert offloader.arena.buffer.is_pinned()
    assert _host_allocator_bytes() == before  # not the CachingHostAllocator's power-of-two blocks
    buffer = offloader.arena.buffer
    offloader.release_arena()
    assert offloader.pinned_bytes == 0 and not buffer.is_pinned()
