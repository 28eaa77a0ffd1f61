"""A test double for NCCL's ordering rules, to run the CP code as P ranks in threads of one process.

gloo buffers sends; NCCL runs each rank's groups in order on one stream, and a send completes only when the peer's
matching receive sits in the group the peer is running then (a ring of send-only then receive-only groups hangs once
messages outgrow NCCL's buffers). This double enforces that strictly, so a tiny CPU test finds what would hang:

- each `batch_isend_irecv` call is one group; a rank's groups run one after another, in posting order;
- the k-th send from a to b matches the k-th receive at b from a on the same communicator (NCCL has no tags), only
  while both sit in the group their rank is running; sizes and dtypes must agree (NCCL would reinterpret bytes);
- a collective (`all_gather`, `all_gather_single`, `reduce_scatter_single`, `all_to_all_single`, with equal or
  variable splits: rank i's j-th input split must be rank j's i-th output split) is a group of its own in the same
  stream order: it runs once every member of its communicator is running its k-th
  collective on that communicator, and they must all be the same kind with the same sizes;
- `new_group(ranks)` makes a sub-communicator (hybrid CP's Ulysses and ring groups); with a device bound (as
  build.py binds it on CUDA) it splits the world communicator (ncclCommSplit): every world rank's k-th `new_group`
  is one collective of the whole world, `use_local_synchronization=True` or not, and the groups must partition
  consistently; a rank that never comes leaves the others waiting (`NcclDeadlock`);
- reducing collectives (`all_reduce`, `reduce_scatter_single`) must use the same op on every member (NCCL would
  combine SUM on one rank with MAX on another silently);
- buffers must be contiguous and on the run's device: a host tensor (from `torch.from_numpy`, `.cpu()`,
  `device="cpu"`, ...; tagged by tests/nccl_device_rule.py's `HostTensors` inside each rank) is refused with
  NCCL's "No backend type associated with device type cpu";
- data move as NCCL moves them, asynchronously: a send buffer (a collective's input) is copied at post, so writing
  it afterwards changes nothing received; a receive buffer (a collective's output) holds poison (NaN, or -1 for
  integers) from post until `wait()` on its work, which delivers the data;
- when every running rank waits and nothing can run, it raises `NcclDeadlock` on every rank, naming each wait.

`run_ring_ranks(fn, size)` runs `fn(group)` once per simulated rank with `torch.distributed`'s entry points patched to
the double (`group` is that rank's `SimGroup` of the whole world). The copies run on the tensors' own device, so on a
GPU the same double runs every rank's blocks of a CP layout on one device, real kernels and NCCL's rules together.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.distributed import thread_stacks
from tests.nccl_async_data import poison
from tests.nccl_collectives import execute
from tests.nccl_device_rule import HostTensors, host_factories, refuse_off_device


class NcclDeadlock(RuntimeError):
    """Every running rank waits on an operation that can no longer be matched under NCCL's grouping rule."""


@dataclass(eq=False)
class _Op:
    send: bool
    rank: int  # global rank that posted it
    peer: int  # global rank of the peer (-1 for a collective)
    tensor: torch.Tensor  # the buffer sent or received; a collective's input
    group_index: int  # position in the posting rank's stream
    pair_index: int  # k-th op of its (communicator, direction, rank, peer); k-th collective on its communicator
    comm: tuple = ()  # global ranks of the communicator
    done: bool = False
    collective: str | None = None  # kind of collective, None for point-to-point
    output: object = None  # a collective's output tensor (a list of tensors for all_gather)
    splits: tuple | None = None  # all_to_all_single with variable splits: (output splits, input splits)
    reduce_op: object = None  # a reducing collective's op
    deliveries: list = field(default_factory=list)  # (the caller's buffer, the private one the data arrive in)

    def deliver(self) -> None:
        """At `wait()`: the data reach the caller's receive buffers (poisoned until now)."""
        with torch.no_grad():
            for user, private in self.deliveries:
                user.copy_(private)
        self.deliveries = []

    def describe(self) -> str:
        if self.collective is not None:
            return f"{self.collective} #{self.pair_index} on ranks {list(self.comm)} in its group #{self.group_index}"
        kind = "send to" if self.send else "receive from"
        return f"{kind} rank {self.peer} ({self.tensor.numel()} x {self.tensor.dtype}) in its group #{self.group_index}"


@dataclass(eq=False)
class _Group:
    ops: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(op.done for op in self.ops)


class SimGroup:
    """One simulated rank's view of a communicator (what the code under test passes as `group`): `rank` is its rank
    in the communicator, `members` the communicator's global ranks."""

    def __init__(self, world: "NcclP2PWorld", global_rank: int, members: tuple | None = None):
        self.world, self.global_rank = world, global_rank
        self.members = tuple(range(world.size)) if members is None else tuple(members)
        self.rank, self.size = self.members.index(global_rank), len(self.members)


class _Work:
    def __init__(self, world: "NcclP2PWorld", op: _Op):
        self.world, self.op = world, op

    def wait(self) -> bool:
        self.world.wait(self.op)
        return True

    def is_completed(self) -> bool:
        if self.op.done:
            self.op.deliver()  # completion observed: the data are there
        return self.op.done


class SimP2POp:
    """Stands in for `dist.P2POp` (whose constructor resolves ranks through the real c10d registry)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def _check_contiguous(rank: int, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"rank {rank}: NCCL needs contiguous buffers, got strides {t.stride()}")


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """What NCCL will send: the buffer as it is at post (later writes are not seen)."""
    with torch.no_grad():
        return t.detach().clone()


def _receive_into(op: _Op, user: torch.Tensor) -> torch.Tensor:
    """A private buffer that the data arrive in; the caller's buffer is poisoned until `wait()` delivers them."""
    private = torch.empty_like(user)
    op.deliveries.append((user, private))
    poison(user)
    return private


class NcclP2PWorld:
    def __init__(self, size: int, run_device_type: str | None = None):
        self.size = size
        self.hosts = [HostTensors(run_device_type, tests_are_project=False) for _ in range(size)]
        self.cond = threading.Condition()
        self.groups: list[list[_Group]] = [[] for _ in range(size)]
        self.pairs: dict[tuple, list[_Op]] = {}
        self.collective_counts: dict[tuple[tuple, int], int] = {}  # (communicator, rank) -> collectives posted
        self.waiting: dict[int, _Op] = {}
        self.finished: set[int] = set()
        self.failure: str | None = None
        self.groups_posted = 0
        self.idle_waits = 0  # waits that ended by their 1 s timeout with nothing new: each costs a rank a second

    # ------------------------------------------------------------------ posting
    def post(self, rank: int, comm: tuple, p2p_ops) -> list[_Work]:
        with self.cond:
            group = _Group()
            index = len(self.groups[rank])
            for p in p2p_ops:
                _check_contiguous(rank, p.tensor)
                refuse_off_device(self.hosts[rank], f"rank {rank}'s batch_isend_irecv", [p.tensor])
            sends = {id(p): _snapshot(p.tensor) for p in p2p_ops if p.op is dist.isend}  # before any poisoning
            for p in p2p_ops:
                send = p.op is dist.isend
                queue = self.pairs.setdefault((comm, send, rank, p.peer), [])
                op = _Op(send, rank, p.peer, sends.get(id(p)), index, len(queue), comm)
                if not send:
                    op.tensor = _receive_into(op, p.tensor)
                queue.append(op)
                group.ops.append(op)
            self.groups[rank].append(group)
            self.groups_posted += 1
            self._progress()
            self.cond.notify_all()
            return [_Work(self, op) for op in group.ops]

    def collective(self, rank: int, comm: tuple, kind: str, output, tensor: torch.Tensor, splits=None,
                   reduce_op=None) -> _Work:
        """A collective is a group of its own, in stream order with the point-to-point groups."""
        with self.cond:
            outputs = [] if output is None else output if isinstance(output, list) else [output]
            _check_contiguous(rank, tensor, *outputs)
            if kind != "new_group":
                refuse_off_device(self.hosts[rank], f"rank {rank}'s {kind}", [tensor, *outputs])
            count = self.collective_counts.get((comm, rank), 0)
            self.collective_counts[(comm, rank)] = count + 1
            op = _Op(False, rank, -1, _snapshot(tensor), len(self.groups[rank]), count, comm, collective=kind,
                     splits=splits, reduce_op=reduce_op)
            private = [_receive_into(op, t) for t in outputs]
            op.output = private if isinstance(output, list) else (private[0] if private else None)
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

    def _running_collective(self, rank: int) -> _Op | None:
        running = self._running_group(rank)
        if running is None or self.groups[rank][running].ops[0].collective is None:
            return None
        return self.groups[rank][running].ops[0]

    def _run_collectives(self) -> bool:
        """Runs every collective whose members are all running it."""
        moved = False
        for rank in range(self.size):
            head = self._running_collective(rank)
            if head is None:
                continue
            ops = [self._running_collective(member) for member in head.comm]
            if any(op is None or op.comm != head.comm or op.pair_index != head.pair_index for op in ops):
                continue
            kinds = {op.collective for op in ops}
            error = f"ranks {list(head.comm)} run different collectives together: {sorted(kinds)}" \
                if len(kinds) > 1 else execute(head.collective, ops)
            if error:
                self.failure = error
                return moved
            for op in ops:
                op.done = True
            moved = True
        return moved

    def _progress(self) -> bool:
        moved, any_moved = True, False
        while moved and not self.failure:
            moved = self._run_collectives()
            any_moved |= moved
            for rank in range(self.size):
                running = self._running_group(rank)
                if running is None:
                    continue
                for op in self.groups[rank][running].ops:
                    if op.done or not op.send:
                        continue
                    receives = self.pairs.get((op.comm, False, op.peer, rank), [])
                    if op.pair_index >= len(receives):
                        continue  # the peer has not posted the matching receive yet
                    recv = receives[op.pair_index]
                    if recv.group_index != self._running_group(op.peer):
                        continue  # posted, but in a later group of the peer: NCCL cannot match it now
                    if recv.tensor.numel() != op.tensor.numel() or recv.tensor.dtype != op.tensor.dtype:
                        self.failure = (f"rank {rank} sends {op.tensor.numel()} x {op.tensor.dtype} to rank "
                                        f"{op.peer}, which receives {recv.tensor.numel()} x {recv.tensor.dtype}")
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
                        self.cond.notify_all()
                        raise NcclDeadlock(self.failure)
                    if self._progress():
                        self.cond.notify_all()
                        continue
                    if self._stuck():
                        self.failure = self._explain()
                        self.cond.notify_all()
                        raise NcclDeadlock(self.failure)
                    if not self.cond.wait(timeout=1.0):
                        self.idle_waits += 1
                op.deliver()
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
                 "peer is running (nor can any collective run)"]
        for rank in range(self.size):
            running = self._running_group(rank)
            if rank in self.waiting and not self.waiting[rank].done:
                pending = [o.describe() for o in self.groups[rank][running].ops if not o.done] if running is not None \
                    else []
                lines.append(f"  rank {rank} waits in its group #{running}: {'; '.join(pending)}")
            else:
                lines.append(f"  rank {rank} has finished")
        return "\n".join(lines)


def _patched_dist(world: NcclP2PWorld, local: threading.local, bound_device: bool) -> dict:
    """The torch.distributed entry points the project's CP code calls, answered by the double."""
    def group_of(group) -> SimGroup:
        return group if isinstance(group, SimGroup) else local.world_group

    def run(group, kind, output, tensor, async_op, splits=None, reduce_op=None):
        g = group_of(group)
        work = world.collective(g.global_rank, g.members, kind, output, tensor, splits, reduce_op)
        if async_op:
            return work
        work.wait()
        return None

    def batch_isend_irecv(ops):
        if not ops:
            return []
        g = group_of(ops[0].group)
        return world.post(g.global_rank, g.members, ops)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return run(group, "all_gather", list(tensor_list), tensor, async_op)

    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        return run(group, "all_gather_single", output_tensor, input_tensor, async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return run(group, "reduce_scatter_single", output, input, async_op, reduce_op=op)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return run(group, "all_reduce", tensor, tensor, async_op, reduce_op=op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if output_split_sizes is not None or input_split_sizes is not None:
            n = group_of(group).size
            splits = (tuple(output_split_sizes or [output.numel() // n] * n),
                      tuple(input_split_sizes or [input.numel() // n] * n))
            return run(group, "all_to_all_single_v", output, input, async_op, splits)
        return run(group, "all_to_all_single", output, input, async_op)

    def new_group(ranks=None, *args, **kwargs):
        members = tuple(sorted(ranks)) if ranks is not None else tuple(range(world.size))
        if bound_device:  # ncclCommSplit of the world communicator: every world rank takes part
            marker = torch.empty(0)
            run(local.world_group, "new_group", None, marker, False, splits=members)
        return SimGroup(world, local.rank, members) if local.rank in members else None

    return {"P2POp": SimP2POp, "batch_isend_irecv": batch_isend_irecv, "all_gather": all_gather,
            "all_gather_single": all_gather_single, "all_gather_into_tensor": all_gather_single,
            "reduce_scatter_single": reduce_scatter_single, "reduce_scatter_tensor": reduce_scatter_single,
            "all_to_all_single": all_to_all_single, "new_group": new_group, "all_reduce": all_reduce,
            "get_rank": lambda group=None: group_of(group).rank,
            "get_world_size": lambda group=None: group_of(group).size,
            "get_global_rank": lambda group, rank: group_of(group).members[rank], "is_initialized": lambda: True}


def run_ring_ranks(fn, size: int, monkeypatch, timeout: float = 120.0, run_device_type: str | None = None,
                   bound_device: bool = True) -> list:
    """`fn(group)` on `size` simulated ranks in threads; returns their results in rank order, or raises the first
    rank's error (an `NcclDeadlock` when the code breaks NCCL's ordering rules), or, past `timeout`, every live
    rank's stack. `run_device_type`: the device the buffers must be on (by default the device of the first buffer a
    rank posts: "cuda" in the GPU tier, "cpu", standing in for it, elsewhere); `bound_device`:
    `init_process_group(device_id=...)` was called, as build.py does on CUDA (group creation splits the world)."""
    world = NcclP2PWorld(size, run_device_type)
    local = threading.local()
    for name, value in _patched_dist(world, local, bound_device).items():
        monkeypatch.setattr(dist, name, value, raising=False)  # older torch lacks some *_single names
    for name, value in host_factories().items():
        monkeypatch.setattr(torch, name, value)
    results, errors = [None] * size, [None] * size

    def body(rank):
        local.rank, local.world_group = rank, SimGroup(world, rank)
        try:
            with world.hosts[rank]:  # tags this rank's host tensors (modes are per thread)
                results[rank] = fn(local.world_group)
        except BaseException as e:  # reported below, in rank order
            errors[rank] = e
        finally:
            world.finish(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank {r}") for r in range(size)]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated ranks still running after {timeout}s:\n{thread_stacks(threads)}")
    if world.idle_waits:
        print(f"NCCL-rule double: {world.idle_waits} wait(s) of a rank ended by their 1 s timeout, not a wake-up")
    # A rank's own error first: the others then wait on it, and their NcclDeadlock only echoes it.
    for error in sorted((e for e in errors if e is not None), key=lambda e: isinstance(e, NcclDeadlock)):
        raise error
    return results
