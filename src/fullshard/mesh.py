"""The data-parallel mesh: which process group shards, which device computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard


@dataclass(frozen=True)
class MeshInfo:
    """A 1-D mesh whose only axis shards parameters."""

    mesh: DeviceMesh
    shard_axis: int = 0

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_axis)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_axis)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_axis)

    def placements(self, shard_dim: int) -> tuple[Placement, ...]:
        return (Shard(shard_dim),)


def default_device_type() -> str:
    """The accelerator type when one is present (``cuda`` under NCCL), else ``cpu``."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def resolve_mesh(mesh: DeviceMesh | None) -> MeshInfo:
    if mesh is None:
        if not dist.is_initialized():
            # Like FSDP2: initialise from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
            try:
                dist.init_process_group()
            except ValueError as err:
                raise ValueError(
                    "fully_shard needs an initialized default process group when mesh=None, and the "
                    f"environment does not describe one ({err}); launch with torchrun or call "
                    "torch.distributed.init_process_group() first"
                ) from err
        mesh = init_device_mesh(default_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2:
        raise NotImplementedError("2-D (HSDP) meshes are not supported yet; pass a 1-D mesh")
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard expects a 1-D or 2-D DeviceMesh, got {mesh.ndim} dimensions: {mesh}")
    return MeshInfo(mesh)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The compute device of this rank: the mesh's device type, at the current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())
