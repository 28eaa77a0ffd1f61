"""One host buffer per ramp stage for offloaded block inputs, exactly the bytes the stage holds at its peak, pinned as
one piece on CUDA, and given back when the stage ends.

Why not `torch.empty(..., pin_memory=True)` per block: torch's CachingHostAllocator (ATen/core/CachingHostAllocator.h,
torch 2.13) rounds every request up to a power of two by default (`pinned_max_round_threshold` defaults to
SIZE_MAX) and keeps freed blocks cached for the life of the process, so a 1.1 GiB block input pins 2 GiB and an
earlier ramp stage's buffers stay pinned after the switch. Here one exact-size pageable tensor is allocated and
registered with `cudaHostRegister` (as torch's own checkpoint stager does, torch/cuda/_pin_memory_utils.py): the OS
pins whole pages, so at most one page more than asked for. Slots are views carved from it, one per block input the
stage holds at once (counted during the stage's first step, which copies into plain host buffers).
"""
from __future__ import annotations

import math

import torch

PAGE_BYTES = 4096
"""cudaHostRegister pins whole pages."""
SLOT_ALIGN = 64
"""Each slot starts on a 64-byte boundary (cache line; every dtype's alignment)."""

SlotKey = tuple  # (size, stride, dtype) of a block input


def span_bytes(size, stride, dtype: torch.dtype) -> int:
    """Bytes of storage a tensor of this size and stride spans (its numel's bytes when contiguous)."""
    if any(s == 0 for s in size):
        return 0
    return (sum((n - 1) * st for n, st in zip(size, stride)) + 1) * dtype.itemsize


def slot_bytes(key: SlotKey) -> int:
    return math.ceil(span_bytes(*key) / SLOT_ALIGN) * SLOT_ALIGN


def arena_bytes(slots: dict[SlotKey, int]) -> int:
    """Size of the arena holding `slots` ({key: how many at once})."""
    return sum(count * slot_bytes(key) for key, count in slots.items())


def arena_pinned_bytes(nbytes: int) -> int:
    """What pinning an arena of `nbytes` really pins: whole pages."""
    return math.ceil(nbytes / PAGE_BYTES) * PAGE_BYTES


def stage_pinned_bytes(offloaded_bytes: float) -> int:
    """What a CUDA rank will really pin for a stage whose block inputs take `offloaded_bytes` at once (the dry run's
    measured host bytes): its arena's whole pages (block inputs of real models are multiples of SLOT_ALIGN)."""
    return arena_pinned_bytes(math.ceil(offloaded_bytes / SLOT_ALIGN) * SLOT_ALIGN) if offloaded_bytes else 0


def caching_allocator_pinned_bytes(block_bytes: list[int]) -> int:
    """What torch's CachingHostAllocator would pin for these blocks held at once (default config: each rounded up
    to a power of two), for comparison with the arena."""
    return sum(1 << max(n - 1, 0).bit_length() for n in block_bytes if n)


class HostArena:
    """Exact-size host memory carved into slots; pinned with cudaHostRegister when `pin` (a CUDA run)."""

    def __init__(self, slots: dict[SlotKey, int], pin: bool):
        self.nbytes = arena_bytes(slots)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pinned_bytes = 0
        if pin and self.nbytes:
            _register(self.buffer)
            self.pinned_bytes = arena_pinned_bytes(self.nbytes)
        self._free: dict[SlotKey, list[torch.Tensor]] = {}
        offset = 0
        for key, count in slots.items():
            size, stride, dtype = key
            for _ in range(count):
                raw = self.buffer[offset:offset + span_bytes(*key)]
                self._free.setdefault(key, []).append(raw.view(dtype).as_strided(size, stride))
                offset += slot_bytes(key)

    def take(self, key: SlotKey) -> torch.Tensor | None:
        """A free slot for a block input of this key, or None when the arena has none left."""
        free = self._free.get(key)
        return free.pop() if free else None

    def give_back(self, key: SlotKey, slot: torch.Tensor) -> None:
        self._free[key].append(slot)

    def release(self) -> None:
        """Unpins and frees the buffer (the caller holds no slot any more)."""
        if self.pinned_bytes:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self._free, self.pinned_bytes, self.nbytes = None, {}, 0, 0


def _register(buffer: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
    if code != 0:
        raise RuntimeError(f"activation offload: pinning the {buffer.nbytes}-byte host arena failed "
                           f"(cudaHostRegister error {code}); set activation_checkpoint.offload = false or free "
                           "host memory")
