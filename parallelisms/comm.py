"""Every collective and point-to-point call the project makes, written to NCCL's rules rather than gloo's.

gloo forgives three things NCCL does not (docs/design.md), and each has one place here:
- Device: a process group serves only the device types it was created for (`init_process_group("nccl")` has no CPU
  backend). `Collectives` belongs to one run and builds every bookkeeping tensor (token counts, metrics) on that
  run's device; a tensor on another device is refused with NCCL's own message, on CPU too.
- Grouping: sends and receives that must progress together go in ONE group. `RingLinks.exchange` is the only way a
  ring talks and it always posts everything a step sends and receives as one batch: a send-only group followed by a
  receive-only group on every rank of a ring waits on itself under NCCL once messages outgrow its buffers.
- Layout: NCCL reads raw memory, so every buffer handed to it must be contiguous.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from config import torch_support
from config.errors import Refusal

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def check_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise Refusal(f"communication buffer of shape {tuple(t.shape)} and strides {t.stride()} is not "
                             "contiguous; NCCL reads raw memory, so pass a contiguous buffer")


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of a tensor that already lives on the run's device (gradient norms, losses)."""
    check_contiguous(tensor)
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's `input` concatenated into `output` (`all_gather_into_tensor` before torch 2.13:
    config/torch_support.py picks the name)."""
    check_contiguous(output, input)
    return torch_support.all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum over ranks of `input`, this rank's slice into `output` (`reduce_scatter_tensor` before torch 2.13:
    config/torch_support.py picks the name)."""
    check_contiguous(output, input)
    return torch_support.reduce_scatter_single(output, input, group=group, async_op=async_op)


def all_to_all_rows(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group=None, async_op: bool = False):
    """all_to_all_single with variable splits (element counts per peer, in group rank order; a zero split moves
    nothing between that pair). Every rank must post it, with splits that match its peers'."""
    check_contiguous(output, input)
    return dist.all_to_all_single(output, input, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                  group=group, async_op=async_op)


class Collectives:
    """The bookkeeping collectives of one run, on the run's device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def check_device(self, *tensors: torch.Tensor) -> None:
        """NCCL's failure, raised on any backend: a collective on a tensor of another device type."""
        for t in tensors:
            if t.device.type != self.device.type:
                raise RuntimeError(f"No backend type associated with device type {t.device.type}: this run "
                                   f"communicates on {self.device.type}; create the tensor with "
                                   f"device={self.device} (as NCCL requires)")

    def all_reduce_(self, tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
        self.check_device(tensor)
        return all_reduce_(tensor, group, op)

    def reduce_values(self, values: Sequence[float], group=None, op: str = "sum") -> list[float]:
        """Python numbers reduced over `group` (sum or max), through one float64 tensor on the run's device."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        return self.all_reduce_(tensor, group, op).tolist()


class RingLinks:
    """Point-to-point with the next and the previous rank of a group (addressed by global rank, as c10d wants)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send_next: Sequence[torch.Tensor], recv_prev: Sequence[torch.Tensor], tag: int = 0) -> list:
        """Posts every send to the next rank and every receive from the previous one as ONE group; returns the works.

        Every rank of the ring must post the same sequence of exchanges with the same number of buffers in the same
        order: NCCL matches the k-th send of a pair with its k-th receive (it has no tags; gloo gets `tag`)."""
        check_contiguous(*send_next, *recv_prev)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send_next]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv_prev]
        return dist.batch_isend_irecv(ops) if ops else []


class ShiftLinks:
    """Point-to-point with the ranks at any offset of a group (the documents layout's sparse ring,
    cp/exchange_ring_sparse.py)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor, int]],
                 receives: Sequence[tuple[int, torch.Tensor, int]]) -> list:
        """Posts every (offset, buffer, tag) send to rank + offset and receive from rank + offset as ONE group (none
        when both are empty). Peers must post matching lists in the same order (NCCL pairs the k-th send of a pair
        with its k-th receive; gloo gets the tags)."""
        check_contiguous(*(t for _, t, _ in sends), *(t for _, t, _ in receives))
        ops = [dist.P2POp(dist.isend, t, self.peer(off), self.group, tag) for off, t, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peer(off), self.group, tag) for off, t, tag in receives]
        return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: Sequence) -> None:
    for work in works:
        work.wait()
