"""Parallel degrees, checked against the world size, and the one DeviceMesh they define.

Mesh dims, outer to inner: pp, dp_replicate, dp_shard, cp, tp. Derived meshes:
- data loading: dp_replicate x dp_shard (ranks that see different rows; CP/TP ranks of one DP rank share rows),
- FSDP: dp_shard x cp flattened (CP ranks hold different tokens, so their gradients must be reduced too),
  replicated over dp_replicate (HSDP),
- loss: every rank of one batch (dp_replicate x dp_shard x cp), over which token counts are summed.
Because FSDP shards over the flattened (dp_shard, cp) group, trading dp_shard for cp keeps every parameter shard
where it is; only the data split and the CP groups change.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import RecipeError

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int

    @classmethod
    def resolve(cls, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, world_size: int,
                where: str = "recipe") -> "ParallelDims":
        """Fills dp_shard = -1 with the ranks the other degrees leave and checks the product is the world size."""
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others:
                raise RecipeError(
                    f"{where}: {world_size} ranks cannot be split into pp {pp} x dp_replicate {dp_replicate} x "
                    f"cp {cp} x tp {tp} = {others} (x dp_shard). Launch a multiple of {others} ranks "
                    f"(NPROC={others}) or change the degrees.")
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise RecipeError(
                f"{where}: parallel degrees pp {pp} x dp_replicate {dp_replicate} x dp_shard {dp_shard} x cp {cp} "
                f"x tp {tp} = {product}, but {world_size} ranks were launched. Launch NPROC={product} or set "
                f"parallelism.dp_shard = -1.")
        return cls(pp, dp_replicate, dp_shard, cp, tp, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different row slices one global batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def build_mesh(self, device_type: str) -> "TrainingMesh":
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
        if self.tp > 1 and self.dp_shard * self.cp > 1:
            # FSDP2 over TP gives parameters and gradients the 2-D mesh (dp_shard_cp, tp): with this flattened group
            # DTensor reduces the gradient norm's partials over both in one all-reduce instead of two in sequence
            mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
        return TrainingMesh(
            dims=self,
            world=mesh,
            data=mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            fsdp_shard=mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            loss=mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        )


@dataclass
class TrainingMesh:
    """The root mesh plus the flattened sub-meshes the trainer needs (kept as handles, not looked up by name)."""
    dims: ParallelDims
    world: object
    data: object
    fsdp_shard: object
    loss: object
    cp_subgroups: dict = field(default_factory=dict)
    """{Ulysses degree: (Ulysses group, ring group)} of hybrid CP, made at setup (parallelisms/stage_meshes.py)."""

    def __getitem__(self, name):
        return self.world[name]

    @property
    def dp_rank(self) -> int:
        return self.data.get_local_rank()

    @functools.cached_property
    def cp_mesh(self):
        """Sliced once: slicing reads the mesh's rank tensor back (.tolist), which every micro-step would repeat."""
        return self.world["cp"]

    @property
    def tp_mesh(self):
        return self.world["tp"]

    @property
    def pp_mesh(self):
        return self.world["pp"]

    def fsdp_mesh(self):
        """HSDP 2-D mesh (dp_replicate, dp_shard_cp) when replicating, else the flattened 1-D shard mesh."""
        if self.dims.dp_replicate > 1:
            return DeviceMesh._concatenate([self.world["dp_replicate"], self.fsdp_shard])
        return self.fsdp_shard
