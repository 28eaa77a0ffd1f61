"""Activation offload on the device it is meant for: the same body on CPU (fast tier) and CUDA (`--gpu`). On CUDA the
block inputs leave device memory after the forward (torch.cuda.memory_allocated drops by them; the last one may
still be in flight), the host copies are pinned, and losses and gradients equal the run without offload bit for bit
despite the side stream.

Both measured steps run after a warm-up step. The first matmul of a process makes cuBLAS's workspace through the
caching allocator (32 MiB on Hopper, cuBLAS's recommended size there), so `memory_allocated` counts it; without the
warm-up it landed inside the first measured window. That was the 40 MiB of the first H100 run: ref_after - after =
41,943,040 B = 32 MiB of workspace + the 4 block inputs of 2 MiB that offload moved off the device. Full activation
checkpointing itself keeps the same on both devices: this model's forward, measured with torch's MemTracker on fake
tensors, holds 19,423,248 B on the CPU and 19,423,744 B on the CUDA path (fake CUDA runtime preloaded)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from tests.gpu.devices import FAST_CPU, require

SHAPE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, rope_theta=10000.0)
BATCH, SEQ = 2, 1024


def _warm_up(device: torch.device) -> None:
    """One plain step, so the process's lazy device allocations (cuBLAS workspace, kernel scratch) exist before any
    measured window opens."""
    _step(device, offload=False)


def _step(device: torch.device, offload: bool):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**SHAPE)).to(device)
    apply_activation_checkpointing(model, "full", 1, offload)
    model.init_weights(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    logits = model(tokens[:, :-1])
    after = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else 0
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    offloader = getattr(model, "activation_offloader", None)
    # After the first step the stage's arena replaces the counting step's plain buffers (host_arena.py): one slot
    # per block input, back in the arena, pinned on CUDA.
    arena = offloader.arena if offloader else None
    slots = [slot for free in arena._free.values() for slot in free] if arena is not None else []
    pinned = [arena.pinned_bytes >= arena.nbytes > 0] * len(slots) if arena is not None else []
    return loss.item(), [p.grad.cpu() for p in model.parameters()], after, pinned


@pytest.mark.parametrize("device", FAST_CPU)
def test_offload_is_exact_and_frees_device_memory(device):
    device = require(device)
    _warm_up(device)
    ref_loss, ref_grads, ref_after, _ = _step(device, offload=False)
    loss, grads, after, pinned = _step(device, offload=True)
    assert loss == ref_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert len(pinned) == SHAPE["n_layers"]  # one arena slot per block input, back in the arena
    if device.type == "cuda":
        assert all(pinned)
        block_input = BATCH * SEQ * SHAPE["dim"] * 4
        # The last block's input may still be copying when the forward returns: it is released, at the latest, when
        # backward unpacks it first.
        assert (SHAPE["n_layers"] - 1) * block_input <= ref_after - after <= SHAPE["n_layers"] * block_input
