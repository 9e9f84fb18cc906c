"""A parameter group: the unit of communication, with its flat buffers and state machine."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.collectives import CommStreams, PendingCollective, all_gather, all_reduce, reduce_scatter
from fullshard.errors import MetaParameterError
from fullshard.layout import GroupLayout, ParamLayout
from fullshard.mesh import MeshInfo
from fullshard.param import ShardedParam, full_tensor


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


@dataclass
class PendingReduce:
    """A gradient reduce-scatter in flight and what to do with its output."""

    group: ParamGroup
    params: list[ShardedParam]
    layout: GroupLayout
    collective: PendingCollective


class ParamGroup:
    """The parameters of one ``fully_shard`` call.

    Owns the flat shard buffer (persistent), the unsharded buffer (allocated
    only between unshard and reshard) and moves between the states of
    :class:`ShardedState` through ``unshard`` / ``wait_for_unshard`` /
    ``reshard``. Gradients leave through ``reduce_grads`` / ``finish_reduce``.
    """

    def __init__(
        self,
        params: list[ShardedParam],
        originals: list[nn.Parameter],
        mesh_info: MeshInfo,
        device: torch.device,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        streams: CommStreams,
        offload_to_cpu: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.streams = streams
        self.label = ""  # qualified module name, filled in at lazy init
        self.layout = GroupLayout(tuple(p.layout for p in params))
        orig_dtype = params[0].orig_dtype
        self._policy_dtypes = (compute_dtype, reduce_dtype)
        self.compute_dtype = compute_dtype or orig_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self._grad_layouts: dict[tuple[bool, ...], GroupLayout] = {}
        self._pending_all_gather: PendingCollective | None = None
        self._pending_layout = self.layout  # the layout the in-flight all-gather's output has
        self.post_forward: PostForwardShard | None = None
        # Where the flat shard and gradient buffers live: the device, or pinned CPU memory when offloading.
        self.shard_device = torch.device("cpu") if offload_to_cpu else device
        self.pin_memory = offload_to_cpu and pin_memory and device.type != "cpu"
        # Gradient reduction settings (FSDPModule.set_* methods).
        self.divide_factor: float | None = None
        self.requires_all_reduce = True
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self._partial_grads: dict[ShardedParam, torch.Tensor] = {}  # HSDP: reduce-scattered, not yet all-reduced
        self.reduce_unused_params = False  # reduce zeros for trainable parameters that got no gradient
        self.reduce_scatter_group: dist.ProcessGroup | None = None  # a separate group, else the shard group
        # register_comm_hook: (state, hook(state, grad, output)) reducing in place of the reduce-scatter.
        self.comm_hook: tuple[Any, Callable[[Any, torch.Tensor, torch.Tensor], None]] | None = None
        self.summoned = False  # inside summon_full_params

        # Parameters on the meta device (deferred initialisation) get a meta flat shard
        # buffer; `FSDPModule.to_empty()` / `_apply` re-link them to real memory.
        on_meta = originals[0].device.type == "meta"
        with torch.no_grad():
            self.flat_shard = torch.empty(
                self.layout.shard_numel, dtype=orig_dtype, device="meta" if on_meta else self.shard_device,
                pin_memory=self.pin_memory and not on_meta,
            )
            for p, original, chunk in zip(params, originals, self._split(self.flat_shard, self.layout)):
                if not on_meta:
                    p.fill_shard(original.detach(), chunk)
                p.bind_shard(chunk, requires_grad=original.requires_grad)
            self._bind_unsharded_buffer()
        self.state = ShardedState.SHARDED
        for p in params:
            p.register(p.sharded)

    def _bind_unsharded_buffer(self) -> None:
        self.unsharded_buffer = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.device)
        # The unsharded parameters view a `.data` alias: it shares the storage but
        # not the version counter, so refilling the buffer in backward does not
        # look like an in-place change of tensors autograd saved in forward.
        alias = self.unsharded_buffer.data
        for p, region in zip(self.params, self._split(alias, self.layout, unsharded=True)):
            p.bind_unsharded(region)
        self._free_unsharded()

    @property
    def on_meta(self) -> bool:
        return self.flat_shard.device.type == "meta"

    def check_materialized(self) -> None:
        if self.on_meta:
            names = ", ".join(p.fqn for p in self.params)
            raise MetaParameterError(
                f"parameters of {self.label or 'the module'} are still on the meta device ({names}); call "
                "model.to_empty(device=...) and initialise them (e.g. reset_parameters()) before the first forward"
            )

    @torch.no_grad()
    def adopt_reassigned(self) -> None:
        """Take over parameters assigned to a module after ``fully_shard`` (at lazy init).

        ``module.weight = nn.Parameter(value)`` replaces the registered sharded
        parameter, e.g. a weight norm computed once the other groups hold real
        values. ``value`` (a full tensor or a DTensor) becomes the parameter's
        shard: the sharded parameter object is swapped onto it in place and the
        flat shard buffer rebuilt around it, on its device (the group may have
        been on the meta device until then).
        """
        if self.state is not ShardedState.SHARDED:
            return
        swapped = False
        for p in self.params:
            for site in p.sites:
                value = site.module._parameters.get(site.name)
                if value is None or value is p.sharded or value is p.unsharded:
                    continue
                if tuple(value.shape) != p.layout.shape:
                    raise ValueError(
                        f"parameter {p.fqn!r} was re-assigned after fully_shard with shape {tuple(value.shape)}; "
                        f"it was sharded with shape {p.layout.shape}"
                    )
                if not isinstance(value, DTensor):
                    # It cannot become a DTensor in place, and an optimizer built since may hold it.
                    raise ValueError(
                        f"parameter {p.fqn!r} was re-assigned after fully_shard with a plain tensor; assign a DTensor "
                        "(e.g. computed from the sharded parameters, or distribute_tensor(value, mesh, [Shard(0)])), "
                        "load the value with load_state_dict (full tensors are accepted), or assign it before fully_shard"
                    )
                if value.placements == p.sharded.placements and value.device_mesh == p.sharded.device_mesh:
                    local = value.to_local()
                else:
                    local = p.local_part(full_tensor(value))
                if not self.on_meta:  # keep the buffer where it is; a meta group moves to the value's device
                    local = local.to(self.flat_shard.device, self.flat_shard.dtype)
                # The assigned object stays the sharded parameter (an optimizer built since holds it).
                replacement = nn.Parameter(p.as_dtensor_of(local.detach()), requires_grad=value.requires_grad)
                torch.utils.swap_tensors(value, replacement)
                p.sharded = cast(DTensor, value)
                swapped = True
            p.register(p.sharded)
        if swapped:
            self.relink()

    @torch.no_grad()
    def relink(self) -> None:
        """Make the flat shard buffer the storage of the sharded parameters again.

        ``module.to(...)``, ``to_empty(...)`` and ``load_state_dict(assign=True)``
        give the sharded parameters new local tensors. Their values (new dtype or
        device included) are copied into a new flat shard buffer, and each
        parameter object is swapped in place onto a view of it, so optimizers and
        user references keep working.
        """
        self.reshard()
        locals_ = [p.sharded.to_local() for p in self.params]
        chunks = self._split(self.flat_shard, self.layout)
        if all(
            loc.dtype == self.flat_shard.dtype and loc.device == self.flat_shard.device
            and loc.untyped_storage().data_ptr() == self.flat_shard.untyped_storage().data_ptr()
            and loc.storage_offset() == p.local_rows(chunk).storage_offset()
            for p, loc, chunk in zip(self.params, locals_, chunks)
        ):
            return
        dtype, device = locals_[0].dtype, locals_[0].device
        pin = self.pin_memory and device.type == "cpu"
        flat = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device, pin_memory=pin)
        for p, loc, chunk in zip(self.params, locals_, self._split(flat, self.layout)):
            if device.type != "meta":
                p.local_rows(chunk).copy_(loc)
            replacement = torch.nn.Parameter(p.as_dtensor(chunk), requires_grad=p.sharded.requires_grad)
            torch.utils.swap_tensors(p.sharded, replacement)
        self.flat_shard = flat
        self.shard_device = device if device.type != "meta" else self.shard_device
        policy_compute, policy_reduce = self._policy_dtypes
        self.compute_dtype = policy_compute or dtype
        self.reduce_dtype = policy_reduce or self.compute_dtype
        self._bind_unsharded_buffer()
        for p in self.params:
            p.orig_dtype = dtype
            p.register(p.sharded)

    @staticmethod
    def _split(flat: torch.Tensor, layout: GroupLayout, unsharded: bool = False) -> list[torch.Tensor]:
        scale = layout.world_size if unsharded else 1
        return [flat.narrow(0, off * scale, n * scale) for off, n in zip(layout.shard_offsets, layout.shard_numels)]

    # ---- state transitions -------------------------------------------------

    def set_post_forward_group(self, group: dist.ProcessGroup | None) -> None:
        """Reshard to ``group`` (k consecutive ranks) after forward instead of to the full shard group."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()
        if group is None:
            self.post_forward = None
            return
        size = dist.get_world_size(group)
        layout = GroupLayout(tuple(ParamLayout(p.shape, p.shard_dim, size) for p in self.layout.params))
        buffer = torch.empty(layout.shard_numel, dtype=self.compute_dtype, device=self.device)
        buffer.untyped_storage().resize_(0)
        self.post_forward = PostForwardShard(layout, group, dist.get_rank(group), buffer)

    def unshard(self, async_op: bool = False) -> None:
        """Issue the all-gather (SHARDED[_POST_FORWARD] -> UNSHARDING); with ``async_op=False`` also wait."""
        if self.state is ShardedState.SHARDED:
            self.check_materialized()
            self._pending_layout = self.layout
            self._pending_all_gather = all_gather(
                self.flat_shard, self.compute_dtype, self.device, self.mesh_info.shard_group, self.streams, self.label
            )
            self.state = ShardedState.UNSHARDING
        elif self.state is ShardedState.SHARDED_POST_FORWARD:
            assert self.post_forward is not None
            pf = self.post_forward
            self._pending_layout = pf.layout
            self._pending_all_gather = all_gather(pf.buffer, self.compute_dtype, self.device, pf.group, self.streams, self.label)
            self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED: wait, reorder rank-major into the unsharded buffer."""
        if self.state is ShardedState.UNSHARDED:
            return
        if self.state is not ShardedState.UNSHARDING or self._pending_all_gather is None:
            raise AssertionError(f"group {self.label!r}: wait_for_unshard in state {self.state.name}")
        output = self._pending_all_gather.wait()
        self._pending_all_gather = None
        self._alloc_unsharded()
        self._copy_out(output, self._pending_layout)
        if self.post_forward is not None:
            self.post_forward.buffer.untyped_storage().resize_(0)
        for p in self.params:
            p.register_unsharded()
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Back to SHARDED: register the sharded parameters and free the unsharded buffer."""
        if self.state is ShardedState.SHARDED:
            return
        if self.state is ShardedState.UNSHARDING:
            self.wait_for_unshard()  # a collective in flight cannot be abandoned
        for p in self.params:
            p.register(p.sharded)
        self._free_unsharded()
        if self.post_forward is not None:
            self.post_forward.buffer.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    @torch.no_grad()
    def reshard_post_forward(self) -> None:
        """UNSHARDED -> SHARDED_POST_FORWARD: keep this rank's 1/k of the unsharded parameters (a local copy)."""
        pf = self.post_forward
        if pf is None or self.state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        storage = pf.buffer.untyped_storage()
        storage.resize_(pf.buffer.numel() * pf.buffer.element_size())
        regions = self._split(self.unsharded_buffer, self.layout, unsharded=True)
        chunks = self._split(pf.buffer, pf.layout)
        for p, region, chunk, lay in zip(self.params, regions, chunks, pf.layout.params):
            full = region.view(p.layout.padded_shape).narrow(lay.shard_dim, 0, lay.padded_shape[lay.shard_dim])
            chunk.view(lay.chunk_shape).copy_(_rank_axis_view(full, lay.shard_dim, lay.world_size)[pf.rank])
        for p in self.params:
            p.register(p.sharded)
        self._free_unsharded()
        self.state = ShardedState.SHARDED_POST_FORWARD

    def _alloc_unsharded(self) -> None:
        storage = self.unsharded_buffer.untyped_storage()
        nbytes = self.unsharded_buffer.numel() * self.unsharded_buffer.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded(self) -> None:
        # Resizing the storage (not dropping the tensor) keeps every view, and
        # every reference autograd saved, valid for the next unshard.
        self.unsharded_buffer.untyped_storage().resize_(0)

    @torch.no_grad()
    def _copy_out(self, output: torch.Tensor, src: GroupLayout) -> None:
        """Reorder a rank-major all-gather output (cut as ``src``) into the parameter-major unsharded buffer.

        ``src`` is the group's layout, or the post-forward one: cut into fewer
        chunks, whose padded rows always fit inside the full layout's.
        """
        world_size = src.world_size
        regions = self._split(self.unsharded_buffer, self.layout, unsharded=True)
        rank_major = output.view(world_size, -1)
        if src is self.layout and all(p.layout.shard_dim == 0 for p in self.params):
            # Row r of a dim-0 parameter's padded full tensor is rank r's chunk.
            torch.split_with_sizes_copy(
                rank_major, list(self.layout.shard_numels), dim=1, out=[r.view(world_size, -1) for r in regions]
            )
            return
        for p, region, lay, off in zip(self.params, regions, src.params, src.shard_offsets):
            chunks = rank_major[:, off : off + lay.shard_numel].view(world_size, *lay.chunk_shape)
            full = region.view(p.layout.padded_shape).narrow(lay.shard_dim, 0, lay.padded_shape[lay.shard_dim])
            _rank_axis_view(full, lay.shard_dim, world_size).copy_(chunks)

    # ---- gradients -----------------------------------------------------------

    def accumulate_unsharded_grads(self) -> None:
        """A backward without gradient sync: keep the unsharded gradients for a later synced one.

        Autograd already sums into ``unsharded.grad`` across backwards; only when
        the reduce dtype differs from the compute dtype are they moved into a
        reduce-dtype accumulator, so the sum does not lose precision.
        """
        if self.reduce_dtype == self.compute_dtype:
            return
        for p in self.params:
            grad = p.unsharded.grad
            if grad is None:
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(self.reduce_dtype)
            else:
                p.accumulated_grad.add_(grad)
            p.unsharded.grad = None

    def _take_unsharded_grads(self) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = []
        for p in self.params:
            grad = p.unsharded.grad if p.requires_grad else None
            if grad is None and p.requires_grad and self.reduce_unused_params:
                grad = torch.zeros(p.layout.shape, dtype=self.compute_dtype, device=self.device)
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad = p.accumulated_grad
            p.unsharded.grad = None
            p.accumulated_grad = None
            grads.append(grad)
        return grads

    def _divide_factors(self) -> tuple[float, float]:
        """(before, after) the reduction; fp16/bf16 split the division so the sum stays in range."""
        if self.comm_hook is not None:
            return 1.0, 1.0  # the hook averages
        total = self.divide_factor if self.divide_factor is not None else float(self.mesh_info.data_parallel_size)
        if self.reduce_dtype in (torch.float16, torch.bfloat16):
            before = math.sqrt(total)
            return before, total / before
        return 1.0, total

    def reduce_grads(self) -> PendingReduce | None:
        """Issue one reduce-scatter of every unsharded gradient present; clear them."""
        taken = self._take_unsharded_grads()
        with_grad = tuple(g is not None for g in taken)
        if not any(with_grad):
            return None
        layout = self._grad_layouts.get(with_grad)
        if layout is None:
            layout = self._grad_layouts[with_grad] = self.layout.subset(with_grad)
        params = [p for p, keep in zip(self.params, with_grad) if keep]
        grads = [g for g in taken if g is not None]
        before, _ = self._divide_factors()
        pack = _pack_rank_major(layout, before)
        if self.comm_hook is not None:
            hook_state, hook = self.comm_hook
            packed = torch.empty(layout.world_size, layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
            pack(grads, packed)
            output = torch.empty(layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
            hook(hook_state, packed.view(-1), output)
            return PendingReduce(self, params, layout, PendingCollective(None, output, ()))
        collective = reduce_scatter(
            grads, pack, layout.shard_numel, self.reduce_dtype, self.device,
            self.reduce_scatter_group or self.mesh_info.shard_group, self.streams, self.label,
        )
        return PendingReduce(self, params, layout, collective)

    @torch.no_grad()
    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for a reduce-scatter, all-reduce across replicas (HSDP), add to the sharded gradients."""
        reduced = pending.collective.wait()
        _, after = self._divide_factors()
        if after != 1.0:
            reduced.div_(after)
        replicate_group = self.mesh_info.replicate_group
        if replicate_group is not None:
            chunks = self._split(reduced, pending.layout)
            if not self.requires_all_reduce:
                # Keep the partial (per-replica) sums until a backward that all-reduces.
                for p, chunk in zip(pending.params, chunks):
                    if p in self._partial_grads:
                        self._partial_grads[p].add_(chunk)
                    else:
                        self._partial_grads[p] = chunk.clone()
                return
            for p, chunk in zip(pending.params, chunks):
                partial = self._partial_grads.pop(p, None)
                if partial is not None:
                    chunk.add_(partial)
            all_reduce(reduced, replicate_group, self.streams, self.label).wait()
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)
        self._assign_sharded_grads(pending, reduced)

    def _assign_sharded_grads(self, pending: PendingReduce, reduced: torch.Tensor) -> None:
        orig_dtype = self.flat_shard.dtype
        if reduced.dtype == orig_dtype and reduced.device == self.shard_device:
            flat_grad = reduced
        else:
            flat_grad = torch.empty(reduced.shape, dtype=orig_dtype, device=self.shard_device, pin_memory=self.pin_memory)
            flat_grad.copy_(reduced, non_blocking=True)  # offload: completed by the end-of-backward host sync
        chunks = self._split(flat_grad, pending.layout)
        if all(p.sharded.grad is None for p in pending.params):
            # The common case: the reduce-scatter output becomes the flat gradient buffer.
            for p, chunk in zip(pending.params, chunks):
                p.sharded.grad = p.as_dtensor(chunk)
            return
        for p, chunk in zip(pending.params, chunks):
            grad = p.sharded.grad
            if grad is None:
                p.sharded.grad = p.as_dtensor(chunk)
            else:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                local.add_(p.local_rows(chunk))

    def discard_pending(self) -> None:
        """Drop an in-flight all-gather after a failed iteration (the collective is still completed)."""
        if self._pending_all_gather is not None:
            self._pending_all_gather.wait()
            self._pending_all_gather = None
        if self.state is ShardedState.UNSHARDING:
            self.state = ShardedState.SHARDED
        for p in self.params:
            p.unsharded.grad = None
            p.accumulated_grad = None
        self._partial_grads.clear()
        self.reshard()


def _rank_axis_view(padded_full: torch.Tensor, shard_dim: int, world_size: int) -> torch.Tensor:
    """View a padded full tensor as ``(world_size, *chunk_shape)``: index r is rank r's chunk."""
    shape = padded_full.shape
    chunk = shape[shard_dim] // world_size
    return padded_full.view(*shape[:shard_dim], world_size, chunk, *shape[shard_dim + 1 :]).movedim(shard_dim, 0)


def _pack_rank_major(layout: GroupLayout, divide_by: float) -> Callable[[list[torch.Tensor], torch.Tensor], None]:
    """Fill function for the reduce-scatter input: each gradient chunked over the ranks."""
    world_size = layout.world_size
    all_dim0 = all(p.shard_dim == 0 for p in layout.params)

    def fill(grads: list[torch.Tensor], out: torch.Tensor) -> None:
        pack(grads, out)
        if divide_by != 1.0:
            out.div_(divide_by)

    def pack(grads: list[torch.Tensor], out: torch.Tensor) -> None:
        if all_dim0:  # casts to the reduce dtype on the way
            torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=out)
            return
        for grad, lay, off in zip(grads, layout.params, layout.shard_offsets):
            padded = grad
            if not lay.is_even:
                padded = grad.new_zeros(lay.padded_shape)
                padded.narrow(lay.shard_dim, 0, lay.dim_size).copy_(grad)
            dst = out[:, off : off + lay.shard_numel].view(world_size, *lay.chunk_shape)
            dst.copy_(_rank_axis_view(padded.contiguous(), lay.shard_dim, world_size))


    return fill
