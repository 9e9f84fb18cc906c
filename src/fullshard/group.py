"""A parameter group: the unit of communication, with its flat buffers and state machine."""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.codec import Codec
from fullshard.collectives import CommStreams, PendingCollective, all_gather, all_gather_packed, broadcast, unpack
from fullshard.errors import MetaParameterError
from fullshard.layout import GroupLayout, ParamLayout, is_float8
from fullshard.mesh import MeshInfo
from fullshard.param import (
    ShardedParam,
    full_tensor,
    inner_tensor,
    rank_axis_view,
    registrations,
    rows_to_slot,
    sharded_axes,
    slots_to_full,
    unsharded_view,
)
from fullshard.reduce import GradReducer


class ShardedState(Enum):
    """Which parameters are registered on the modules and what holds memory."""

    # Sharded parameters registered; only the flat shard buffer holds memory.
    SHARDED = auto()
    # All-gather in flight: sharded parameters still registered; the
    # all-gather output is allocated but may not be read yet.
    UNSHARDING = auto()
    # Unsharded parameters registered; the unsharded buffer is allocated and
    # filled. The flat shard buffer stays allocated (it is the source of truth).
    UNSHARDED = auto()
    # After forward with reshard_after_forward=k: sharded parameters registered;
    # the post-forward shard buffer holds this rank's 1/k of the unsharded
    # parameters, so backward all-gathers within k ranks only.
    SHARDED_POST_FORWARD = auto()


@dataclass
class PostForwardShard:
    """The smaller sharding kept between forward and backward (``reshard_after_forward=k``).

    ``group`` holds ``k`` consecutive ranks of the shard group; ``layout`` cuts
    every parameter into ``k`` chunks; ``buffer`` (compute dtype) holds this
    rank's chunk and is freed (storage size 0) outside SHARDED_POST_FORWARD.
    """

    layout: GroupLayout
    group: dist.ProcessGroup
    rank: int
    buffer: torch.Tensor


# Sharded parameter (by id) -> the group whose flat shard buffer holds it. No reference to the
# parameter itself (a weak one would forbid torch.utils.swap_tensors): a live group keeps its
# parameters alive, so an id it lists is still that parameter's.
_owners: dict[int, weakref.ref[ParamGroup]] = {}


def group_of(param: torch.Tensor) -> ParamGroup | None:
    """The group that shards ``param`` (a sharded parameter), if any."""
    entry = _owners.get(id(param))
    group = entry() if entry is not None else None
    return group if group is not None and id(param) in group.sharded_ids else None


def promoted_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """torch's promotion of a mixed group's dtypes ([Note: Mixed dtypes]), leaving out the one-byte floats it
    does not promote (float8: frozen quantized weights, which have no gradient to reduce)."""
    promotable = [d for d in dtypes if not is_float8(d)] or dtypes[:1]
    return functools.reduce(torch.promote_types, promotable)


def _views(local: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``local`` (a sharded parameter's local tensor) reaches the memory of ``rows`` (its rows of the flat
    shard buffer), directly or through an own-storage view ([Note: Own-storage views] in param.py)."""
    if rows.device.type == "meta":  # no addresses: a view of the same storage at the same offset
        return local.untyped_storage()._cdata == rows.untyped_storage()._cdata and local.storage_offset() == rows.storage_offset()
    if rows.numel() == 0:
        return local.numel() == 0
    return local.data_ptr() == rows.data_ptr() and local.shape == rows.shape and local.stride() == rows.stride()


class ParamGroup:
    """The parameters of one ``fully_shard`` call.

    Owns the flat shard buffer (persistent), the unsharded buffer (allocated
    only between unshard and reshard) and moves between the states of
    :class:`ShardedState` through ``unshard`` / ``wait_for_unshard`` /
    ``reshard``. Gradients leave through ``reducer`` (:class:`fullshard.reduce.GradReducer`).
    """

    def __init__(
        self,
        params: list[ShardedParam],
        originals: list[torch.Tensor],
        mesh_info: MeshInfo,
        device: torch.device,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        streams: CommStreams,
        offload_to_cpu: bool = False,
        pin_memory: bool = False,
        reduce_on_wire_only: bool = False,
    ) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.streams = streams
        self.label = ""  # qualified module name, filled in at lazy init
        self.call_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the fully_shard call's modules
        self.layout = GroupLayout(tuple(p.layout for p in params))
        orig_dtype = params[0].orig_dtype
        # Parameters of several dtypes ([Note: Mixed dtypes]): byte buffers with typed views.
        self.mixed = len({p.orig_dtype for p in params}) > 1
        if self.mixed:
            orig_dtype = promoted_dtype([p.orig_dtype for p in params])
        self._policy_dtypes = (compute_dtype, reduce_dtype)
        self.reduce_on_wire_only = reduce_on_wire_only
        self._set_dtypes(orig_dtype)
        self._pending_all_gather: PendingCollective | None = None
        self._pending_layout = self.layout  # the layout the in-flight all-gather's output has
        self.post_forward: PostForwardShard | None = None
        # Where the flat shard and gradient buffers live: the device, or pinned CPU memory when offloading.
        self.offload_to_cpu = offload_to_cpu
        self.shard_device = torch.device("cpu") if offload_to_cpu else device
        self.pin_memory = offload_to_cpu and pin_memory and device.type != "cpu"
        self.reducer = GradReducer(self)  # gradient reduction and its settings
        self.summoned = False  # inside summon_full_params
        self._summoned: set[int] = set()  # the objects summon registered (by id), while summoned
        # The unsharded gradients that backwards without sync accumulated, set aside while summoned
        self._held_grads: list[torch.Tensor | None] = []
        self.all_gather_comm: Any = None  # FSDPModule.set_custom_all_gather: torch's AllGather
        # One codec per parameter when the group all-gathers packed ([Note: Packed all-gather] in codec.py).
        self.codecs: list[Codec] | None = None
        self._part_counts: list[int] = []
        # [Note: Converting a group]: the member modules converted since the flat shard buffer was last
        # linked, and whether the sharded parameters have left it (linked again before the next all-gather).
        self._converted: set[nn.Module] = set()
        self.stale = False
        # registrations.count when a root last took over what was assigned to the group's modules: until the
        # next one, registering leaves assigned values where they are ([Note: Changes after the first forward]).
        self.registrations_seen = -1
        # Registers the state dict hooks on modules that start holding a parameter of this group (set by fully_shard).
        self.on_new_sites: Any = None
        # Whether the copies of the replicated (0-dim) parameters were made equal since the flat shard buffer
        # was filled or written from outside (see sync_replicas).
        self.replicas_synced = False
        # Each unsharded parameter's version when its values were last gathered ([Note: Changes to unsharded
        # parameters]); the groups already warned about.
        self._gathered_versions: list[int] = []
        self._warned_changed = False
        # The sharded values' versions (_shard_versions) when the unsharded values (or their post-forward copy)
        # were gathered from them ([Note: Sharded parameters changed while unsharded]); -1: not from these.
        self._gathered_from = -1
        # Resharded with its unsharded buffer kept alive for a graph that saved it ([Note: Double backward]).
        self.storage_kept = False

        # Parameters on the meta device (deferred initialisation) get a meta flat shard
        # buffer; `FSDPModule.to_empty()` / `_apply` re-link them to real memory. Where only
        # some are (a module moved to meta before fully_shard), the others keep their values
        # in chunks of their own: the group starts stale ([Note: Converting a group]).
        on_meta = any(original.device.type == "meta" for original in originals)
        with torch.no_grad():
            self.flat_shard = self._new_flat_shard(orig_dtype, torch.device("meta") if on_meta else self.shard_device,
                                                   torch.empty, pin=self.pin_memory and not on_meta)
            for p, original, chunk in zip(params, originals, self.chunks(self.flat_shard)):
                if original.device.type != "meta":
                    if on_meta:
                        chunk = torch.empty_like(chunk, device=self.shard_device)
                        self.stale = True
                    p.fill_shard(original.detach(), chunk)
                p.bind_shard(chunk, requires_grad=original.requires_grad)
            self._bind_unsharded_buffer()
        self.state = ShardedState.SHARDED
        self._register_owner()
        for p in params:
            p.register(p.sharded)

    def _register_owner(self) -> None:
        self.sharded_ids = frozenset(id(p.sharded) for p in self.params)
        self.weak_self = weakref.ref(self)
        for p in self.params:
            _owners[id(p.sharded)] = self.weak_self

    # [Note: Mixed dtypes]
    # A group whose parameters have different dtypes (fp32 norms beside bf16 weights) keeps
    # its flat shard buffer as bytes, each parameter's chunk a typed view at an offset
    # aligned to 16 bytes; so is the unsharded buffer unless a param_dtype makes every
    # parameter compute in one dtype (each parameter otherwise computes in its own dtype).
    # Such a group all-gathers packed (one collective, see codec.py) and reduce-scatters
    # once in the promoted dtype of its parameters (or the policy's reduce_dtype); every
    # sharded gradient is cast to its parameter's dtype.

    # [Note: Complex and integer parameters]
    # A policy's param_dtype casts floating-point parameters only, as FSDP2's: complex and
    # integer ones compute in their own dtype (a cast would drop the imaginary parts, or
    # turn indices into floats). Complex gradients reduce in a complex dtype whatever the
    # reduce_dtype (FSDP2 casts them to it and drops their imaginary parts): the group's
    # reduce dtype is promoted with its complex parameters' dtypes, and a real parameter's
    # gradient is the real part of its reduced chunk.

    def _set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """The group's compute and reduce dtypes, from the policy's and ``orig_dtype`` (the promoted one if mixed)."""
        policy_compute, policy_reduce = self._policy_dtypes
        casts = self.mixed or orig_dtype.is_floating_point  # (a mixed group casts per parameter)
        self.compute_dtype = policy_compute if policy_compute is not None and casts else orig_dtype
        complex_dtypes = [p.orig_dtype for p in self.params if p.orig_dtype.is_complex]
        self.reduce_dtype = promoted_dtype([policy_reduce or self.compute_dtype, *complex_dtypes])
        # Backwards without sync sum the unsharded gradients in the reduce dtype, as FSDP2 does; a reduce dtype
        # that is only the wire's (QuantizedCommPolicy) never sums them in less than the compute dtype.
        self.accumulate_dtype = (promoted_dtype([self.compute_dtype, self.reduce_dtype]) if self.reduce_on_wire_only
                                 else self.reduce_dtype)

    def param_compute_dtype(self, p: ShardedParam) -> torch.dtype:
        """The dtype ``p`` is all-gathered and computed in."""
        if not p.orig_dtype.is_floating_point or (self.mixed and self._policy_dtypes[0] is None):
            return p.orig_dtype
        return self.compute_dtype

    def _byte_layout(self, numels: tuple[int, ...], dtypes: list[torch.dtype]) -> tuple[list[int], int]:
        offsets, total = [], 0
        for n, dtype in zip(numels, dtypes):
            offsets.append(total)
            total += -(-n * dtype.itemsize // 16) * 16
        return offsets, total

    def _flat_numel(self) -> int:
        """Elements of the flat shard buffer for the current layout (bytes for a mixed-dtype group)."""
        if not self.mixed:
            return self.layout.shard_numel
        return self._byte_layout(self.layout.shard_numels, [p.orig_dtype for p in self.params])[1]

    def _new_flat_shard(self, dtype: torch.dtype, device: torch.device, make: Any, pin: bool) -> torch.Tensor:
        dtype = torch.uint8 if self.mixed else dtype
        return make(self._flat_numel(), dtype=dtype, device=device, pin_memory=pin)

    @functools.cached_property
    def placement_key(self) -> tuple[Any, tuple[int, ...]] | None:
        """(mesh, mesh axes the shards are disjoint over) shared by every parameter, or None (tensor parallel)."""
        first = self.params[0].sharded
        if any(p.sharded.placements != first.placements or p.sharded.device_mesh != first.device_mesh for p in self.params):
            return None
        return first.device_mesh, sharded_axes(first.placements)

    @property
    def flat_steppable(self) -> bool:
        """Whether an elementwise optimizer may step the flat shard as one tensor ([Note: Flat optimizer steps])."""
        flat = self.flat_shard
        return (not self.mixed and flat.is_floating_point() and not flat.is_complex()
                and all(p.extension is None for p in self.params))

    def chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded chunk of a flat shard buffer, in its dtype."""
        if not self.mixed:
            return self.split(flat, self.layout)
        dtypes = [p.orig_dtype for p in self.params]
        offsets, _ = self._byte_layout(self.layout.shard_numels, dtypes)
        return [flat.narrow(0, off, n * dtype.itemsize).view(dtype)
                for off, n, dtype in zip(offsets, self.layout.shard_numels, dtypes)]

    def _unsharded_regions(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        if buffer.dtype != torch.uint8 or not self.mixed:
            return self.split(buffer, self.layout, unsharded=True)
        dtypes = [self.param_compute_dtype(p) for p in self.params]
        numels = tuple(p.unsharded_numel for p in self.layout.params)
        offsets, _ = self._byte_layout(numels, dtypes)
        return [buffer.narrow(0, off, n * dtype.itemsize).view(dtype) for off, n, dtype in zip(offsets, numels, dtypes)]

    def _bind_unsharded_buffer(self) -> None:
        dtypes = [self.param_compute_dtype(p) for p in self.params]
        if self.mixed and len(set(dtypes)) > 1:
            _, total = self._byte_layout(tuple(p.unsharded_numel for p in self.layout.params), dtypes)
            self.unsharded_buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        else:
            self.unsharded_buffer = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.device)
        # Each unsharded parameter views a `.data` alias of its region: it shares the storage but not the
        # version counter, so refilling the buffer in backward does not look like an in-place change of
        # tensors autograd saved in forward, and a change made through one parameter bumps its counter only.
        for p, region in zip(self.params, self._unsharded_regions(self.unsharded_buffer)):
            p.bind_unsharded(region.data)
        # Views for the copy-out, made once: they stay valid across storage resizes.
        self._regions = self._unsharded_regions(self.unsharded_buffer)
        world_size = self.layout.world_size
        self._rank_major_regions = [r.view(world_size, -1) for r in self._regions]
        self._dim0_only = all(p.layout.shard_dim == 0 for p in self.params)
        self._free_unsharded()

    @property
    def on_meta(self) -> bool:
        return self.flat_shard.device.type == "meta"

    def check_materialized(self) -> None:
        """Raise unless the flat shard buffer holds every parameter's real values (link it first if needed)."""
        if self.stale:
            self.relink()
        if self.stale or self.on_meta:
            on_meta = [p.fqn for p in self.params if p.sharded.to_local().device.type == "meta"]
            if on_meta or self.on_meta:
                raise MetaParameterError(
                    "FSDP parameters should be materialized from meta device before training, but the following "
                    f"were still on meta device: {on_meta or [p.fqn for p in self.params]}; call "
                    "model.to_empty(device=...) and initialise them (e.g. reset_parameters()) before the first forward"
                )
            devices = ", ".join(f"{p.fqn} on {p.sharded.to_local().device}" for p in self.params)
            raise ValueError(
                f"the parameters of {self.label or 'the module'}'s fully_shard group are on different devices "
                f"({devices}); move the whole model (or every module of the group) to one device"
            )

    # [Note: Converting a group]
    # `to()`, `to_empty()`, `float()`, `load_state_dict(assign=True)`... give the sharded
    # parameters new local tensors one module at a time, and one group may span several
    # modules (a list group, a parameter tied into an enclosing group). The group is
    # linked again (its flat shard buffer rebuilt from the new local tensors) only once
    # every member module has been converted, and never while its parameters' local
    # tensors are on different devices (some still on meta): a link copies from every
    # parameter, so it must not copy from one that is not converted yet. Until then the
    # group is *stale*: each sharded parameter is a self-standing DTensor (values can be
    # initialised, loaded or read), and the next all-gather (or lazy init) links it, or
    # raises naming the parameters still on meta or on another device.

    def member_converted(self, module: nn.Module, members: tuple[nn.Module, ...]) -> None:
        """``module`` (one of ``members``, the group's fully_shard modules) has converted its parameters."""
        self._converted.add(module)
        if all(m in self._converted for m in members):
            self.relink()
        else:
            self.stale = True

    @property
    def keep_assigned(self) -> bool:
        """Whether something may have been assigned to the group's modules since a root last took it over."""
        return registrations.count != self.registrations_seen

    def _register_sharded(self) -> None:
        keep = self.keep_assigned
        for p in self.params:
            p.keep_requires_grad_change()
            p.register(p.sharded, keep)

    def assigned_values(self) -> list[tuple[Any, torch.Tensor]]:
        """``(site, value)`` where a module holds neither this group's sharded nor its unsharded parameter."""
        found: list[tuple[Any, torch.Tensor]] = []
        for p in self.params:
            for site in p.sites:
                value = site.module._parameters.get(site.name)
                if value is not None and value is not p.sharded and value is not p.unsharded:
                    found.append((site, value))
        return found

    @torch.no_grad()
    def adopt_reassigned(self) -> bool:
        """Take over parameters assigned to a module after ``fully_shard``; whether there were any.

        ``module.weight = nn.Parameter(value)`` replaces the registered sharded
        parameter, e.g. a weight norm computed once the other groups hold real
        values. ``value`` (a DTensor of any placement) becomes the parameter's
        shard, in the parameter's dtype and on the flat shard buffer's device
        (a meta group moves to the value's): the assigned object is swapped in
        place onto this rank's part, so an optimizer built since holds the live
        parameter. It is taken over at lazy init, and before anything that
        would miss it: a conversion (``model.double()`` would reach the value,
        not the parameter it replaced) and ``load_state_dict`` (which loads
        into the value). The caller links the group again. Another group's
        sharded parameter is a tie made after ``fully_shard``, taken over at
        lazy init (``_take_over_late_ties`` in runtime.py), and is left alone.
        """
        if self.state is not ShardedState.SHARDED:
            return False
        untied = self._untie()
        swapped = []
        for p in self.params:
            for site in p.sites:
                value = site.module._parameters.get(site.name)
                if value is None or value is p.sharded or value is p.unsharded or group_of(value) is not None:
                    continue
                self._take_value(p, value)
                p.sharded = cast(DTensor, value)
                p.state_dict_view = None
                self.reducer.forget(p)  # what was accumulated for the parameter it replaced
                swapped.append(p)
        for p in swapped:
            p.register(p.sharded, keep_assigned=True)  # (a site given another group's parameter is a tie)
        if swapped:
            self._register_owner()  # group_of() knows the assigned objects, no longer the ones they replaced
        return bool(swapped) or untied

    def _take_value(self, p: ShardedParam, value: torch.Tensor) -> None:
        """Swap ``value`` (assigned in place of ``p``) in place onto ``p``'s local rows of it, in ``p``'s dtype."""
        if tuple(value.shape) != p.shape:
            raise ValueError(
                f"parameter {p.fqn!r} was re-assigned after fully_shard with shape {tuple(value.shape)}; "
                f"it was sharded with shape {p.shape}"
            )
        if not isinstance(value, DTensor):
            # It cannot become a DTensor in place, and an optimizer built since may hold it.
            raise ValueError(
                f"parameter {p.fqn!r} was re-assigned after fully_shard with a plain tensor; assign a DTensor "
                f"(e.g. computed from the sharded parameters, or distribute_tensor(value, mesh, {list(p.sharded.placements)})), "
                "load the value with load_state_dict (full tensors are accepted), or assign it before fully_shard"
            )
        if value.placements == p.sharded.placements and value.device_mesh == p.sharded.device_mesh:
            local = value.to_local()
        else:
            local = p.local_part(full_tensor(value))
        local = local.to(device=local.device if self.on_meta else self.flat_shard.device, dtype=p.orig_dtype)
        # The assigned object stays the sharded parameter (an optimizer built since holds it).
        replacement = nn.Parameter(p.as_dtensor_of(local.detach()), requires_grad=value.requires_grad)
        torch.utils.swap_tensors(value, replacement)

    def _untie(self) -> bool:
        """A value assigned at some of the modules sharing a tied parameter, while the others still hold it,
        undoes the tie there (``head.weight = nn.Parameter(tok.weight.detach().clone())``): those modules get
        a parameter of their own in this group, holding the value."""
        splits: dict[int, tuple[ShardedParam, list[Any]]] = {}
        for p in self.params:
            kept = [site for site in p.sites
                    if any(site.module._parameters.get(site.name) is own for own in (p.sharded, p.unsharded))]
            if not kept or len(kept) == len(p.sites):
                continue
            for site in p.sites:
                value = site.module._parameters.get(site.name)
                if site not in kept and value is not None and group_of(value) is None:
                    splits.setdefault(id(value), (p, []))[1].append(site)
        for p, sites in splits.values():
            value = sites[0].module._parameters[sites[0].name]
            # Built from a detached alias: the constructor keeps a weak reference, which would forbid swapping value.
            own = ShardedParam(p.fqn, sites, value.detach(), p.layout, p.mesh_info, p.tp)
            self.check_can_add(own)
            self._take_value(p, value)  # sharded as p is, which is how its own parameter shards
            own.sharded = cast(DTensor, value)
            p.sites = [site for site in p.sites if site not in sites]
            self.add(own)
        return bool(splits)

    @torch.no_grad()
    def take_over(self, p: ShardedParam, value: torch.Tensor) -> None:
        """Make ``p``'s sharded parameter (the same object) hold ``value``: a DTensor of any placement or the full
        tensor, kept in its own dtype and device (``load_state_dict(assign=True)``). Linked later."""
        if tuple(value.shape) != p.shape:
            raise ValueError(f"{p.fqn}: expected shape {p.shape}, got {tuple(value.shape)}")
        if isinstance(value, DTensor) and value.placements == p.sharded.placements and value.device_mesh == p.sharded.device_mesh:
            local = value.to_local()
        else:
            local = p.local_part(full_tensor(value) if isinstance(value, DTensor) else value)
        replacement = nn.Parameter(p.as_dtensor_of(p.wrap_local(local.detach())), requires_grad=value.requires_grad)
        torch.utils.swap_tensors(p.sharded, replacement)
        p.state_dict_view = None
        p.register(p.sharded)
        self.stale = True

    @torch.no_grad()
    def relink(self) -> None:
        """Make the flat shard buffer the storage of the sharded parameters again.

        ``module.to(...)``, ``to_empty(...)`` and ``load_state_dict(assign=True)``
        give the sharded parameters new local tensors. Their values (new dtype or
        device included) are copied into a new flat shard buffer, and each
        parameter object is swapped in place onto a view of it, so optimizers and
        user references keep working.
        """
        locals_ = [inner_tensor(p.sharded.to_local()) for p in self.params]
        if len({loc.device for loc in locals_}) > 1:  # some not converted yet ([Note: Converting a group])
            self.stale = True
            return
        self._converted.clear()
        self.stale = False
        chunks = self.chunks(self.flat_shard) if self.flat_shard.numel() == self._flat_numel() else []
        if chunks and all(
            loc.dtype == chunk.dtype and loc.device == self.flat_shard.device and _views(loc, p.local_rows(chunk))
            # (a conversion of an empty shard may have unwrapped an all-gather extension's subclass)
            and (p.extension is None or isinstance(p.sharded.to_local(), p.extension[0]))
            for p, loc, chunk in zip(self.params, locals_, chunks)
        ):
            return  # linked already (a group kept unsharded stays so)
        self.replicas_synced = False
        self.reshard()
        self.streams.shards_written()
        dtype, device = locals_[0].dtype, locals_[0].device
        if self.offload_to_cpu and device.type != "meta":
            device = torch.device("cpu")  # offloaded shards stay in host memory, wherever the module was moved
        pin = self.pin_memory and device.type == "cpu"
        for p, loc in zip(self.params, locals_):
            p.orig_dtype = loc.dtype
        self.mixed = len({loc.dtype for loc in locals_}) > 1
        if self.mixed:
            dtype = promoted_dtype([loc.dtype for loc in locals_])
        flat = self._new_flat_shard(dtype, device, torch.zeros, pin)
        for p, loc, chunk in zip(self.params, locals_, self.chunks(flat)):
            if device.type != "meta":
                p.local_rows(chunk).copy_(loc)
            replacement = torch.nn.Parameter(p.as_dtensor_of(p.shard_view(chunk)),
                                             requires_grad=p.sharded.requires_grad)
            grad = p.sharded.grad
            torch.utils.swap_tensors(p.sharded, replacement)  # swaps the gradient out too
            if grad is not None and grad.dtype == p.sharded.dtype and grad.device == p.sharded.device:
                p.sharded.grad = grad  # a gradient accumulated before the link stays, as on a plain module
            p.state_dict_view = None  # it holds the old flat buffer alive
        self.flat_shard = flat
        self._gathered_from = -1
        self.shard_device = device if device.type != "meta" else self.shard_device
        self._set_dtypes(dtype)
        unreduced = [p.unsharded.grad for p in self.params]  # accumulated without gradient sync
        self._bind_unsharded_buffer()
        for p, grad in zip(self.params, unreduced):
            if grad is not None and grad.dtype == p.unsharded.dtype and grad.device == p.unsharded.device:
                p.unsharded.grad = grad
        self._register_sharded()

    def remove(self, leaving: list[ShardedParam]) -> None:
        """Stop managing ``leaving`` (taken over by an enclosing group); the rest move to a new flat shard buffer.

        Only while SHARDED. Parameter objects of the rest keep their identity, and their gradients.
        """
        if self.state is not ShardedState.SHARDED:
            raise AssertionError(f"group {self.label!r}: removing parameters in state {self.state.name}")
        self.params = [p for p in self.params if p not in leaving]
        if self.codecs is not None:
            self.codecs = [codec for codec in self.codecs if all(codec.param is not p for p in leaving)]
        self._register_owner()
        self.layout = GroupLayout(tuple(p.layout for p in self.params))
        self.reducer = self.reducer.renewed()
        if self.params:
            self.relink()
        if self.post_forward is not None:
            self.set_post_forward_group(self.post_forward.group)

    def check_can_add(self, joining: ShardedParam) -> None:
        """Raise, before anything changed, if ``add(joining)`` cannot take it."""
        if self.state is not ShardedState.SHARDED:
            raise AssertionError(f"group {self.label!r}: adding parameters in state {self.state.name}")
        if self.codecs is not None or self.post_forward is not None:
            raise NotImplementedError(
                f"parameter {joining.fqn!r} was tied or untied after fully_shard in the group of {self.label!r}, "
                "which all-gathers through extensions, a comm_policy or several dtypes, or reshards after forward to "
                "an int: make the change before calling fully_shard"
            )

    def add(self, joining: ShardedParam) -> None:
        """Manage ``joining`` too (a tie made after ``fully_shard``, taken over by this enclosing group, or
        an untie).

        Only while SHARDED, when a root checks its tree ([Note: Changes after the first forward] in
        runtime.py). The parameter object keeps its identity; its values move into this group's new flat
        shard buffer.
        """
        self.check_can_add(joining)
        self.params = [*self.params, joining]
        self._register_owner()
        self.layout = GroupLayout(tuple(p.layout for p in self.params))
        self.reducer = self.reducer.renewed()
        self.relink()
        if self.on_new_sites is not None:
            self.on_new_sites([site.module for site in joining.sites])

    @staticmethod
    def split(flat: torch.Tensor, layout: GroupLayout, unsharded: bool = False) -> list[torch.Tensor]:
        scale = layout.world_size if unsharded else 1
        return [flat.narrow(0, off * scale, n * scale) for off, n in zip(layout.shard_offsets, layout.shard_numels)]

    # ---- state transitions -------------------------------------------------

    def check_post_forward_group(self) -> None:
        """Raise if this group cannot reshard to a smaller group after forward (before one is created for it)."""
        if self.codecs is not None:
            raise NotImplementedError(
                f"group {self.label!r}: reshard_after_forward as an int is not supported with all-gather extensions, "
                "a comm_policy or parameters of several dtypes; pass True or False"
            )

    def set_post_forward_group(self, group: dist.ProcessGroup | None) -> None:
        """Reshard to ``group`` (k consecutive ranks) after forward instead of to the full shard group."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()
        if group is None:
            self.post_forward = None
            return
        self.check_post_forward_group()
        size = dist.get_world_size(group)
        layout = GroupLayout(tuple(ParamLayout(p.shape, p.shard_dim, size) for p in self.layout.params))
        buffer = torch.empty(layout.shard_numel, dtype=self.compute_dtype, device=self.device)
        buffer.untyped_storage().resize_(0)
        self.post_forward = PostForwardShard(layout, group, dist.get_rank(group), buffer)

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (SHARDED[_POST_FORWARD] -> UNSHARDING); with ``async_op=False`` also wait."""
        if self.state in (ShardedState.UNSHARDED, ShardedState.SHARDED_POST_FORWARD) and \
                self._shard_versions() != self._gathered_from:
            self.reshard()  # [Note: Sharded parameters changed while unsharded]
        if self.state is ShardedState.SHARDED:
            self.check_materialized()
            if not self.replicas_synced:
                self.sync_replicas()
            self._gathered_from = self._shard_versions()
        if self.state is ShardedState.SHARDED and self.codecs is not None:
            self._pending_all_gather = all_gather_packed(
                self._encode, self.device, self.mesh_info.shard_group, self.streams, self.label, self.all_gather_comm
            )
            self.state = ShardedState.UNSHARDING
        elif self.state is ShardedState.SHARDED:
            self._pending_layout = self.layout
            self._pending_all_gather = all_gather(
                self.flat_shard, self.compute_dtype, self.device, self.mesh_info.shard_group, self.streams, self.label,
                self.all_gather_comm,
            )
            self.state = ShardedState.UNSHARDING
        elif self.state is ShardedState.SHARDED_POST_FORWARD:
            assert self.post_forward is not None
            pf = self.post_forward
            self._pending_layout = pf.layout
            self._pending_all_gather = all_gather(pf.buffer, self.compute_dtype, self.device, pf.group, self.streams, self.label,
                                                  self.all_gather_comm)
            self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def _shard_versions(self) -> int:
        """The sum of the version counters that in-place writes to the sharded values bump: the flat shard
        buffer's (flat optimizer steps), each sharded parameter's (``DTensor`` in-place ops) and its local
        tensor's (steps on the local shards). Counters only grow, so the sum changes with any of them."""
        return self.flat_shard._version + sum(p.sharded._version + p.sharded._local_tensor._version
                                              for p in self.params)

    @torch.no_grad()
    def sync_replicas(self) -> None:
        """Every rank's copy of each replicated (0-dim) parameter takes shard rank 0's, the one the forward uses
        ([Note: Replicated scalars] in layout.py): one broadcast per such parameter, at the first all-gather and
        the first after the flat shard buffer was made anew (``to_empty``) or written back from full parameters.
        Values set per rank in between (a random initialisation that drew other numbers on each rank, as
        DTensor's does on CPU after uneven shards) would otherwise train on as different copies."""
        self.replicas_synced = True
        if self.mesh_info.shard_size == 1:
            return
        group = self.mesh_info.shard_group
        assert group is not None
        for p in self.params:
            if p.layout.replicated:
                local = inner_tensor(p.sharded._local_tensor)
                value = local.to(self.device)  # itself unless offloaded: collectives run on the mesh's device
                broadcast(value, group, self.streams, self.label).wait()
                if value is not local:
                    local.copy_(value)
        self.streams.shards_written()

    def wait_for_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED: wait, reorder rank-major into the unsharded buffer."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is not ShardedState.UNSHARDING or self._pending_all_gather is None:
            raise AssertionError(f"group {self.label!r}: wait_for_unshard in state {self.state.name}")
        pending = self._pending_all_gather
        output = pending.wait()
        self._pending_all_gather = None
        self._alloc_unsharded()
        if pending.parts is not None:
            self._decode(unpack(output, pending.parts, self.mesh_info.shard_size))
        else:
            self._copy_out(output, self._pending_layout)
        del pending
        del output  # the all-gather buffers go; the all-gather stream reuses them after this event
        self.streams.all_gather_read()
        if self.post_forward is not None:
            self.post_forward.buffer.untyped_storage().resize_(0)
        keep = self.keep_assigned
        for p in self.params:
            p.register_unsharded(keep)
        self._gathered_versions = [p.unsharded._version for p in self.params]
        self.state = ShardedState.UNSHARDED

    # [Note: Changes to unsharded parameters]
    # Resharding frees the unsharded parameters: what the forward (or code between `unshard()` and
    # `reshard()`) changed in them in place is gone, and the sharded parameters, which train, never had it
    # (as in FSDP2; `nn.Embedding(max_norm=...)` renormalises the rows it looks up in place, for one).
    # Writing each rank's rows back would not give the unsharded model's values either: each rank changed
    # its copy for its own batch only. So the change is named once per group, at the reshard that drops it,
    # by the parameters' version counters (one read per parameter per all-gather and reshard).
    # `summon_full_params` writes back (or drops, by request) what was changed inside it.

    def _check_unchanged(self) -> None:
        if self.summoned or self._warned_changed or self.state is not ShardedState.UNSHARDED:
            return
        changed = [p.fqn for p, version in zip(self.params, self._gathered_versions) if p.unsharded._version != version]
        if changed:
            self._warned_changed = True
            warnings.warn(
                f"fully_shard: {', '.join(changed)} changed in place while unsharded (in forward, or between "
                "unshard() and reshard()); resharding drops the change and the sharded parameters train without "
                "it, as in FSDP2 (nn.Embedding(max_norm=...) renormalises its weight in forward, for one); change "
                "the sharded parameters outside forward, or inside summon_full_params(writeback=True)",
            )

    def reshard(self, keep_storage: bool = False) -> None:
        """Back to SHARDED: register the sharded parameters and free the unsharded buffer (``keep_storage``:
        leave it allocated, with its values, for a graph that saved it, until :meth:`release_storage`)."""
        if self.state is ShardedState.SHARDED:
            return
        if self.state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # a collective in flight cannot be abandoned
        self._check_unchanged()
        self._register_sharded()
        self.storage_kept = keep_storage
        if not keep_storage:
            self._free_unsharded()
        if self.post_forward is not None:
            self.post_forward.buffer.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def release_storage(self) -> None:
        """Free the unsharded buffer a create_graph backward's reshard kept, unless unsharded again since."""
        if self.storage_kept and self.state is ShardedState.SHARDED:
            self._free_unsharded()
        self.storage_kept = False

    @torch.no_grad()
    def reshard_post_forward(self) -> None:
        """UNSHARDED -> SHARDED_POST_FORWARD: keep this rank's 1/k of the unsharded parameters (a local copy)."""
        pf = self.post_forward
        if pf is None or self.state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        self._check_unchanged()
        storage = pf.buffer.untyped_storage()
        storage.resize_(pf.buffer.numel() * pf.buffer.element_size())
        regions = self.split(self.unsharded_buffer, self.layout, unsharded=True)
        chunks = self.split(pf.buffer, pf.layout)
        for p, region, chunk, lay in zip(self.params, regions, chunks, pf.layout.params):
            if lay.compact or p.layout.compact:
                rows_to_slot(unsharded_view(region, p.layout), chunk, lay, pf.rank)
                continue
            full = region.view(p.layout.padded_shape).narrow(lay.shard_dim, 0, lay.padded_shape[lay.shard_dim])
            chunk.view(lay.chunk_shape).copy_(rank_axis_view(full, lay.shard_dim, lay.world_size)[pf.rank])
        self.streams.shards_written()  # backward's all-gather sends this buffer, written on the compute stream
        self._register_sharded()
        self._free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

    def _encode(self) -> list[torch.Tensor]:
        """Every parameter's all-gather tensors (on the all-gather stream), by its codec."""
        assert self.codecs is not None
        flat = self.flat_shard
        if flat.device != self.device:  # offloaded shards
            flat = flat.to(self.device, non_blocking=True)
            self.streams.h2d_done = self.streams.record()
        tensors: list[torch.Tensor] = []
        self._part_counts = []
        for codec, chunk in zip(self.codecs, self.chunks(flat)):
            encoded = codec.encode(chunk)
            self._part_counts.append(len(encoded))
            tensors.extend(encoded)
        return tensors

    @torch.no_grad()
    def _decode(self, parts: list[torch.Tensor]) -> None:
        assert self.codecs is not None
        start = 0
        for codec, region, count in zip(self.codecs, self._regions, self._part_counts):
            codec.decode(parts[start : start + count], region)
            start += count

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded_buffer.untyped_storage()
        nbytes = self.unsharded_buffer.numel() * self.unsharded_buffer.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded(self) -> None:
        # Resizing the storage (not dropping the tensor) keeps every view, and
        # every reference autograd saved, valid for the next unshard.
        self.unsharded_buffer.untyped_storage().resize_(0)
        for codec in self.codecs or ():
            codec.reshard()

    @torch.no_grad()
    def _copy_out(self, output: torch.Tensor, src: GroupLayout) -> None:
        """Reorder a rank-major all-gather output (cut as ``src``) into the parameter-major unsharded buffer.

        ``src`` is the group's layout, or the post-forward one: cut into fewer
        chunks, whose padded rows always fit inside the full layout's.
        """
        world_size = src.world_size
        rank_major = output.view(world_size, -1)
        if src is self.layout and self._dim0_only:
            # Row r of a dim-0 parameter's padded full tensor is rank r's chunk.
            torch.split_with_sizes_copy(rank_major, self.layout.shard_numels, dim=1, out=self._rank_major_regions)
            return
        for p, region, lay, off in zip(self.params, self._regions, src.params, src.shard_offsets):
            if lay.compact or p.layout.compact:
                slots_to_full(rank_major[:, off : off + lay.shard_numel], unsharded_view(region, p.layout), lay)
                continue
            chunks = rank_major[:, off : off + lay.shard_numel].view(world_size, *lay.chunk_shape)
            full = region.view(p.layout.padded_shape).narrow(lay.shard_dim, 0, lay.padded_shape[lay.shard_dim])
            rank_axis_view(full, lay.shard_dim, world_size).copy_(chunks)

    # ---- summon_full_params ----------------------------------------------------

    # [Note: Summoned values]
    # summon_full_params shows the parameters' values as they train: the sharded ones, in their own dtype. A
    # group whose all-gather gives exactly those (no cast to a compute dtype, no lossy codec) shows its
    # unsharded parameters, views of the unsharded buffer; any other shows full copies gathered from the
    # sharded parameters (one collective per parameter: summon is not on the training path), so that reading,
    # writing back and with_grads all work on the values the optimizer steps. Inside the context the groups'
    # hooks stand aside (HookState.summoned): a forward computes with what is shown.

    def _gathers_exact(self) -> bool:
        return all(self.param_compute_dtype(p) == p.orig_dtype for p in self.params) and not any(
            codec.lossy for codec in self.codecs or ())

    def summon(self, *, keep_full: bool, offload_to_cpu: bool, with_grads: bool) -> None:
        """Register the full parameters ([Note: Summoned values]; CPU copies with ``offload_to_cpu``), their
        ``.grad`` the full gradients with ``with_grads``; ``keep_full=False`` registers the sharded ones again."""
        exact = self._gathers_exact()
        if exact:
            self.unshard()
        self.summoned = True
        # Gradients accumulated without sync live on the unsharded parameters: set aside, not shown as the full
        # gradients (they are this rank's, unreduced), and given back on exit.
        self._held_grads = [p.unsharded.grad for p in self.params]
        for p in self.params:
            p.unsharded.grad = None
            if exact:
                full = p.unsharded
            else:
                value = full_tensor(cast(DTensor, p.sharded.detach()))
                full = nn.Parameter(value if p.tp is None else p.tp.unsharded(p.tp.local_of(value)),
                                    requires_grad=p.sharded.requires_grad)
            grad = p.sharded.grad
            if with_grads and grad is not None:
                full.grad = full_tensor(grad) if isinstance(grad, DTensor) else grad
            if offload_to_cpu and keep_full:
                copy = nn.Parameter(full.detach().cpu(), requires_grad=full.requires_grad)
                copy.grad = None if full.grad is None else full.grad.cpu()
                full = copy
            if keep_full and full is not p.unsharded:
                p.register(full)
        if not keep_full:
            self.reshard()
        self._summoned = {id(site.module._parameters.get(site.name)) for p in self.params for site in p.sites}

    def write_back_summoned(self, writeback: bool) -> None:
        """Leaving ``summon``, while every group's full parameters are still there: with ``writeback`` each rank
        keeps its rows of the (possibly edited) full parameters. Parameters assigned inside are not taken over
        (their values are written back in place of the ones they replaced): a warning says so."""
        if not self.summoned:
            return  # (summon raised before this group)
        assigned = [p.fqn for p in self.params for site in p.sites
                    if id(site.module._parameters.get(site.name)) not in self._summoned]
        if assigned:
            warnings.warn(
                f"parameters assigned inside summon_full_params are not kept: {', '.join(assigned)} "
                f"{'get the assigned values written back' if writeback else 'keep their values'} and stay the "
                "parameters they were; assign (or tie) after the context exits",
                stacklevel=4,
            )
        if writeback:
            for p in self.params:
                site = p.sites[0]
                current = site.module._parameters[site.name]
                if current is not None:
                    p.adopt(current.detach())
            self.replicas_synced = False
            self.streams.shards_written()

    def end_summon(self) -> None:
        """Leave ``summon`` (after ``write_back_summoned`` on every group)."""
        held_grads = self._held_grads or [p.unsharded.grad for p in self.params]  # (summon raised before this group)
        for p, held in zip(self.params, held_grads, strict=True):
            shown = p.sites[0].module._parameters.get(p.sites[0].name)
            if shown is not None and shown is not p.unsharded and id(shown) in self._summoned:
                p.unsharded.requires_grad_(shown.requires_grad)  # a CPU copy's requires_grad_ carries over
            p.unsharded.grad = held
            p.reattach_unsharded()  # `.data =` inside the context pointed it elsewhere
            p.register(p.sharded)  # over the summoned copies, which resharding would leave as if assigned
        self._held_grads = []
        self.reshard()
        self.summoned = False

    # ---- gradients -----------------------------------------------------------

    def discard_pending(self) -> None:
        """Drop an in-flight all-gather and unreduced gradients after a failed iteration (collectives still complete)."""
        if self._pending_all_gather is not None:
            self._pending_all_gather.wait()
            self._pending_all_gather = None
        if self.state is ShardedState.UNSHARDING:
            self.state = ShardedState.SHARDED
        self.reducer.discard()
        self.reshard()
