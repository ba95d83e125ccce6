"""State as types, as in FSDP2's ``_fsdp_common``: which mesh dims a group shards and replicates
over, and where in a training step a fully_shard module is."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.distributed as dist

from hpservice.dtensor import DeviceMesh


@dataclass
class FSDPMeshInfo:
    """The 1-d mesh fully_shard shards over (the last dim of the mesh it was given)."""

    mesh: DeviceMesh
    shard_mesh_dim: int
    shard_process_group: dist.ProcessGroup = field(init=False)
    shard_mesh_size: int = field(init=False)  # S: ranks that each hold 1/S of every parameter
    shard_mesh_rank: int = field(init=False)

    def __post_init__(self):
        self.shard_process_group = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_size = self.mesh.size(self.shard_mesh_dim)
        self.shard_mesh_rank = self.mesh.get_local_rank(self.shard_mesh_dim)


@dataclass
class HSDPMeshInfo(FSDPMeshInfo):
    """HSDP: shard over the last dim, replicate (all-reduce the reduced shards) over the first."""

    replicate_mesh_dim: int = 0
    replicate_process_group: dist.ProcessGroup = field(init=False)
    replicate_mesh_size: int = field(init=False)
    replicate_mesh_rank: int = field(init=False)

    def __post_init__(self):
        super().__post_init__()
        self.replicate_process_group = self.mesh.get_group(self.replicate_mesh_dim)
        self.replicate_mesh_size = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_mesh_rank = self.mesh.get_local_rank(self.replicate_mesh_dim)


def mesh_info(mesh: DeviceMesh) -> FSDPMeshInfo:
    """FSDP on a 1-d mesh, HSDP on a 2-d (replicate, shard) one."""
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    if mesh.ndim == 2:
        return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(f"fully_shard(mesh): expected a 1-D (FSDP) or 2-D (replicate, shard) DeviceMesh, got {mesh!r}")


class TrainingState(enum.Enum):
    """Where a fully_shard module is in the step (FSDP2's names)."""

    IDLE = "idle"  # between steps, or after its forward
    FORWARD = "forward"  # inside its forward (pre-forward hook ran, post-forward not yet)
    PRE_BACKWARD = "pre_backward"  # its backward has started (the gradient of an output arrived)
