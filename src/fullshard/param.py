"""One original parameter's two faces: a sharded DTensor and an unsharded view."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.errors import UnsupportedError
from fullshard.layout import ParamLayout, is_float8
from fullshard.mesh import MeshInfo, SpmdMesh, concatenate_meshes


@dataclass(frozen=True, eq=False)
class ParamSite:
    """One place a parameter is registered: ``module._parameters[name]``.

    A shared (tied) parameter has several sites; every one of them is swapped
    between the sharded and the unsharded parameter together.
    """

    module: nn.Module
    name: str


def full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, also for a CPU-offloaded local piece on an accelerator mesh (gathered there), and
    for float8 (gathered as bytes: gloo has no float8 type)."""
    mesh = value.device_mesh
    local = value.to_local()
    as_bytes = is_float8(local.dtype)
    if local.device.type != mesh.device_type or as_bytes:
        device = local.device
        if device.type != mesh.device_type:
            device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
        local = local.to(device)
        value = DTensor.from_local(local.view(torch.uint8) if as_bytes else local, mesh, value.placements,
                                   run_check=False, shape=value.shape, stride=value.stride())
    full = value.full_tensor()
    return full.view(local.dtype) if as_bytes else full


# Attribute a sharded gradient the reduce-scatter delivered fresh carries: a FlatGrad, the same
# for every gradient of that delivery ([Note: Flat optimizer steps]).
FLAT_GRAD = "_fullshard_flat_grad"


class FlatGrad:
    """A group's whole flat gradient buffer (laid out as its flat shard) and the group, weakly."""

    __slots__ = ("flat", "group")

    def __init__(self, flat: torch.Tensor, group: Any) -> None:
        self.flat, self.group = flat, group

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # A saved or copied gradient is not the delivered one: it keeps an empty set (loadable with
        # torch.load(weights_only=True)) in place of the mark.
        return set, ()


def sharded_axes(placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """Mesh axes over which local pieces are disjoint (Shard, or the _StridedShard of FSDP + TP)."""
    return tuple(axis for axis, placement in enumerate(placements) if not placement.is_replicate())


def rank_axis_view(padded_full: torch.Tensor, shard_dim: int, world_size: int) -> torch.Tensor:
    """View a padded full tensor as ``(world_size, *chunk_shape)``: index r is rank r's chunk."""
    shape = padded_full.shape
    chunk = shape[shard_dim] // world_size
    return padded_full.view(*shape[:shard_dim], world_size, chunk, *shape[shard_dim + 1 :]).movedim(shard_dim, 0)


def _leading(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first elements of ``t`` viewed as ``shape``."""
    return t.view(-1).narrow(0, 0, math.prod(shape)).view(shape)


def slot_rows(slot: torch.Tensor, lay: ParamLayout, rank: int) -> torch.Tensor:
    """``rank``'s real rows in its slot (padded chunk): the slot's first elements, on dim 0 and in a compact
    layout ([Note: Uneven cuts off dim 0] in layout.py) as in an even one."""
    return _leading(slot, lay.local_shape(rank))


def full_rows(full: torch.Tensor, lay: ParamLayout, rank: int) -> torch.Tensor:
    """``rank``'s rows of a full (unpadded) tensor that ``lay`` cuts."""
    return full.narrow(lay.shard_dim, min(rank * lay.chunk_rows, lay.dim_size), lay.rows_on(rank))


def unsharded_view(region: torch.Tensor, lay: ParamLayout) -> torch.Tensor:
    """The full tensor in a parameter's region of the unsharded buffer (rank 0's copy of a 0-dim one): its
    first elements when compact, else the padded full tensor without its padding."""
    if lay.compact:
        return _leading(region, lay.shape)
    full = region.view(lay.padded_shape)
    return full[0] if lay.replicated else full.narrow(lay.shard_dim, 0, lay.dim_size)


def slots_to_full(slots: torch.Tensor, full: torch.Tensor, lay: ParamLayout) -> None:
    """Copy every rank's rows from ``(world_size, shard_numel)`` slots cut as ``lay`` into ``full``, one copy per
    rank (the way for compact layouts)."""
    for rank in range(lay.world_size):
        if lay.rows_on(rank):
            full_rows(full, lay, rank).copy_(slot_rows(slots[rank], lay, rank))


def rows_to_slot(full: torch.Tensor, slot: torch.Tensor, lay: ParamLayout, rank: int) -> None:
    """Fill ``rank``'s slot with its rows of ``full`` (cut as ``lay``), zeros after them."""
    rows = slot_rows(slot, lay, rank)
    rows.copy_(full_rows(full, lay, rank))
    slot.narrow(0, rows.numel(), lay.shard_numel - rows.numel()).zero_()


def full_to_slots(full: torch.Tensor, slots: torch.Tensor, lay: ParamLayout) -> None:
    """Fill ``(world_size, shard_numel)`` slots with every rank's rows of ``full``, one copy per rank."""
    for rank in range(lay.world_size):
        rows_to_slot(full, slots[rank], lay, rank)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


# [Note: Own-storage views]
# A group keeps its shards in one flat buffer, so a plain view of each
# parameter's rows would view that buffer at a storage offset. A DTensor wrapper
# takes its local tensor's offset, and torch (2.13) tells a wrapper (no data of
# its own) from a tensor with data by ``data_ptr() == 0``, which an offset
# breaks: torch.save, copy.deepcopy (of a parameter, or of a plain submodule
# holding one) and DCP's async_save staging then treat the wrapper as holding
# data and raise ("invalid python storage"). They also copy whole storages, so
# even the first parameter's value would carry the group's buffer. The sharded
# parameters' local tensors, state dict values and the flat optimizer state
# therefore come from own_storage_view: the same memory, reached through a
# slice of the buffer's storage that holds exactly the tensor's elements (the
# slice keeps the buffer alive and cannot be resized), so they start at offset
# 0 as FSDP2's do, and changes through them (an optimizer's step, DCP's
# in-place load) reach the flat buffer. Such a view has a version counter of
# its own, apart from the buffer's (ParamGroup._shard_versions reads both). A
# parameter keeps its state-dict view until its local tensor is replaced
# (``ShardedParam.state_dict_view``; a re-link drops it, since it holds the old
# buffer alive), so every state dict hands out the same storages. Gradients
# stay views of the reduce-scatter output, as FSDP2's do.


def own_storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory through a storage that holds exactly its elements (see [Note: Own-storage views])."""
    if type(t) is not torch.Tensor or t.device.type == "meta":
        return t  # a tensor subclass keeps its own storage handling; a meta tensor has no memory
    if t.numel() == 0:
        return t.new_empty(t.shape)
    size = t.element_size()
    nbytes = size * (1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())))
    start = t.storage_offset() * size
    storage = t.untyped_storage()
    if start == 0 and storage.nbytes() == nbytes:
        return t
    return t.new_empty(0).set_(storage[start : start + nbytes], 0, t.shape, t.stride())


# [Note: Tensor parallel]
# A parameter that is already a DTensor on another mesh (tensor parallel, from
# parallelize_module on a "tp" axis) is sharded by fully_shard on dim 0 of its local
# tensor: the flat buffers, the all-gather and the reduce-scatter see only that local
# tensor, and the data-parallel ranks of one TP rank agree on its shape. Around that:
# - the unsharded parameter is a DTensor on the TP mesh with the TP placements (the
#   parallelized forward expects one), viewing the unsharded buffer;
# - its gradient is brought to the TP placements (a Partial sum is all-reduced over
#   the TP ranks) and its local tensor reduce-scattered like any other;
# - the sharded parameter is a DTensor on the concatenated (dp..., tp) mesh with
#   placements (dp placements, TP placements). When the TP placement also shards the
#   FSDP shard dim, the dp placement is _StridedShard(dim, split_factor=TP shards):
#   rank (d, t) holds chunk d of TP chunk t, torch.chunk's rule at both levels.


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """How a DTensor parameter is laid out on its own (TP) mesh, and the (dp, tp) layout fullshard gives it."""

    spec: DTensorSpec  # the parameter as the user gave it: TP mesh, TP placements, global shape
    mesh: DeviceMesh  # dp axes then TP axes; with dp_mesh_dims, the SPMD mesh (its shard axes flattened)
    placements: tuple[Placement, ...]
    dp_axes: frozenset[int] = frozenset()  # axes of ``spec.mesh`` that are data parallel (dp_mesh_dims)

    @classmethod
    def of(cls, param: DTensor, mesh_info: MeshInfo, shard_dim: int) -> TensorParallel:
        spec = param._spec
        if mesh_info.spmd is not None:
            return cls._on_spmd_mesh(spec, mesh_info, mesh_info.spmd, shard_dim)
        split = _tp_split(spec, range(spec.mesh.ndim), shard_dim)
        dp: list[Placement] = []
        for placement in mesh_info.placements(shard_dim):
            if isinstance(placement, Shard) and split > 1:
                placement = _StridedShard(shard_dim, split_factor=split)
            dp.append(placement)
        return cls(spec, concatenate_meshes(mesh_info.mesh, spec.mesh), (*dp, *spec.placements))

    @classmethod
    def _on_spmd_mesh(cls, spec: DTensorSpec, mesh_info: MeshInfo, spmd: SpmdMesh, shard_dim: int) -> TensorParallel:
        """([Note: SPMD meshes] in mesh.py.) The shard placement goes on the first shard axis, strided over the
        tensor-parallel axes after it that shard the same dim."""
        if not spmd.shard_names:
            return cls(spec, spec.mesh, spec.placements, spmd.dp_axes)
        first = spmd.axis(spmd.shard_names[0])
        split = _tp_split(spec, range(first + 1, spec.mesh.ndim), shard_dim)
        shard: Placement = Shard(shard_dim) if split == 1 else _StridedShard(shard_dim, split_factor=split)
        if len(spmd.shard_names) == 1:
            placements = list(spec.placements)
            placements[first] = shard
            return cls(spec, spec.mesh, tuple(placements), spmd.dp_axes)
        # several shard axes: their flattened axis (after the replicate one, for HSDP) replaces them
        meshes: list[DeviceMesh] = []
        placements = []
        assert spec.mesh.mesh_dim_names is not None
        for axis, name in enumerate(spec.mesh.mesh_dim_names):
            if axis == first:
                meshes.append(mesh_info.mesh)
                placements.extend([Replicate(), shard] if spmd.replicate_names else [shard])
            elif axis not in spmd.dp_axes:
                meshes.append(spec.mesh[name])
                placements.append(spec.placements[axis])
        return cls(spec, concatenate_meshes(*meshes), tuple(placements), spmd.dp_axes)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP piece of a full (global) tensor, cut locally (no communication); ``full`` may be a value
        with autograd history (distribute_tensor takes leaves only)."""
        return distribute_tensor(full.detach(), self.spec.mesh, self.spec.placements, src_data_rank=None).to_local()

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's TP piece, any dtype) as a DTensor on the TP mesh."""
        meta = TensorMeta(self.spec.shape, self.spec.stride, local.dtype)
        return DTensor(local, DTensorSpec(self.spec.mesh, self.spec.placements, tensor_meta=meta), requires_grad=False)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of an unsharded gradient, brought to the parameter's TP placements first."""
        if not isinstance(grad, DTensor):
            return grad
        # On the data-parallel axes (dp_mesh_dims) a Replicate or Partial gradient stays as it is: the reduce-scatter
        # sums the local tensors there, as for any gradient. A Shard one is gathered first (each rank needs a whole
        # local tensor to reduce).
        target = tuple(p if axis not in self.dp_axes else Replicate() if g.is_shard() else g
                       for axis, (g, p) in enumerate(zip(grad.placements, self.spec.placements, strict=True)))
        if grad.placements != target:
            grad = grad.redistribute(self.spec.mesh, target)
        return grad.to_local()


def _tp_split(spec: DTensorSpec, axes: range, shard_dim: int) -> int:
    """How many pieces the placements of ``spec`` on ``axes`` cut ``shard_dim`` into."""
    split = 1
    for axis in axes:
        placement = spec.placements[axis]
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            split *= spec.mesh.size(axis)
    return split


def _extension_of(fqn: str, data: torch.Tensor) -> tuple[type, str, Any]:
    if not (hasattr(data, "fsdp_pre_all_gather") and hasattr(data, "fsdp_post_all_gather")):
        raise ValueError(
            f"parameter {fqn!r} ({type(data).__name__}) defines only one of fsdp_pre_all_gather and "
            "fsdp_post_all_gather; an all-gather extension needs both"
        )
    flatten = getattr(data, "__tensor_flatten__", None)
    names, ctx = flatten() if flatten is not None else ([], None)
    inner = getattr(data, names[0]) if len(names) == 1 else None
    if inner is None or type(inner) is not torch.Tensor or inner.shape != data.shape:
        raise NotImplementedError(
            f"parameter {fqn!r}: fullshard shards a tensor subclass with all-gather hooks through its one inner "
            f"tensor of the parameter's shape (__tensor_flatten__ / __tensor_unflatten__); {type(data).__name__} "
            f"flattens to {names}"
        )
    return type(data), names[0], ctx


def inner_tensor(value: torch.Tensor) -> torch.Tensor:
    """The plain data of a tensor subclass with all-gather hooks (the tensor itself otherwise)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is None or type(value) is torch.Tensor or not hasattr(value, "fsdp_pre_all_gather"):
        return value
    names, _ = flatten()
    return cast(torch.Tensor, getattr(value, names[0]))


# Tensors mapped to the sharded parameter they belong to, by id: the originals sharded so far in this
# process (`_claims`) and the unsharded parameters of live groups (`_unsharded_owners`). Entries are weak
# both ways: a tensor's memory is freed once the modules drop it, an id reused by a later tensor does not
# match the dead reference, and an entry made by a group that no longer exists (a fully_shard call that
# failed) does not count.
_WeakTable = dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref["ShardedParam"]]]
_claims: _WeakTable = {}
_unsharded_owners: _WeakTable = {}


def _owner_in(table: _WeakTable, tensor: torch.Tensor) -> ShardedParam | None:
    entry = table.get(id(tensor))
    return entry[1]() if entry is not None and entry[0]() is tensor else None


def _remember(table: _WeakTable, tensor: torch.Tensor, owner: ShardedParam) -> None:
    key = id(tensor)

    def forget(_: object) -> None:
        if table.get(key) is entry:
            del table[key]

    entry = (weakref.ref(tensor, forget), weakref.ref(owner))
    table[key] = entry


def _claim_original(original: torch.Tensor, claimant: ShardedParam) -> ShardedParam | None:
    """Record that ``claimant`` shards ``original``; return the live earlier claimant, if any."""
    earlier = _owner_in(_claims, original)
    if earlier is None:
        _remember(_claims, original, claimant)
    return earlier


def claimant_of(original: torch.Tensor) -> ShardedParam | None:
    """The live sharded parameter that shards ``original``, if any."""
    return _owner_in(_claims, original)


def unsharded_owner(param: torch.Tensor) -> ShardedParam | None:
    """The live sharded parameter whose unsharded parameter ``param`` is, if any."""
    return _owner_in(_unsharded_owners, param)


class _Registrations:
    """How many parameters and submodules were registered on any module of this process."""

    def __init__(self) -> None:
        self.count = 0
        nn.modules.module.register_module_parameter_registration_hook(self._registered)
        nn.modules.module.register_module_module_registration_hook(self._registered)

    def _registered(self, module: nn.Module, name: str, value: object) -> None:
        self.count += 1  # returns None: the registered value stays what it is


registrations = _Registrations()


class ShardedParam:
    """Holds the sharded and unsharded parameter of one original parameter.

    Neither face owns memory of its own: the sharded parameter's local tensor
    is a view into the group's flat shard buffer, and the unsharded parameter a
    view into the group's unsharded buffer. The objects are created once and
    live as long as the group, so optimizers, autograd's saved tensors and
    user references stay valid across every unshard/reshard.
    """

    def __init__(
        self, fqn: str, sites: list[ParamSite], original: torch.Tensor, layout: ParamLayout, mesh_info: MeshInfo,
        tp: TensorParallel | None = None,
    ) -> None:
        self.fqn = fqn
        self.sites = sites
        self.layout = layout  # of the local tensor, for a tensor-parallel parameter
        self.mesh_info = mesh_info
        self.tp = tp  # see [Note: Tensor parallel]
        # A tensor subclass with FSDP2's all-gather hooks: (class, inner tensor name, flatten context); its
        # sharded local tensor is the subclass around this rank's rows (see fullshard.codec.ExtensionCodec).
        self.extension: tuple[type, str, Any] | None = None
        data = original.to_local() if isinstance(original, DTensor) else original
        if hasattr(data, "fsdp_pre_all_gather") or hasattr(data, "fsdp_post_all_gather"):
            self.extension = _extension_of(fqn, data)
        self.orig_dtype = original.dtype
        # Another group that sharded the same original (a tie across fully_shard calls);
        # an error at lazy init, before the two copies could train apart.
        self.shared_with = _claim_original(original, self)
        # Unsharded gradients kept across no-sync backwards when the reduce dtype differs.
        self.accumulated_grad: torch.Tensor | None = None
        self._specs: dict[torch.dtype, DTensorSpec] = {}  # see as_dtensor_of
        # The own-storage view state_dict_value hands out; None when the local tensor was replaced.
        self.state_dict_view: torch.Tensor | None = None
        # requires_grad as the unsharded parameter was registered with (None: not registered since); see
        # keep_requires_grad_change.
        self._registered_requires_grad: bool | None = None
        self.sharded: DTensor = cast(DTensor, original)  # replaced by bind_shard
        self.unsharded: nn.Parameter = cast(nn.Parameter, original)  # replaced by bind_unsharded

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """The parameter's (global) shape."""
        return self.layout.shape if self.tp is None else tuple(self.tp.spec.shape)

    @property
    def requires_grad(self) -> bool:
        # The sharded parameter is what users and optimizers see; follow it.
        return self.sharded.requires_grad

    @cached_property
    def _rows_here(self) -> int:
        return self.layout.rows_on(self.mesh_info.shard_rank)

    def local_rows(self, padded_chunk: torch.Tensor) -> torch.Tensor:
        """This rank's real rows inside its padded chunk of a flat buffer."""
        lay = self.layout
        if lay.replicated:
            return padded_chunk.view(())
        if lay.compact:
            return slot_rows(padded_chunk, lay, self.mesh_info.shard_rank)
        chunk = padded_chunk.view(lay.chunk_shape)
        return chunk if self._rows_here == lay.chunk_rows else chunk.narrow(lay.shard_dim, 0, self._rows_here)

    def fill_shard(self, original: torch.Tensor, padded_chunk: torch.Tensor) -> None:
        """Copy this rank's rows of ``original`` into its chunk, zeroing the padding.

        ``original`` may be the sharded parameter of another group sharded the same way (a tied
        parameter taken over by an enclosing group): its local rows are this rank's rows.
        """
        rows = self.layout.rows_on(self.mesh_info.shard_rank)
        padded_chunk.zero_()
        sharded = isinstance(original, DTensor)
        if self.extension is not None:
            original = inner_tensor(original)  # (of a DTensor: the plain data of its local rows)
        if rows:
            if self.tp is not None and isinstance(original, DTensor) and original.device_mesh == self.tp.spec.mesh:
                local = self.dp_rows(original.to_local())
            elif sharded:
                local = original.to_local() if isinstance(original, DTensor) else original
            else:
                local = self.local_part(original)
            self.local_rows(padded_chunk).copy_(local)

    def as_dtensor(self, padded_chunk: torch.Tensor) -> DTensor:
        """A DTensor whose local tensor views this rank's rows of ``padded_chunk``."""
        return self.as_dtensor_of(self.local_rows(padded_chunk))

    def as_dtensor_of(self, local: torch.Tensor) -> DTensor:
        """A DTensor sharded like this parameter, with ``local`` (this rank's rows) as its local tensor.

        The DTensor's spec (mesh, placements, global shape, stride, dtype) is built once per dtype
        and reused: ``DTensor.from_local`` costs about ten times more, and gradients need a new
        DTensor per parameter and step. ``local`` stays where it is (host memory when offloading):
        ``from_local`` in torch before 2.13 moves it to the mesh's device.
        """
        spec = self._specs.get(local.dtype)
        if spec is None:
            meta = TensorMeta(torch.Size(self.shape), contiguous_stride(self.shape), local.dtype)
            if self.tp is None:
                lay = self.layout
                placements = self.mesh_info.placements(None if lay.replicated else lay.shard_dim)
                spec = DTensorSpec(self.mesh_info.mesh, placements, tensor_meta=meta)
            else:
                spec = DTensorSpec(self.tp.mesh, self.tp.placements, tensor_meta=meta)
            self._specs[local.dtype] = spec
        if local.requires_grad:  # keep the autograd edge to `local`
            return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride)
        # ``__new__`` alone: DTensor's ``__init__`` sets nothing and is wrapped to disable dynamo, which
        # costs more than the construction itself (torch 2.13)
        return cast(DTensor, DTensor.__new__(DTensor, local, spec, requires_grad=False))

    def state_dict_value(self) -> DTensor:
        """The sharded parameter as a state dict value: a DTensor over an own-storage view of its rows
        ([Note: Own-storage views]), an extension's subclass wrapped around one. The view is kept until the
        local tensor is replaced (``state_dict_view = None``), so repeated state dicts hand out the same
        storages (DCP's async stager caches its host copies by storage)."""
        rows = inner_tensor(self.sharded._local_tensor).detach()
        kept = self.state_dict_view
        if kept is None or (kept.data_ptr(), kept.dtype, kept.device, kept.shape, kept.stride()) != (
                rows.data_ptr(), rows.dtype, rows.device, rows.shape, rows.stride()):
            kept = self.state_dict_view = own_storage_view(rows)
        return self.as_dtensor_of(self.wrap_local(kept))

    def wrap_local(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the parameter's tensor subclass (itself when there is none)."""
        if self.extension is None:
            return local
        cls, name, ctx = self.extension
        return cast(torch.Tensor, cls.__tensor_unflatten__({name: local}, ctx, local.shape, local.stride()))  # type: ignore[attr-defined]

    def shard_view(self, padded_chunk: torch.Tensor) -> torch.Tensor:
        """The sharded parameter's local tensor: its rows of ``padded_chunk`` (a chunk of the flat shard buffer)
        through an own-storage view ([Note: Own-storage views])."""
        return self.wrap_local(own_storage_view(self.local_rows(padded_chunk)))

    def bind_shard(self, padded_chunk: torch.Tensor, requires_grad: bool) -> None:
        with torch.no_grad():
            local = self.shard_view(padded_chunk)
            self.sharded = cast(DTensor, nn.Parameter(self.as_dtensor_of(local), requires_grad=requires_grad))
        # The parameter (a detached copy of the DTensor) has a spec of its own, equal to the cached one; gradients
        # share it, so that local optimizer steps find them sharded alike by identity (fullshard.local_step).
        self._specs[self.sharded.dtype] = self.sharded._spec

    def bind_unsharded(self, padded_full: torch.Tensor) -> None:
        """``padded_full``: this parameter's slice of the unsharded buffer."""
        full = unsharded_view(padded_full, self.layout)
        value = full if self.tp is None else self.tp.unsharded(full)
        self._unsharded_value = value
        self.set_unsharded(nn.Parameter(value, requires_grad=self.requires_grad))

    def reattach_unsharded(self) -> None:
        """Point the unsharded parameter at its slice of the unsharded buffer again, where ``.data =`` moved it
        (the buffer's all-gathers would no longer reach it)."""
        value = self._unsharded_value
        if self.tp is None and self.extension is None and self.unsharded.data_ptr() != value.data_ptr():
            with torch.no_grad():
                self.unsharded.data = value

    def set_unsharded(self, param: nn.Parameter) -> None:
        self.unsharded = param
        _remember(_unsharded_owners, param, self)

    def unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded parameter's gradient as autograd left it (a tensor-parallel one a ``DTensor``, which may
        still be a partial sum over the TP axes: ``local_grad`` reduces it)."""
        grad = self.unsharded.grad
        if grad is not None and grad.layout is not torch.strided:
            raise UnsupportedError(
                f"{self.fqn} got a {grad.layout} gradient; fully_shard reduces dense gradients only "
                "(build the module with sparse=False, e.g. nn.Embedding(..., sparse=False))"
            )
        return grad

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` as a plain tensor: a tensor-parallel one's local piece, its TP partial sums reduced."""
        return grad if self.tp is None else self.tp.local_grad(grad)

    @torch.no_grad()
    def adopt(self, value: torch.Tensor) -> None:
        """Copy ``value`` (a DTensor of any placement, or the full tensor) into this rank's shard."""
        if tuple(value.shape) != self.shape:
            raise ValueError(f"{self.fqn}: expected shape {self.shape}, got {tuple(value.shape)}")
        if isinstance(value, DTensor):
            if value.placements == self.sharded.placements and value.device_mesh == self.sharded.device_mesh:
                self.sharded.to_local().copy_(value.to_local())
                return
            value = full_tensor(value)
        self.sharded.to_local().copy_(self.local_part(value))

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor (no communication)."""
        return self.dp_rows(full if self.tp is None else self.tp.local_of(full))

    def dp_rows(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the tensor the layout cuts (the full one, or a TP piece)."""
        return local if self.layout.replicated else full_rows(local, self.layout, self.mesh_info.shard_rank)

    def register(self, param: torch.Tensor, keep_assigned: bool = False) -> None:
        """Register ``param`` at every site; with ``keep_assigned``, not where the module holds neither face of
        this parameter: a value assigned since, which a root takes over ([Note: Changes after the first forward]
        in runtime.py)."""
        for site in self.sites:
            if keep_assigned:
                current = site.module._parameters.get(site.name)
                if current is not self.sharded and current is not self.unsharded:
                    continue
            site.module._parameters[site.name] = cast(nn.Parameter, param)

    def register_unsharded(self, keep_assigned: bool = False) -> None:
        self.keep_requires_grad_change()
        if self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)
        self._registered_requires_grad = self.requires_grad
        self.register(self.unsharded, keep_assigned)

    def keep_requires_grad_change(self) -> None:
        """Carry a ``requires_grad_`` applied to the registered unsharded parameter (the module's parameter between
        a forward and its backward: freezing or unfreezing there) over to the sharded one, unless the sharded one
        was changed as well; on a plain module the change stays. Called before either is registered again."""
        shown, self._registered_requires_grad = self._registered_requires_grad, None
        if shown is not None and self.unsharded.requires_grad != shown and self.sharded.requires_grad == shown:
            self.sharded.requires_grad_(self.unsharded.requires_grad)
