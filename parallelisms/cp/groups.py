"""The process group a CP call runs over, from whatever the caller holds (a leaf of the package)."""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from config.errors import Refusal


def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup or a 1-D DeviceMesh (None means the default group)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise Refusal(f"context parallelism needs a 1-D DeviceMesh, got {group.ndim} dims "
                             f"{group.mesh_dim_names}; pass mesh['cp']")
        return group.get_group()
    return group if group is not None else dist.group.WORLD


def group_name(group) -> str:
    """The name the registered CP op (cp/op.py) finds this group's open `context_parallel` block by: the process
    group's own name (a run constant, so a compiled graph may hold it). A stand-in without one (the NCCL double runs
    its ranks as threads of one process, each with its own group object) is named per object."""
    name = getattr(group, "group_name", None)
    return name if isinstance(name, str) and name else f"{type(group).__name__}@{id(group):x}"
