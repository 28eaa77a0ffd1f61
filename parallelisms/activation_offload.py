"""Activation offload: the hidden state each checkpointed block keeps for its recompute lives in host memory between
the block's forward and its backward.

Why this is enough: non-reentrant activation checkpointing stores a block's inputs as saved tensors made under the
AMBIENT saved-tensor hooks (torch/utils/checkpoint.py, `_CheckpointFrame.save_inputs`), and everything the block saves
inside its forward goes to checkpoint's own, innermost hooks. So a `saved_tensors_hooks` context around the
checkpoint call sees exactly the block's inputs: (h, cos, sin). Only `h` is moved: the RoPE tables are shared by every
block (moving them would free nothing and copy them once per block). Under `op` mode the outputs the policy saves
(attention, every other matmul) are cached by checkpoint's dispatch mode, not by saved-tensor hooks: they stay on
the device; only the block input is offloaded, as in `full` and `selective` mode.

The copies run through the device module's streams and events (`torch.cuda` or `torch.cpu`), so CPU runs the same
code as CUDA; there the streams and events are no-ops and a copy is a plain copy into a separate host buffer.
On CUDA: host buffers are slots of one pinned arena per ramp stage (host_arena.py: exactly the bytes the stage holds
at its peak, counted in its first step, which copies into plain host buffers; released at the stage switch); device->host copies run on a side stream after the compute
stream's work so far, and the device tensor is kept referenced until its copy's event completes; when backward
unpacks block i's input, block i-1's input is brought back on the side stream at once (backward visits blocks in
reverse; `prefetch`, on by default), and the compute stream waits on that copy's event before using it.

Under tensor parallelism the plan hands blocks the local (B, S/tp, dim) residual shard (a plain tensor, or the
lazy AsyncCollectiveTensor of the reduce-scatter, waited for before the copy and returned as a plain tensor); a
DTensor input is rebuilt with its mesh, placements, shape and stride.

Under fake tensors (the dry run, training/planning/memory_probe.py) nothing is copied: the record keeps shapes and a byte
count, which `host_bytes` / `peak_host_bytes` report, so the memory tracker sees the device tensor freed and a new
one allocated when backward needs it, and host memory is reported separately.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from config.torch_support import empty_host_cache
from parallelisms.host_arena import HostArena, span_bytes


class _Record:
    """One offloaded block input: its host copy (or, under fake tensors, only its metadata) and how to rebuild it."""
    __slots__ = ("size", "stride", "dtype", "device", "nbytes", "dtensor", "host", "fake", "layer", "prev",
                 "prefetched", "ready", "done", "key", "in_arena", "__weakref__")


class ActivationOffloader:
    """Saved-tensor hooks for checkpointed blocks; one per model (its host arena is shared by all blocks)."""

    def __init__(self):
        self.host_bytes = 0
        """Bytes of block inputs held in host memory now."""
        self.peak_host_bytes = 0
        """The most `host_bytes` has been since the last `reset_peak()`."""
        self._pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # plain host buffers before the arena
        self.arena: HostArena | None = None
        """This stage's host arena (pinned on CUDA), made when the stage's first step has released every input."""
        self._live: dict[tuple, int] = defaultdict(int)  # block inputs held now, per (size, stride, dtype)
        self._most: dict[tuple, int] = {}  # the most held at once, per key, before the arena exists
        self._pin = False
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (event, device tensor) of running copies
        self._streams: dict[torch.device, object] = {}
        self._last: weakref.ref | None = None
        self.enabled = True
        """Off: `hooks` adds nothing, so a checkpointed block runs exactly as plain checkpointing (a ramp stage
        without offload in a run built with the offloader; the trainer sets it per stage)."""
        self.keep_last = 0
        """The inputs of the last this many checkpointed blocks (`layers`) stay on the device: backward needs the
        last one first (no device byte more at its peak), and each kept one is host memory and two copies saved.
        activation_checkpoint.offload_keep_last."""
        self.layers: list[int] = []
        """The checkpointed blocks' indices in this model part (set by apply_activation_checkpointing)."""
        self.prefetch = True
        """Bring block i-1's input back as soon as block i's is unpacked (the copy overlaps block i's recompute and
        backward; two block inputs on the device); off: each when its own recompute unpacks it (one on the device, the
        compute stream waiting for the copy). activation_checkpoint.offload_prefetch."""

    def follow(self, ac) -> None:
        """Takes a ramp stage's [activation_checkpoint] section (offload, offload_prefetch, offload_keep_last)."""
        self.enabled, self.prefetch, self.keep_last = ac.offload, ac.offload_prefetch, ac.offload_keep_last

    def reset_peak(self) -> None:
        self.peak_host_bytes = self.host_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes really pinned for offload now (the arena's whole pages on CUDA; 0 on CPU)."""
        return self.arena.pinned_bytes if self.arena is not None else 0

    @property
    def arena_bytes(self) -> int:
        return self.arena.nbytes if self.arena is not None else 0

    @property
    def needed_bytes(self) -> int:
        """The bytes of block inputs this stage holds at once (what its arena is sized to)."""
        return sum(count * span_bytes(*key) for key, count in self._most.items())

    def release_arena(self) -> None:
        """At a stage switch (nothing held): frees this stage's arena and plain buffers, and empties torch's host
        cache, so no pinned byte of the stage remains; the next stage counts its own needs in its first step."""
        if self.host_bytes:
            raise RuntimeError("activation offload: the host arena is released while block inputs are offloaded")
        if self.arena is not None:
            self.arena.release()
        self.arena, self._most = None, {}
        self._pool.clear()
        self._live.clear()
        empty_host_cache()

    def hooks(self, hidden: torch.Tensor, layer: int):
        """The context to run one block's checkpoint call in: offloads `hidden` (the block input) when it is saved.
        Autograd keeps the pack hook with every tensor saved under it, so the hook holds `hidden` weakly."""
        if not self.enabled or (self.keep_last and layer in self.layers[-self.keep_last:]):
            return contextlib.nullcontext()
        target = weakref.ref(hidden)
        return torch.autograd.graph.saved_tensors_hooks(lambda x: self._pack(x, target(), layer), self._unpack)

    # ---- forward: device -> host
    def _pack(self, x: torch.Tensor, hidden: torch.Tensor, layer: int):
        if x is not hidden:
            return x  # the RoPE tables: shared by every block, kept where they are
        local = x._local_tensor if isinstance(x, DTensor) else x
        if isinstance(local, AsyncCollectiveTensor):  # TP's reduce-scattered residual: wait on the compute stream
            local = local.wait()
        rec = _Record()
        rec.size, rec.stride, rec.dtype, rec.device = local.size(), local.stride(), local.dtype, local.device
        rec.nbytes = local.numel() * local.element_size()
        rec.dtensor = (x.device_mesh, x.placements, x.size(), x.stride()) if isinstance(x, DTensor) else None
        rec.fake, rec.layer, rec.done = is_fake(local), layer, False
        rec.prefetched = rec.ready = rec.host = None
        previous = self._last() if self._last is not None else None
        rec.prev = weakref.ref(previous) if previous is not None and previous.layer < layer else None
        self._last = weakref.ref(rec)
        if not rec.fake:
            self._release_finished()
            rec.host = self._host_buffer(rec)
            stream, module = self._side_stream(local.device), torch.get_device_module(local.device)
            stream.wait_stream(module.current_stream(local.device))  # the tensor is final on the compute stream
            with module.stream(stream):
                rec.host.copy_(local, non_blocking=True)
                event = module.Event()
                event.record(stream)
            self._in_flight.append((event, local))  # the device memory stays ours until the copy is done
            self._release_finished()
        self.host_bytes += rec.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return rec

    def _host_buffer(self, rec: _Record) -> torch.Tensor:
        """A slot of the arena; before it exists (or past what it holds), a plain host buffer, counted per key."""
        rec.key = (rec.size, rec.stride, rec.dtype)
        slot = self.arena.take(rec.key) if self.arena is not None else None
        rec.in_arena = slot is not None
        if slot is not None:
            return slot
        self._pin = rec.device.type == "cuda"
        if self.arena is None:
            self._live[rec.key] += 1
            self._most[rec.key] = max(self._most.get(rec.key, 0), self._live[rec.key])
        free = self._pool[rec.key]
        return free.pop() if free else torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device="cpu")

    def _release_finished(self) -> None:
        self._in_flight = [(event, t) for event, t in self._in_flight if not event.query()]

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            module = torch.get_device_module(device)
            self._streams[device] = module.Stream(device=device) if device.type == "cuda" else module.Stream()
        return self._streams[device]

    # ---- backward: host -> device
    def _unpack(self, rec):
        if not isinstance(rec, _Record):
            return rec
        if rec.done:
            raise RuntimeError("an offloaded block input was unpacked twice (backward with retain_graph=True over "
                               "checkpointed blocks): set activation_checkpoint.offload = false for that")
        self._release_finished()
        if rec.prefetched is None:
            self._bring_back(rec)
        local = rec.prefetched
        if not rec.fake:
            module = torch.get_device_module(rec.device)
            compute = module.current_stream(rec.device)
            compute.wait_event(rec.ready)
            if rec.device.type == "cuda":  # allocated on the side stream, used and freed on the compute stream
                local.record_stream(compute)
        previous = rec.prev() if rec.prev is not None else None
        if self.prefetch and previous is not None and not previous.done and previous.prefetched is None:
            self._bring_back(previous)  # backward visits blocks in reverse: the next input it needs
        self._finish(rec)
        if rec.dtensor is None:
            return local
        mesh, placements, size, stride = rec.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=size, stride=stride)

    def _bring_back(self, rec: _Record) -> None:
        """Starts the host -> device copy of `rec` on the side stream (after its device -> host copy, same stream)."""
        if rec.fake:
            rec.prefetched = torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device=rec.device)
            return
        module = torch.get_device_module(rec.device)
        stream = self._side_stream(rec.device)
        with module.stream(stream):
            local = torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device=rec.device)
            local.copy_(rec.host, non_blocking=True)
            rec.ready = module.Event()
            rec.ready.record(stream)
        rec.prefetched = local

    def _finish(self, rec: _Record) -> None:
        """The host buffer goes back to the pool: a later device -> host copy into it is queued on the same side
        stream, after this record's host -> device copy."""
        rec.done, rec.prefetched = True, None
        if rec.host is not None:
            if rec.in_arena:
                self.arena.give_back(rec.key, rec.host)
            else:
                self._pool[rec.key].append(rec.host)
                if self.arena is None:
                    self._live[rec.key] -= 1
            rec.host = None
        self.host_bytes -= rec.nbytes
        if self.host_bytes == 0 and self.arena is None and self._most and not rec.fake:
            self._pool.clear()  # the plain buffers of the counting step go; the arena replaces them
            self.arena = HostArena(dict(self._most), pin=self._pin)
