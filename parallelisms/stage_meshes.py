"""Every process group a run uses, made once at setup by every rank, and released when its ramp stage ends.

Why: on NCCL with a bound device (build.py binds one), `new_group` splits the WORLD communicator (`ncclCommSplit`),
which every world rank must join, in the same order. A group made on demand inside a step (the hybrid CP subgroups
at the first attention call, a later ramp stage's mesh at its first step) waits for ranks that are busy elsewhere,
e.g. a pipeline stage blocked in a receive: a hang. So every group is made here, when the run is built, through
DeviceMesh (which splits through `split_group` when a device is bound, or calls `new_group` for every subgroup on
every rank otherwise):

- the first stage's mesh: `ParallelDims.build_mesh` (pp, dp_replicate, dp_shard, cp, tp and the flattened ones);
- a later stage that trades dp_shard for cp: the first mesh's flattened (dp_shard, cp) dim unflattened to the
  stage's (dp_shard, cp), so only its dp_shard, cp and data groups are new (FSDP, loss, pp, tp groups are shared);
- hybrid CP: a stage's cp dim unflattened to (ring, ulysses) for the Ulysses degree attention will use.

At a stage switch the old stage's groups that no later stage uses are destroyed (`release_stage`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from config.errors import Refusal
from parallelisms.cp.choice import Topology, choose_cp_impl, hybrid_degree
from parallelisms.cp.layouts import AUTO, DOCUMENTS, HYBRID
from parallelisms.parallel_dims import ParallelDims, TrainingMesh


def hybrid_subgroups(cp_mesh: DeviceMesh, ulysses_degree: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(Ulysses group of `ulysses_degree` consecutive CP ranks, ring group of the ranks with the same offset), made
    for every CP group of the world at once: every world rank must call this, in the same order."""
    size = cp_mesh.size()
    split = cp_mesh._unflatten(0, (size // ulysses_degree, ulysses_degree), ("cp_ring", "cp_ulysses"))
    return split["cp_ulysses"].get_group(), split["cp_ring"].get_group()


def add_hybrid_subgroups(mesh: TrainingMesh, ulysses_degree: int | None) -> TrainingMesh:
    """`mesh` with its CP subgroups for `ulysses_degree` (None or cp 1: none needed)."""
    if ulysses_degree is not None and mesh.dims.cp > 1 and ulysses_degree not in mesh.cp_subgroups:
        mesh.cp_subgroups[ulysses_degree] = hybrid_subgroups(mesh.cp_mesh, ulysses_degree)
    return mesh


def derived_stage_mesh(first: TrainingMesh, dims: ParallelDims) -> TrainingMesh:
    """The mesh of a stage whose dims differ from the first's only in (dp_shard, cp), sharing every other group."""
    changed = {f.name for f in dataclasses.fields(ParallelDims) if getattr(dims, f.name) != getattr(first.dims, f.name)}
    if changed - {"dp_shard", "cp"}:
        raise Refusal(f"a ramp stage may change only dp_shard and cp, not {sorted(changed)}")
    split = first.fsdp_shard._unflatten(0, (dims.dp_shard, dims.cp), ("dp_shard", "cp"))
    world = DeviceMesh._concatenate([first["pp"], first["dp_replicate"], split["dp_shard"], split["cp"],
                                     first["tp"]])
    # The flattened names live in the root mesh: the data split differs per cp, FSDP and loss layouts are the first's.
    return TrainingMesh(dims=dims, world=world,
                        data=world["dp_replicate", "dp_shard"]._flatten(f"dp_at_cp{dims.cp}"),
                        fsdp_shard=first.fsdp_shard,
                        loss=world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"))


def build_stage_meshes(dims_per_stage: list[ParallelDims], device_type: str,
                       ulysses_degree: Callable[[int, TrainingMesh], int | None]) -> list[TrainingMesh]:
    """One TrainingMesh per stage (stages with equal dims share one object), every group made now, on every rank,
    in the same order. `ulysses_degree(i, mesh)`: the hybrid CP degree stage i runs (None: no hybrid)."""
    first = dims_per_stage[0].build_mesh(device_type)
    by_dims: dict[ParallelDims, TrainingMesh] = {dims_per_stage[0]: first}
    meshes = []
    for i, dims in enumerate(dims_per_stage):
        if dims not in by_dims:
            by_dims[dims] = derived_stage_mesh(first, dims)
        meshes.append(add_hybrid_subgroups(by_dims[dims], ulysses_degree(i, by_dims[dims])))
    return meshes


def planned_ulysses_degree(mesh: TrainingMesh, cp_impl: str, load_balancer: str, q_heads: int, kv_heads: int,
                           device_type: str) -> int | None:
    """The Ulysses degree hybrid CP will run on `mesh` (the rule CPAttention applies at its first call, with the
    heads one TP rank holds), or None when this stage's attention makes no hybrid groups."""
    if mesh.dims.cp == 1 or cp_impl not in (HYBRID, AUTO) or (cp_impl == AUTO and load_balancer == DOCUMENTS):
        return None
    topology = Topology.of(mesh.cp_mesh.get_group(), device_type)
    degree = hybrid_degree(topology, q_heads, kv_heads)
    if cp_impl == "auto":
        picked = choose_cp_impl(topology, q_heads, kv_heads, load_balancer, False)
        return picked.ulysses_degree if picked.impl == "hybrid" else None
    return degree


def mesh_groups(mesh: TrainingMesh) -> set[dist.ProcessGroup]:
    """Every process group this rank holds in `mesh` (each dim, the flattened ones, the hybrid subgroups)."""
    groups = {mesh.world.get_group(name) for name in mesh.world.mesh_dim_names}
    groups |= {mesh.data.get_group(), mesh.fsdp_shard.get_group(), mesh.loss.get_group()}
    groups |= {pg for pair in mesh.cp_subgroups.values() for pg in pair}
    return groups


def release_stage(old: TrainingMesh, later: list[TrainingMesh]) -> int:
    """Destroys the groups of `old` that no mesh in `later` uses (never the default group); returns how many."""
    keep = set().union(*(mesh_groups(m) for m in later)) if later else set()
    default = dist.distributed_c10d._get_default_group()
    doomed = sorted((pg for pg in mesh_groups(old) - keep if pg is not default), key=lambda pg: pg.group_name)
    for pg in doomed:
        dist.destroy_process_group(pg)
    if not any(m is old for m in later):  # a later stage with the same dims runs on this very mesh
        old.cp_subgroups.clear()
    return len(doomed)
