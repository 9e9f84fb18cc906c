"""Gradient reduction of one group: what is reduced, how, and where the sharded gradients end up.

[Note: Gradient reduction]
After a group's backward its unsharded gradients are packed rank-major into one
reduce-scatter input (copy-in, compute stream) and dropped. One reduce-scatter
sums them over the shard ranks; with HSDP one all-reduce then sums the result
over the replicas. The sum is divided once, at the end, by the data-parallel
size (or ``ReduceSettings.divide_factor``); on NCCL, and wherever a custom
reduce-scatter runs (it gets the op FSDP2 gives it), when the factor is the
data-parallel size and sum-only reductions are not forced, the collectives
average instead (``ReduceOp.AVG``). fp16 is the exception: the division is
split into a power of two before the sum and the rest after (``split_division``),
so the sum cannot overflow and the pre-division rounds nothing; the gradients
then equal torch's FSDP2's bit for bit. So is every reduce dtype other than fp32
and bf16 (fp64), as in FSDP2.
The result is cast to the parameters' dtype (and copied to pinned host memory
when offloading) and becomes the sharded gradients: the flat gradient buffer,
or added into gradients already there. Hooks registered with
``register_post_accumulate_grad_hook`` on the sharded parameters then fire,
once per parameter per reduction, with the reduced gradient in ``.grad``.

Stages of one reduction (``ReduceStage``), for the streams see
[Note: Streams and lifetimes]: on accelerators every stage is queued at once
on the communication streams; on CPU the reduce-scatter is waited for when
the reduction is drained (in-flight bound or end of backward), which issues
the HSDP all-reduce, waited for at the end of backward.

HSDP with ``requires_all_reduce=False`` keeps the reduce-scatter's result as a
per-replica partial sum instead, with its flag counts (below); the next
reduction that all-reduces adds both first, also for parameters that got no
gradient in that backward. A parameter no rank had a gradient for in any of
those backwards keeps ``grad`` None, as unsharded.

Parameters used on some ranks only (conditional compute, experts): every rank
packs every trainable parameter of the group, zeros where it has no gradient,
so the reduce-scatters of all ranks have the same size, and the gradient is
the average over all ranks with the others contributing zero (what the
unsharded model would compute on the whole batch). Behind the gradients each
row carries one flag column per parameter (1 where this rank had a gradient);
summed by the reduction, they tell a rank that had no gradient whether any
rank had one: if none had, the parameter keeps ``grad`` None (as it would
unsharded), unless ``reduce_unused_params`` asks for zeros. Only such a rank
reads the flags (a device sync on accelerators); the others pay one flag
column per parameter in the collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard.collectives import CommStreams, PendingCollective, all_reduce, profiled, reduce_scatter, run_hook_on
from fullshard.layout import GroupLayout, ParamLayout
from fullshard.mesh import MeshInfo
from fullshard.param import FLAT_GRAD, FlatGrad, ShardedParam, full_to_slots, rank_axis_view

# hook(state, grad, output); on groups that shard nothing hook(state, grad), averaging grad in place
CommHook = Callable[..., None]


@dataclass
class ReduceSettings:
    """How one group's gradients are reduced; ``FSDPModule.set_*`` and FSDP1's helpers change it."""

    # False: backward keeps the unsharded gradients for a later synced backward (no communication).
    requires_gradient_sync: bool = True
    # HSDP, False: reduce-scatter but keep per-replica partial sums; all-reduced by a later backward.
    # Independent of requires_gradient_sync (a backward all-reduces only when both are True).
    requires_all_reduce: bool = True
    # Divide the summed gradients by this instead of the data-parallel size.
    divide_factor: float | None = None
    # Use ReduceOp.SUM with a separate division even where AVG is available (NCCL).
    force_sum_reduction: bool = False
    # Reduce zeros for trainable parameters that got no gradient, so ranks still issue matching collectives.
    reduce_unused_params: bool = False
    # Reduce-scatter inputs kept in flight before the compute stream waits for the oldest reduce-scatter.
    max_inputs_in_flight: int = 1
    # A process group of its own for the reduce-scatter (None: the mesh's shard group).
    reduce_scatter_group: dist.ProcessGroup | None = None
    # hook(reduced) in place on each reduced flat gradient (after the HSDP all-reduce), on hook_stream if given.
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None
    # FSDP1's register_comm_hook: (state, hook) reduces instead of the reduce-scatter (and the all-reduce).
    comm_hook: tuple[Any, CommHook] | None = None
    # FSDPModule.set_custom_reduce_scatter: torch's ReduceScatter (allocates the input and output, runs it).
    custom_comm: Any = None

    @property
    def all_reduces(self) -> bool:
        return self.requires_gradient_sync and self.requires_all_reduce


class ReduceStage(Enum):
    """How far one reduction has gone."""

    REDUCE_SCATTER = auto()  # the reduce-scatter (its input alive) is in flight
    ALL_REDUCE = auto()  # HSDP: the all-reduce across replicas is in flight
    DELIVERED = auto()  # sharded gradients assigned (device work may still be queued: see `done`)


@dataclass
class PendingReduce:
    """One group's reduction in flight, and every buffer it keeps alive."""

    reducer: GradReducer
    params: list[ShardedParam]
    layout: GroupLayout
    reduce_scatter: PendingCollective
    stage: ReduceStage = ReduceStage.REDUCE_SCATTER
    all_reduce: PendingCollective | None = None
    held: list[Any] = field(default_factory=list)  # outputs: kept until the compute stream waited `done`
    done: Any = None  # event after the last post-reduce operation (accelerators)
    host_adds: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # offload: (grad, addend)
    hooks_due: list[ShardedParam] = field(default_factory=list)  # post-accumulate hooks to fire at finish
    missing: frozenset[int] = frozenset()  # positions in `params` that this rank packed as zeros

    def reduce_scatter_done(self) -> bool:
        """Whether the host may take the reduce-scatter as finished without waiting (CPU collectives only). Never
        for a layout with replicated parameters: delivering it issues an all-reduce on the shard group, which must
        not go out at a time that depends on when the reduce-scatter finished."""
        work = self.reduce_scatter.work
        return not self.reducer.group.streams.on_accelerator and (work is None or work.is_completed()) \
            and not self.layout.replicated_offsets

    def release_input(self) -> None:
        """Let the reduce-scatter input go: the compute stream waits for the reduce-scatter (CPU: advance past it)."""
        streams = self.reducer.group.streams
        if not streams.on_accelerator:
            if self.stage is ReduceStage.REDUCE_SCATTER:
                self.reducer.advance(self)
            return
        streams.wait(self.reduce_scatter.done)
        self.reduce_scatter.buffers = ()

    def finish(self) -> None:
        """Complete the reduction: the compute stream (and, for host copies, the host) waits; hooks fire."""
        while self.stage is not ReduceStage.DELIVERED:
            self.reducer.advance(self)
        streams = self.reducer.group.streams
        streams.wait(self.done)
        if self.host_adds or self.hooks_due:
            streams.host_wait(self.done)
            for grad, addend in self.host_adds:
                grad.add_(addend)
            _fire_post_accumulate_hooks(self.hooks_due)
        self.host_adds, self.hooks_due, self.held = [], [], []
        self.reduce_scatter.buffers = ()

    def abandon(self) -> None:
        """After a failed iteration: complete the collectives, deliver nothing."""
        self.reduce_scatter.wait()
        if self.all_reduce is not None:
            self.all_reduce.wait()
        self.reducer.group.streams.wait(self.done)
        self.held, self.host_adds, self.hooks_due = [], [], []
        self.reduce_scatter.buffers = ()


def _fire_post_accumulate_hooks(params: list[ShardedParam]) -> None:
    for p in params:
        hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
        for hook in (hooks or {}).values():
            hook(p.sharded)


class ReduceGroup(Protocol):
    """What gradient reduction reads of its parameter group (:class:`fullshard.group.ParamGroup`).

    A protocol rather than the class itself, so that imports flow one way: group -> reduce.
    """

    @property
    def params(self) -> list[ShardedParam]: ...

    @property
    def layout(self) -> GroupLayout: ...

    @property
    def mesh_info(self) -> MeshInfo: ...

    @property
    def streams(self) -> CommStreams: ...

    @property
    def label(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def shard_device(self) -> torch.device: ...

    @property
    def pin_memory(self) -> bool: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def reduce_dtype(self) -> torch.dtype: ...

    @property
    def accumulate_dtype(self) -> torch.dtype: ...  # where backwards without sync sum the unsharded gradients

    def param_compute_dtype(self, p: ShardedParam) -> torch.dtype: ...

    @property
    def mixed(self) -> bool: ...

    @property
    def flat_shard(self) -> torch.Tensor: ...

    @property
    def flat_steppable(self) -> bool: ...

    @property
    def weak_self(self) -> Any: ...  # a weak reference to the group, carried by FlatGrad

    def split(self, flat: torch.Tensor, layout: GroupLayout, unsharded: bool = False) -> list[torch.Tensor]: ...


class GradReducer:
    """Reduces one group's gradients into its sharded gradients (see [Note: Gradient reduction])."""

    def __init__(self, group: ReduceGroup) -> None:
        self.group = group
        self.settings = ReduceSettings()
        self._layouts: dict[tuple[bool, ...], GroupLayout] = {}  # by packed parameters; the flag columns last
        self._flags: dict[tuple[Any, ...], torch.Tensor] = {}  # flag rows, by (with gradient..., dtype)
        self._partial_sums: dict[ShardedParam, torch.Tensor] = {}  # HSDP: reduce-scattered, not yet all-reduced
        self._partial_flags: dict[ShardedParam, torch.Tensor] = {}  # their flag counts (one element each)
        self._replicated_index: dict[tuple[int, ...], torch.Tensor] = {}  # see _share_replicated
        # A backward without gradient sync ran through the group since its last reduction: the next synced
        # backward reduces the group, also if its modules do not run in that one (see `reduction_due`).
        self._unreduced_backward = False
        shard_group = group.mesh_info.shard_group
        self._nccl = shard_group is not None and dist.get_backend(shard_group) == "nccl"

    def renewed(self) -> GradReducer:
        """A reducer for the group's changed parameter list (its layouts are cut anew), with the same settings
        and the partial sums of the parameters still in it."""
        new = GradReducer(self.group)
        new.settings = self.settings
        new._unreduced_backward = self._unreduced_backward
        params = set(self.group.params)
        new._partial_sums = {p: t for p, t in self._partial_sums.items() if p in params}
        new._partial_flags = {p: t for p, t in self._partial_flags.items() if p in params}
        return new

    def hand_over(self, p: ShardedParam, to: GradReducer) -> None:
        """``p`` moved to ``to``'s group: its partial sums go with it."""
        for mine, theirs in ((self._partial_sums, to._partial_sums), (self._partial_flags, to._partial_flags)):
            if p in mine:
                theirs[p] = mine.pop(p)

    def forget(self, p: ShardedParam) -> None:
        """``p``'s parameter object was replaced: drop what was accumulated for the old one and not delivered."""
        p.unsharded.grad = p.accumulated_grad = None
        self._partial_sums.pop(p, None)
        self._partial_flags.pop(p, None)

    @property
    def reduction_due(self) -> bool:
        """The end of a synced backward must reduce this group although its modules did not run in it: gradients
        accumulated without sync in an earlier backward (conditional compute across micro-batches, decided alike
        on every rank as every all-gather needs), or HSDP partial sums kept earlier that must be all-reduced."""
        settings = self.settings
        return (settings.requires_gradient_sync and self._unreduced_backward) or (
            bool(self._partial_sums) and settings.all_reduces)

    # ---- no-sync accumulation ------------------------------------------------

    def accumulate_unsharded(self) -> None:
        """A backward without gradient sync: keep the unsharded gradients for a later synced one.

        Autograd already sums into ``unsharded.grad`` across backwards; only when
        the group's accumulation dtype (its reduce dtype, as in FSDP2, unless that is
        only the wire's) differs from the compute dtype are they moved into an
        accumulator of that dtype (fp32 beside bf16 compute). A tensor-parallel
        gradient is kept as autograd gives it, partial sums over the TP axes included:
        those are reduced once, in the reduce dtype, when the group is (as FSDP2 does;
        reducing each micro-batch's first would round them in the compute dtype).
        """
        group = self.group
        self._unreduced_backward = True
        if group.accumulate_dtype == group.compute_dtype:
            return
        for p in group.params:
            grad = p.unsharded_grad()
            if grad is None:
                continue
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(group.accumulate_dtype)
            else:
                p.accumulated_grad.add_(grad)
            p.unsharded.grad = None

    def _take_unsharded_grads(self) -> list[torch.Tensor | None]:
        group, settings = self.group, self.settings
        grads: list[torch.Tensor | None] = []
        for p in group.params:
            # A parameter frozen since its gradient began to accumulate (between micro-batches, or between the last
            # one's forward and backward) keeps what it accumulated, as on a plain module.
            grad = p.unsharded_grad()
            if grad is None and p.requires_grad and settings.reduce_unused_params and p.accumulated_grad is None:
                grad = torch.zeros(p.layout.shape, dtype=group.param_compute_dtype(p), device=group.device)
            if p.accumulated_grad is not None:
                if grad is not None:
                    p.accumulated_grad.add_(grad)
                grad = p.accumulated_grad
            p.unsharded.grad = None
            p.accumulated_grad = None
            grads.append(None if grad is None else p.local_grad(grad))
        return grads

    # ---- arithmetic ------------------------------------------------------------

    def _reduce_op_and_factors(self) -> tuple[Any, Any, float, float]:
        """(reduce-scatter op, HSDP all-reduce op, divide before the sum, divide after every sum)."""
        group, settings = self.group, self.settings
        sum_ = dist.ReduceOp.SUM
        if settings.comm_hook is not None:
            return sum_, sum_, 1.0, 1.0  # the hook averages
        info = group.mesh_info
        factor = settings.divide_factor
        total = factor if factor is not None else float(info.data_parallel_size)
        if group.reduce_dtype not in (torch.float32, torch.bfloat16):
            # fp16 overflows at 65504: a power of two near the square root before the sum, the rest after
            # (split_division). Every reduce dtype but fp32 and bf16 is split so, as in torch's FSDP2, whose
            # gradients these then equal bit for bit.
            before, after = split_division(total)
            return sum_, sum_, before, after
        if (self._nccl or settings.custom_comm is not None) and not settings.force_sum_reduction:
            # The collectives average where FSDP2's do (a custom reduce-scatter gets FSDP2's op): both without a
            # factor, the reduce-scatter alone when the factor is its group's size.
            if factor is None and info.data_parallel_size > 1:
                return dist.ReduceOp.AVG, dist.ReduceOp.AVG, 1.0, 1.0
            if factor == info.shard_size:
                return dist.ReduceOp.AVG, sum_, 1.0, 1.0
        return sum_, sum_, 1.0, total

    # ---- issue -----------------------------------------------------------------

    def reduce(self, ran_backward: bool = False) -> PendingReduce | None:
        """Pack every unsharded gradient present into one reduce-scatter input, drop them and issue the reduction.

        ``ran_backward``: the group's modules ran backward on this rank (in this backward, or in one
        without sync since the last reduction), so its peers reduce now too, even if none of its
        parameters got a gradient here (a layer used on other ranks only): this rank then sends zeros,
        flagged as absent.
        """
        group, settings, streams = self.group, self.settings, self.group.streams
        ran_backward, self._unreduced_backward = ran_backward or self._unreduced_backward, False
        taken = self._take_unsharded_grads()
        with_grad = tuple(g is not None for g in taken)
        # Partial sums this reduction must all-reduce, with zeros where this backward gave no gradient.
        owed = tuple(p in self._partial_sums and settings.all_reduces for p in group.params)
        flagged = settings.comm_hook is None
        if not any(with_grad) and not any(owed) and not (
            ran_backward and flagged and any(p.requires_grad for p in group.params)
        ):
            return None
        # Every trainable parameter, zeros where this rank has no gradient, and the flag columns (see the
        # Note); FSDP1 communication hooks get the gradients present (and owed) only, as in FSDP1.
        packed = tuple(g is not None or o or (flagged and p.requires_grad) for p, g, o in zip(group.params, taken, owed))
        layout = self._layouts.get(packed)
        if layout is None:
            layout = group.layout.subset(packed)
            if flagged:
                flags = ParamLayout((layout.world_size, len(layout.params)), 0, layout.world_size)
                layout = GroupLayout((*layout.params, flags))
            self._layouts[packed] = layout
        params = [p for p, keep in zip(group.params, packed) if keep]
        kept = [g for g, keep in zip(taken, packed) if keep]
        if group.mixed or len({g.dtype for g in kept if g is not None}) > 1:
            # One reduce dtype for all ([Note: Mixed dtypes] in group.py), also where some gradients were
            # accumulated in it without sync and others are a first one in the compute dtype.
            kept = [None if g is None else g.to(group.reduce_dtype) for g in kept]
        # Without flags (a comm hook) only owed parameters are packed without a gradient: they are delivered.
        missing = frozenset(i for i, g in enumerate(kept) if g is None) if flagged else frozenset()
        dtype = next((g.dtype for g in kept if g is not None), group.reduce_dtype)  # packed in one kernel: one dtype
        grads = [g if g is not None else torch.zeros(p.layout.shape, dtype=dtype, device=group.device)
                 for p, g in zip(params, kept)]
        if flagged:
            grads.append(self._flag_rows(tuple(g is not None for g in kept), dtype, layout.world_size))
        op, _, before, _ = self._reduce_op_and_factors()
        shape = (layout.world_size, layout.shard_numel)
        if settings.custom_comm is not None:
            inp = settings.custom_comm.allocate((shape[0] * shape[1],), dtype=group.reduce_dtype,
                                                device=group.device).view(shape)
        else:
            inp = torch.empty(shape, dtype=group.reduce_dtype, device=group.device)
        with profiled("reduce_scatter_copy_in", group.label):
            pack_rank_major(layout, grads, inp)
            if before != 1.0:
                inp.div_(before)
        del taken, kept, grads  # the unsharded gradients die here, right after the copy-in
        if settings.comm_hook is not None:
            hook_state, hook = settings.comm_hook
            if group.mesh_info.shard_axis is None:  # NO_SHARD: the hook all-reduces the gradient in place
                output = inp.view(-1)
                hook(hook_state, output)
            else:
                output = torch.empty(layout.shard_numel, dtype=group.reduce_dtype, device=group.device)
                hook(hook_state, inp.view(-1), output)
            collective = PendingCollective(None, output, (inp, output), streams.record())
        else:
            copied_in = streams.record()
            with streams.on(streams.reduce_scatter):
                streams.wait(copied_in)
                collective = reduce_scatter(
                    inp, settings.reduce_scatter_group or group.mesh_info.shard_group, streams, group.label, op,
                    settings.custom_comm,
                )
        pending = PendingReduce(self, params, layout, collective, missing=missing)
        if streams.on_accelerator:
            while pending.stage is not ReduceStage.DELIVERED:  # queue every stage now, on the side streams
                self.advance(pending)
        return pending

    def _flag_rows(self, with_grad: tuple[bool, ...], dtype: torch.dtype, world_size: int) -> torch.Tensor:
        """``(world_size, len(with_grad))``: every row 1 where this rank has a gradient, else 0 (made once)."""
        key = (*with_grad, dtype)
        rows = self._flags.get(key)
        if rows is None:
            row = torch.tensor([float(f) for f in with_grad], dtype=dtype)
            rows = self._flags[key] = row.repeat(world_size, 1).to(self.group.device)
        return rows

    def advance(self, pending: PendingReduce) -> None:
        """Take ``pending`` one stage further (on CPU this waits for the collective in flight)."""
        group, settings, streams = self.group, self.settings, self.group.streams
        if pending.stage is ReduceStage.REDUCE_SCATTER:
            with streams.on(streams.reduce_scatter if settings.comm_hook is None else None):
                reduced = pending.reduce_scatter.wait()
                if not streams.on_accelerator:  # CPU: the collective is complete; accelerators: see release_input
                    pending.reduce_scatter.buffers = ()
                pending.held.append(reduced)
                replicate_group = group.mesh_info.replicate_group
                if replicate_group is None or settings.comm_hook is not None:  # (a hook did the replicas' sum)
                    self._deliver(pending, reduced)
                    return
                chunks = group.split(reduced, pending.layout)
                # The flag counts go with the sums: a parameter no rank had a gradient for in any of the
                # backwards keeps grad None.
                flags = chunks[len(pending.params)] if len(chunks) > len(pending.params) else None
                if not settings.all_reduces:
                    # Keep the partial (per-replica) sums until a backward that all-reduces.
                    for i, (p, chunk) in enumerate(zip(pending.params, chunks)):
                        _add_into(self._partial_sums, p, chunk, group.accumulate_dtype)
                        if flags is not None:
                            _add_into(self._partial_flags, p, flags.narrow(0, i, 1))
                    pending.done = streams.record()
                    pending.stage = ReduceStage.DELIVERED
                    return
                if self._partial_sums:
                    for i, (p, chunk) in enumerate(zip(pending.params, chunks)):
                        partial = self._partial_sums.pop(p, None)
                        if partial is not None:
                            chunk.add_(partial)
                        count = self._partial_flags.pop(p, None)
                        if count is not None and flags is not None:
                            flags.narrow(0, i, 1).add_(count)
                scattered = streams.record()
            with streams.on(streams.all_reduce):
                streams.wait(scattered)
                _, op, _, _ = self._reduce_op_and_factors()
                pending.all_reduce = all_reduce(reduced, replicate_group, streams, group.label, op)
            pending.stage = ReduceStage.ALL_REDUCE
            return
        if pending.stage is ReduceStage.ALL_REDUCE:
            assert pending.all_reduce is not None
            with streams.on(streams.all_reduce):
                self._deliver(pending, pending.all_reduce.wait())

    def _deliver(self, pending: PendingReduce, reduced: torch.Tensor) -> None:
        """Divide, run the all-reduce hook, cast / offload and assign or add the sharded gradients (current stream)."""
        group, settings, streams = self.group, self.settings, self.group.streams
        self._share_replicated(pending.layout, reduced)
        _, _, _, after = self._reduce_op_and_factors()
        if after != 1.0:
            reduced.div_(after)
        if settings.all_reduce_hook is not None:  # on the gradients, without the flag columns
            grads_numel = pending.layout.shard_offsets[-1] if len(pending.layout.params) > len(pending.params) else None
            hooked = reduced if grads_numel is None else reduced.narrow(0, 0, grads_numel)
            streams.wait(run_hook_on(streams, settings.all_reduce_hook_stream, settings.all_reduce_hook, hooked))
        orig_dtype = reduced.dtype if group.mixed else group.flat_shard.dtype  # mixed: cast per parameter below
        to_host = group.shard_device != group.device
        if reduced.dtype == orig_dtype and not to_host:
            flat_grad = reduced
        else:
            flat_grad = torch.empty(
                reduced.shape, dtype=orig_dtype, device=group.shard_device, pin_memory=group.pin_memory and to_host
            )
            flat_grad.copy_(reduced, non_blocking=True)
            pending.held.append(flat_grad)
        host_pending = to_host and streams.on_accelerator  # the copy is complete only once `done` has passed
        delivered = pending.params
        if pending.missing and not settings.reduce_unused_params:
            # Zeros this rank packed: a gradient only where some rank had one (flags summed, see the Note).
            flags = group.split(reduced, pending.layout)[-1]
            counts = (flags.real if flags.is_complex() else flags).tolist()
            delivered = [p for i, p in enumerate(pending.params) if i not in pending.missing or counts[i] > 0]
        chunks = dict(zip(pending.params, group.split(flat_grad, pending.layout)))
        # Fresh gradients laid out as the flat shard are marked with their flat buffer ([Note: Flat optimizer steps]).
        whole = None
        if len(delivered) == len(group.params) and flat_grad.dtype == group.flat_shard.dtype and group.flat_steppable:
            # Every parameter packed, in the group's order (the flag columns follow).
            whole = FlatGrad(flat_grad.narrow(0, 0, group.layout.shard_numel), group.weak_self)
        for p in delivered:
            chunk = chunks[p]
            if chunk.is_complex() and not p.orig_dtype.is_complex:
                chunk = chunk.real  # ([Note: Complex and integer parameters] in group.py)
            if chunk.dtype != p.orig_dtype or not chunk.is_contiguous():
                chunk = chunk.to(p.orig_dtype, memory_format=torch.contiguous_format)
            grad = p.sharded.grad
            if grad is None:
                p.sharded.grad = fresh = p.as_dtensor(chunk)
                if whole is not None:
                    setattr(fresh, FLAT_GRAD, whole)
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if host_pending:
                pending.host_adds.append((local, p.local_rows(chunk)))
            else:
                local.add_(p.local_rows(chunk))
        pending.done = streams.record()
        pending.stage = ReduceStage.DELIVERED
        if host_pending:
            pending.hooks_due = list(delivered)
        else:
            _fire_post_accumulate_hooks(delivered)

    def _share_replicated(self, layout: GroupLayout, reduced: torch.Tensor) -> None:
        """Give every shard rank the gradient sums of the replicated (0-dim) parameters, which the reduce-scatter
        left on shard rank 0 ([Note: Replicated scalars] in layout.py): one all-reduce of those elements."""
        group, offsets = self.group, layout.replicated_offsets
        if not offsets or group.mesh_info.shard_size == 1:
            return
        index = self._replicated_index.get(offsets)
        if index is None:
            index = self._replicated_index[offsets] = torch.tensor(offsets, device=reduced.device)
        sums = reduced.index_select(0, index)
        shard_group = self.settings.reduce_scatter_group or group.mesh_info.shard_group
        assert shard_group is not None  # more than one shard rank
        all_reduce(sums, shard_group, group.streams, group.label, dist.ReduceOp.SUM).wait()
        reduced.index_copy_(0, index, sums)

    def discard(self) -> None:
        """Drop gradients not yet reduced (after a failed iteration)."""
        for p in self.group.params:
            p.unsharded.grad = None
            p.accumulated_grad = None
        self._partial_sums.clear()
        self._partial_flags.clear()
        self._unreduced_backward = False


def _add_into(kept: dict[ShardedParam, torch.Tensor], p: ShardedParam, value: torch.Tensor,
              dtype: torch.dtype | None = None) -> None:
    """Add ``value`` into ``kept[p]``, made as a copy (in ``dtype`` when given) the first time."""
    if p in kept:
        kept[p].add_(value)
    else:
        kept[p] = value.to(dtype or value.dtype, copy=True)


def split_division(factor: float) -> tuple[float, float]:
    """``(before, after)``: divide by ``before`` ahead of the sum and by ``after`` behind it (product ``factor``).

    ``before`` is a power of two: starting from 1, it doubles for as long as it divides ``factor``
    and its square is below ``factor`` (the last doubling may leave one that does not divide).
    Dividing by a power of two is exact in binary floating point (barring underflow), so fp16
    gradients shrink by about the square root of the factor before the sum without rounding, and
    the result rounds as torch's FSDP2 rounds it. Two ranks: 2 before, 1 after (nothing to do);
    four: 2 and 2; six: 4 and 1.5 (2 divides 6 and 2 * 2 < 6, so it doubles once more); eight: 4
    and 2; a factor 1 does not divide (2.5): 1 and 2.5.
    """
    before = 1.0
    while factor % before == 0 and before * before < factor:
        before *= 2
    return before, factor / before


def pack_rank_major(layout: GroupLayout, grads: list[torch.Tensor], out: torch.Tensor) -> None:
    """Fill the ``(world_size, shard_numel)`` reduce-scatter input: each gradient chunked over the ranks.

    Two ranks, gradients ``a = [a0 a1 a2]`` (padded to 4 rows) and ``b = [b0 b1]``:
    row 0 is ``a0 a1 b0``, row 1 ``a2 __ b1`` (``__`` = zero padding).
    """
    world_size = layout.world_size
    if layout.replicated_offsets:
        grads = [_in_first_row(g, world_size) if lay.replicated else g for g, lay in zip(grads, layout.params)]
    nonempty = [(g, lay, off) for g, lay, off in zip(grads, layout.params, layout.shard_offsets) if lay.shard_numel]
    if not nonempty:
        return
    if all(lay.shard_dim == 0 for _, lay, _ in nonempty):  # one kernel; casts to the reduce dtype on the way
        torch._chunk_cat([g for g, _, _ in nonempty], dim=0, num_chunks=world_size, out=out)
        return
    for grad, lay, off in nonempty:
        if lay.compact:
            full_to_slots(grad, out[:, off : off + lay.shard_numel], lay)
            continue
        padded = grad
        if not lay.is_even:
            padded = grad.new_zeros(lay.padded_shape)
            padded.narrow(lay.shard_dim, 0, lay.dim_size).copy_(grad)
        dst = out[:, off : off + lay.shard_numel].view(world_size, *lay.chunk_shape)
        dst.copy_(rank_axis_view(padded.contiguous(), lay.shard_dim, world_size))


def _in_first_row(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    """A 0-dim gradient as its rows of the reduce-scatter input: itself for rank 0, zeros for the others
    ([Note: Replicated scalars] in layout.py)."""
    rows = grad.new_zeros(world_size)
    rows[0] = grad
    return rows
