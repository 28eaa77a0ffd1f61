"""A test double for NCCL's point-to-point rules, to run the CP code as P ranks in threads of one process.

gloo buffers sends, so a ring that posts a send-only group and then a receive-only group on every rank works on CPU;
NCCL runs each rank's groups in order on one stream, and a send in a group completes only when the peer's matching
receive sits in the group the peer is running at that moment. Once messages outgrow NCCL's internal buffers, a ring
of such groups waits on itself. This double enforces that rule strictly (no buffering at any size), so a tiny CPU
test finds what would hang a real run:

- each `batch_isend_irecv` call is one group; a rank's groups run one after another, in posting order;
- the k-th send from a to b matches the k-th receive at b from a (NCCL has no tags), and only while both sit in the
  group their rank is running; sizes and dtypes must agree (NCCL would silently reinterpret the bytes);
- buffers must be contiguous;
- when every rank still running is waiting and no pair can match, it raises `NcclDeadlock` on every rank, naming
  what each rank waits for.

`run_ring_ranks(fn, size)` runs `fn(group)` once per simulated rank with `torch.distributed`'s point-to-point entry
points patched to the double (`group` is that rank's `SimGroup`). On a GPU the same double runs every rank's blocks of
a CP layout on one device, with NCCL's grouping rule still enforced.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class NcclDeadlock(RuntimeError):
    """Every running rank waits on an operation that can no longer be matched under NCCL's grouping rule."""


@dataclass(eq=False)
class _Op:
    send: bool
    rank: int
    peer: int
    tensor: torch.Tensor
    group_index: int
    pair_index: int
    done: bool = False
    gathered: list | None = None  # all_gather's output list (collectives run when every rank reaches them)

    def describe(self) -> str:
        if self.gathered is not None:
            return f"all_gather #{self.pair_index} in its group #{self.group_index}"
        kind = "send to" if self.send else "receive from"
        return f"{kind} rank {self.peer} ({self.tensor.numel()} x {self.tensor.dtype}) in its group #{self.group_index}"


@dataclass(eq=False)
class _Group:
    ops: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)


class SimGroup:
    """One simulated rank's view of the communicator (what the code under test passes as `group`)."""

    def __init__(self, world: "NcclP2PWorld", rank: int):
        self.world, self.rank, self.size = world, rank, world.size


class _Work:
    def __init__(self, world: "NcclP2PWorld", op: _Op):
        self.world, self.op = world, op

    def wait(self) -> bool:
        self.world.wait(self.op)
        return True

    def is_completed(self) -> bool:
        return self.op.done


class SimP2POp:
    """Stands in for `dist.P2POp` (whose constructor resolves ranks through the real c10d registry)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class NcclP2PWorld:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.groups: list[list[_Group]] = [[] for _ in range(size)]
        self.pairs: dict[tuple[bool, int, int], list[_Op]] = {}
        self.collectives: list[list[_Op]] = [[] for _ in range(size)]
        self.waiting: dict[int, _Op] = {}
        self.finished: set[int] = set()
        self.failure: str | None = None
        self.groups_posted = 0

    # ------------------------------------------------------------------ posting
    def post(self, rank: int, p2p_ops) -> list[_Work]:
        with self.cond:
            group = _Group()
            index = len(self.groups[rank])
            for p in p2p_ops:
                if not p.tensor.is_contiguous():
                    raise ValueError(f"rank {rank}: NCCL needs contiguous buffers, got strides {p.tensor.stride()}")
                send = p.op is dist.isend
                key = (send, rank, p.peer)
                queue = self.pairs.setdefault(key, [])
                op = _Op(send, rank, p.peer, p.tensor, index, len(queue))
                queue.append(op)
                group.ops.append(op)
            self.groups[rank].append(group)
            self.groups_posted += 1
            self._progress()
            self.cond.notify_all()
            return [_Work(self, op) for op in group.ops]

    def all_gather(self, rank: int, outputs: list, tensor: torch.Tensor) -> _Work:
        """A collective is a group of its own, in stream order with the point-to-point groups."""
        with self.cond:
            op = _Op(False, rank, -1, tensor, len(self.groups[rank]), len(self.collectives[rank]), gathered=outputs)
            self.collectives[rank].append(op)
            self.groups[rank].append(_Group([op]))
            self._progress()
            self.cond.notify_all()
            return _Work(self, op)

    # ------------------------------------------------------------------ matching
    def _running_group(self, rank: int) -> int | None:
        for i, group in enumerate(self.groups[rank]):
            if not group.done:
                return i
        return None

    def _run_collective(self) -> bool:
        """Runs the next all_gather once every rank's running group is that same collective."""
        ops = []
        for rank in range(self.size):
            running = self._running_group(rank)
            if running is None or self.groups[rank][running].ops[0].gathered is None:
                return False
            ops.append(self.groups[rank][running].ops[0])
        if len({op.pair_index for op in ops}) != 1:
            return False
        with torch.no_grad():
            for op in ops:
                for out, src in zip(op.gathered, ops):
                    out.copy_(src.tensor)
        for op in ops:
            op.done = True
        return True

    def _progress(self) -> bool:
        moved, any_moved = True, False
        while moved:
            moved = self._run_collective()
            any_moved |= moved
            for rank in range(self.size):
                running = self._running_group(rank)
                if running is None:
                    continue
                for op in self.groups[rank][running].ops:
                    if op.done or not op.send or op.gathered is not None:
                        continue
                    receives = self.pairs.get((False, op.peer, rank), [])
                    if op.pair_index >= len(receives):
                        continue  # the peer has not posted the matching receive yet
                    recv = receives[op.pair_index]
                    if recv.group_index != self._running_group(op.peer):
                        continue  # posted, but in a later group of the peer: NCCL cannot match it now
                    if recv.tensor.numel() != op.tensor.numel() or recv.tensor.dtype != op.tensor.dtype:
                        self.failure = (f"rank {rank} sends {op.tensor.numel()} x {op.tensor.dtype} to rank "
                                        f"{op.peer}, which receives {recv.tensor.numel()} x {recv.tensor.dtype}")
                        self.cond.notify_all()
                        return any_moved
                    with torch.no_grad():
                        recv.tensor.copy_(op.tensor)
                    op.done = recv.done = True
                    moved = any_moved = True
        return any_moved

    # ------------------------------------------------------------------ waiting
    def wait(self, op: _Op) -> None:
        with self.cond:
            self.waiting[op.rank] = op
            try:
                while not op.done:
                    if self.failure:
                        raise NcclDeadlock(self.failure)
                    if self._progress():
                        self.cond.notify_all()
                        continue
                    if self._stuck():
                        self.failure = self._explain()
                        self.cond.notify_all()
                        raise NcclDeadlock(self.failure)
                    self.cond.wait(timeout=1.0)
            finally:
                self.waiting.pop(op.rank, None)

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()

    def _stuck(self) -> bool:
        """Every rank has finished or waits on an operation not yet done (a rank whose operation was just matched
        is still listed as waiting until it wakes up: it is not blocked)."""
        blocked = [rank for rank, op in self.waiting.items() if not op.done]
        return bool(blocked) and len(blocked) + len(self.finished) == self.size

    def _explain(self) -> str:
        lines = ["NCCL grouping rule: every running rank waits and no send can meet its receive in the group its "
                 "peer is running"]
        for rank in range(self.size):
            running = self._running_group(rank)
            if rank in self.waiting and not self.waiting[rank].done:
                pending = [o.describe() for o in self.groups[rank][running].ops if not o.done] if running is not None \
                    else []
                lines.append(f"  rank {rank} waits in its group #{running}: {'; '.join(pending)}")
            else:
                lines.append(f"  rank {rank} has finished")
        return "\n".join(lines)


def _patched_dist(world: NcclP2PWorld, local: threading.local):
    def rank_of(group=None):
        return group.rank if isinstance(group, SimGroup) else local.rank

    def size_of(group=None):
        return world.size

    def batch_isend_irecv(ops):
        return world.post(ops[0].group.rank if isinstance(ops[0].group, SimGroup) else local.rank, ops) if ops else []

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        work = world.all_gather(rank_of(group), tensor_list, tensor)
        if async_op:
            return work
        work.wait()
        return None

    return {"P2POp": SimP2POp, "batch_isend_irecv": batch_isend_irecv, "all_gather": all_gather, "get_rank": rank_of,
            "get_world_size": size_of, "get_global_rank": lambda group, rank: rank, "is_initialized": lambda: True}


def run_ring_ranks(fn, size: int, monkeypatch, timeout: float = 120.0) -> list:
    """`fn(group)` on `size` simulated ranks in threads; returns their results in rank order, or raises the first
    rank's error (an `NcclDeadlock` when the code breaks NCCL's grouping rule)."""
    world = NcclP2PWorld(size)
    local = threading.local()
    for name, value in _patched_dist(world, local).items():
        monkeypatch.setattr(dist, name, value)
    results, errors = [None] * size, [None] * size

    def body(rank):
        local.rank = rank
        try:
            results[rank] = fn(SimGroup(world, rank))
        except BaseException as e:  # reported below, in rank order
            errors[rank] = e
        finally:
            world.finish(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated ranks still running after {timeout}s")
    # A rank's own error first: the others then wait on it, and their NcclDeadlock only echoes it.
    for error in sorted((e for e in errors if e is not None), key=lambda e: isinstance(e, NcclDeadlock)):
        raise error
    return results
