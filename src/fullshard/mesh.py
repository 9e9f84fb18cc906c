"""The data-parallel mesh: which process group shards, which device computes."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from fullshard.errors import ArgumentTypeError, OverlappingMeshError, UnnamedMeshError, UsageError

try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch before 2.13: the same two names, so code written for either works

    @dataclass(frozen=True)
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Names of the mesh axes that shard and that replicate (each a name, a tuple of names, or None)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        @property
        def shard_names(self) -> tuple[str, ...]:
            return _names(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return _names(self.replicate)

    def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
        return () if value is None else (value,) if isinstance(value, str) else tuple(value)


# [Note: SPMD meshes]
# With dp_mesh_dims, the mesh passed to fully_shard is the whole SPMD mesh (data-parallel
# axes beside tensor-parallel ones) and every parameter is already a DTensor on it,
# Replicate on the axes dp_mesh_dims names. The collectives run over the data-parallel
# axes only: the shard axes (several are flattened into one) form the shard group, the
# replicate axes (likewise) the replicate group, both together an HSDP mesh. Each
# parameter is then handled as a tensor-parallel one ([Note: Tensor parallel] in
# param.py) whose own mesh is the SPMD mesh: its local tensor is what the data-parallel
# ranks shard, the unsharded parameter is the DTensor as the user gave it, and the
# sharded one is that DTensor with Shard on the shard axis (several shard axes: on their
# flattened axis, which takes the place of the first).


@dataclass(frozen=True)
class SpmdMesh:
    """The whole mesh of ``dp_mesh_dims`` and the names of its data-parallel axes ([Note: SPMD meshes])."""

    mesh: DeviceMesh
    shard_names: tuple[str, ...]
    replicate_names: tuple[str, ...]

    def axis(self, name: str) -> int:
        assert self.mesh.mesh_dim_names is not None
        return self.mesh.mesh_dim_names.index(name)

    @cached_property
    def dp_axes(self) -> frozenset[int]:
        return frozenset(self.axis(name) for name in self.shard_names + self.replicate_names)


@dataclass(frozen=True)
class MeshInfo:
    """Which mesh axis shards parameters and which (HSDP) replicates them.

    A 1-D mesh shards over its only axis. A 2-D mesh is ``(replicate, shard)``:
    parameters are sharded within each row and gradients all-reduced across
    rows; a shard axis of size 1 is plain data parallel (DDP). Groups, sizes and
    ranks are looked up once (the mesh does not change).
    """

    mesh: DeviceMesh
    shard_axis: int | None = 0  # None: nothing is sharded (replicate-only, like DDP)
    replicate_axis: int | None = None
    spmd: SpmdMesh | None = None  # set by dp_mesh_dims: ``mesh`` holds its data-parallel axes

    @cached_property
    def shard_group(self) -> dist.ProcessGroup | None:
        """``None`` when parameters are not sharded: collectives over it are skipped."""
        return None if self.shard_axis is None else self.mesh.get_group(self.shard_axis)

    @cached_property
    def shard_size(self) -> int:
        return 1 if self.shard_axis is None else self.mesh.size(self.shard_axis)

    @cached_property
    def shard_rank(self) -> int:
        return 0 if self.shard_axis is None else self.mesh.get_local_rank(self.shard_axis)

    @cached_property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return None if self.replicate_axis is None else self.mesh.get_group(self.replicate_axis)

    @cached_property
    def replicate_size(self) -> int:
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)

    @cached_property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size

    def placements(self, shard_dim: int | None) -> tuple[Placement, ...]:
        """A parameter's placements: ``Shard(shard_dim)`` on the shard axis; None: replicated everywhere."""
        return tuple(Shard(shard_dim) if axis == self.shard_axis and shard_dim is not None else Replicate()
                     for axis in range(self.mesh.ndim))


def default_device_type() -> str:
    """The accelerator type when one is present (``cuda`` under NCCL), else ``cpu``."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def resolve_mesh(mesh: DeviceMesh | None, dp_mesh_dims: object | None = None) -> MeshInfo:
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
        raise ArgumentTypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is not None:
        return _mesh_info_from_names(mesh, dp_mesh_dims)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 1:
        return MeshInfo(mesh)
    if mesh.mesh_dim_names is None:
        raise UsageError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: "
            "init_device_mesh(device_type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))"
        )
    return MeshInfo(mesh, shard_axis=1, replicate_axis=0)


def _mesh_info_from_names(mesh: DeviceMesh, dims: object) -> MeshInfo:
    """``dp_mesh_dims`` (torch's ``DataParallelMeshDims``): the data-parallel axes of the SPMD mesh ``mesh``."""
    if not hasattr(dims, "shard_names") and not hasattr(dims, "replicate_names"):
        raise ArgumentTypeError(
            f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got {type(dims).__name__}")
    shard_names: tuple[str, ...] = tuple(getattr(dims, "shard_names", ()))
    replicate_names: tuple[str, ...] = tuple(getattr(dims, "replicate_names", ()))
    if not shard_names and not replicate_names:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in shard_names + replicate_names:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")
    if len(set(shard_names + replicate_names)) < len(shard_names + replicate_names):
        raise OverlappingMeshError(f"dp_mesh_dims names a mesh axis twice: {dims}")

    def axes(names: tuple[str, ...]) -> DeviceMesh:  # one axis, or several flattened into one
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    spmd = SpmdMesh(mesh, shard_names, replicate_names)
    if not replicate_names:
        return MeshInfo(axes(shard_names), shard_axis=0, spmd=spmd)
    if not shard_names:
        return MeshInfo(axes(replicate_names), shard_axis=None, replicate_axis=0, spmd=spmd)
    return MeshInfo(concatenate_meshes(axes(replicate_names), axes(shard_names)), shard_axis=1, replicate_axis=0,
                    spmd=spmd)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The compute device of this rank: the mesh's device type, at the current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def post_forward_group(mesh_info: MeshInfo, size: int) -> dist.ProcessGroup:
    """The group of ``size`` consecutive ranks of this rank's shard group that it reshards to after forward.

    Every rank of the default group must call this together: the shard groups may be rows of a mesh this rank
    sees only its own row of (``mesh["dp"]`` beside ``"tp"``), so they are exchanged first and every group of
    every row is created, in one order on every rank.
    """
    assert mesh_info.shard_group is not None
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(mesh_info.shard_group))
    chunks = sorted({tuple(row[i : i + size]) for row in rows for i in range(0, len(row), size)})
    group, _ = dist.new_subgroups_by_enumeration([list(chunk) for chunk in chunks])
    return group


def concatenate_meshes(*meshes: DeviceMesh) -> DeviceMesh:
    """The mesh whose axes are those of ``meshes`` in order: distinct named axes of one mesh (e.g. its dp and tp)."""
    names = [m.mesh_dim_names for m in meshes]
    flat = [n for axes in names if axes is not None for n in axes]
    unnamed = any(axes is None for axes in names)
    if unnamed or len(set(flat)) < len(flat):
        raise (UnnamedMeshError if unnamed else OverlappingMeshError)(
            f"a tensor-parallel parameter needs the data-parallel mesh and its own mesh (axes {tuple(names)}) to be "
            "distinct named axes of one mesh, e.g. mesh['dp'] and mesh['tp'] of "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return cast(DeviceMesh, concatenate(list(meshes)))
    root = meshes[0]._get_root_mesh()  # torch before 2.13: slice the common root mesh by name
    if any(m._get_root_mesh() is not root for m in meshes):
        raise ValueError(f"the meshes with axes {tuple(names)} come from different meshes")
    return root[tuple(flat)]
