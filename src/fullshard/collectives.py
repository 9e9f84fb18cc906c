"""All-gather, reduce-scatter and all-reduce over flat buffers, asynchronous on every device.

[Note: Streams and lifetimes]
On an accelerator each root owns three side streams (``CommStreams``):
``all_gather``, ``reduce_scatter`` and ``all_reduce``. Who runs where, who
orders whom, and how long each buffer lives:

All-gather (``all_gather`` / ``PendingCollective.wait``)
- The all-gather stream waits for the compute stream *once per iteration*,
  before the first all-gather after the root's pre-forward or after anything
  wrote the flat shard buffers outside forward and backward (optimizer step,
  state-dict load, writeback: ``CommStreams.shards_written``). An event given to
  ``set_post_optim_event`` replaces that wait. Every later all-gather of the
  iteration is issued without waiting for compute, so prefetches run as far
  ahead as the prefetch depth allows.
- The copy-in (cast to the compute dtype, or host-to-device for offloaded
  shards) writes this rank's slot of the all-gather output, which is the
  all-gather input (in place, so no separate input lives while it runs); the
  output is allocated and written on the all-gather stream. ``wait()`` makes
  the compute stream wait for the collective and for an event recorded on the
  all-gather stream after issuing it (which alone orders the copy-in when one
  rank issues no collective); the
  copy-out into the unsharded buffer (allocated on the compute stream) runs
  there, then ``release()`` records an event and drops the input and output.
  Before its next allocation the all-gather stream waits for that event, so
  the memory is reused only after the compute stream read it.
- Host-to-device copies from pinned shards record ``h2d_done``; the host waits
  for it at the end of backward and after a forward-only pass, before the
  optimizer (or the user) can write into the pinned shards again.

Reduce-scatter (``reduce_scatter`` and ``fullshard.reduce``)
- The copy-in (pack the unsharded gradients rank-major, in the reduce dtype)
  runs on the compute stream into an input allocated there; the unsharded
  gradients are dropped right after, so they never outlive the copy-in.
- The reduce-scatter stream waits for an event recorded after the copy-in,
  allocates the output and runs the collective and everything after it: the
  division, the HSDP all-reduce (on the all-reduce stream, which waits for the
  reduce-scatter's event), the cast to the parameters' dtype, the copy to
  pinned host memory for offloading, and the accumulation into existing sharded
  gradients. Nothing of that is on the compute stream.
- The input (compute-stream memory) is kept until the compute stream has
  waited for the reduce-scatter's event: when more than the group's
  ``max_inputs_in_flight`` reductions are in flight, or at the end of
  backward. Outputs and all-reduce buffers are kept until the compute stream
  has waited for the last post-reduce event, at the end of backward; that
  wait is the only point where compute depends on gradient communication.

On CPU (gloo) there are no streams: the same calls run inline, the
collectives are asynchronous ``Work`` handles, and ``wait()`` blocks; the work
after a reduce-scatter runs when the reduction is drained (the in-flight bound,
or the end of backward), with the HSDP all-reduce issued then and waited at the
end of backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from fullshard import failures
from fullshard.layout import is_float8

ALIGN = 16  # bytes: where each tensor of a packed all-gather starts


def profiled(kind: str, label: str = "") -> contextlib.AbstractContextManager[Any]:
    """``record_function("fullshard::<kind> <label>")`` while a profiler records; nothing otherwise.

    Entering and leaving a ``record_function`` costs about 15 us even with no
    profiler running, several times per group and step.
    """
    if torch._C._autograd._profiler_enabled():
        return record_function(f"fullshard::{kind} {label}" if label else f"fullshard::{kind}")
    return contextlib.nullcontext()


class CommStreams:
    """Side streams and the events that order them against the compute stream; no-ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module: Any = None if device.type == "cpu" else torch.get_device_module(device)
        # High priority so communication kernels are not queued behind compute.
        self.all_gather = self._module.Stream(priority=-1) if self._module else None
        self.reduce_scatter = self._module.Stream(priority=-1) if self._module else None
        self.all_reduce = self._module.Stream(priority=-1) if self._module else None
        self._wait_for_compute = True  # the next all-gather must wait for the compute stream first
        self._post_optim_event: Any = None  # replaces that wait, once
        self._all_gather_released: Any = None  # compute read the last released all-gather buffers
        self.h2d_done: Any = None  # the last host-to-device copy from pinned shards
        # The root's divergence checks ([Note: Divergence check]); set at lazy init. It rides here because
        # every collective of the root is issued with these streams.
        self.monitor: failures.Monitor | None = None

    def issued(self, kind: str, label: str, numel: int, group: dist.ProcessGroup | None) -> failures.Ticket | None:
        """Record a collective about to go out on ``group`` (compared with the peers first where needed)."""
        return self.monitor.issued(kind, label, numel, group) if self.monitor is not None else None

    @property
    def on_accelerator(self) -> bool:
        return self._module is not None

    def current(self) -> Any:
        return self._module.current_stream() if self._module else None

    def record(self, stream: Any = None) -> Any:
        """An event on ``stream`` (default: the current one); None on CPU."""
        if self._module is None:
            return None
        return (stream or self.current()).record_event()

    def wait(self, event: Any, stream: Any = None) -> None:
        """Order ``stream`` (default: the current one) after ``event``."""
        if event is not None:
            (stream or self.current()).wait_event(event)

    def shards_written(self, post_optim_event: Any = None) -> None:
        """The flat shard buffers were written on the compute stream (or ``post_optim_event`` marks when)."""
        self._wait_for_compute = True
        self._post_optim_event = post_optim_event

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Run the block (its kernels and allocations) on ``stream``."""
        if stream is None:
            yield
            return
        with self._module.stream(stream):
            yield

    @contextlib.contextmanager
    def all_gather_stream(self) -> Iterator[None]:
        """Enter the all-gather stream, ordered after the writes its inputs need and the memory it may reuse."""
        stream = self.all_gather
        if stream is not None:
            if self._post_optim_event is not None:
                stream.wait_event(self._post_optim_event)
            elif self._wait_for_compute:
                stream.wait_stream(self.current())
            self._wait_for_compute = False
            self._post_optim_event = None
            self.wait(self._all_gather_released, stream)
            self._all_gather_released = None
        with self.on(stream):
            yield

    def all_gather_read(self) -> None:
        """The compute stream has queued every read of the released all-gather buffers."""
        self._all_gather_released = self.record()


@dataclass
class PendingCollective:
    """An issued collective; ``wait()`` orders the current stream after it (or blocks, on CPU)."""

    work: dist.Work | None
    output: torch.Tensor
    # Buffers the collective reads or writes; kept until the caller releases them (see the Note).
    buffers: tuple[torch.Tensor, ...] = ()
    done: Any = None  # an event on the stream that issued it, recorded right after it
    issued: Any = None  # accelerators: an event after the side-stream work ``wait()`` must also order after
    what: str = ""  # for errors: "all-gather of group 'blocks.0'"
    group: dist.ProcessGroup | None = None
    ticket: failures.Ticket | None = None  # its place in the root's checks ([Note: Divergence check] in failures.py)
    parts: tuple[tuple[int, int, torch.dtype], ...] | None = None  # packed all-gather: (offset, bytes, dtype) each

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            if self.output.device.type == "cpu":  # the host blocks: bounded, see [Note: Failure detection]
                failures.wait(self.work, self.what, self.group, self.ticket)
            else:
                self.work.wait()
            self.work = None
        if self.issued is not None:  # the kernels queued before the collective (a copy-in), on a side stream
            torch.get_device_module(self.output.device).current_stream().wait_event(self.issued)
            self.issued = None
        return self.output


def all_gather_single(*args: Any, **kwargs: Any) -> dist.Work | None:
    # torch 2.13 renamed the single-tensor collectives; older releases have only the old names.
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> dist.Work | None:
    # Complex buffers as their real pairs: torch converts them for the other collectives, not for this one
    # (NCCL has no complex type); a sum of complex numbers is the sum of their parts.
    output, inp = (torch.view_as_real(t).view(-1) if t.is_complex() else t for t in (output, inp))
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output, inp, **kwargs)


def all_gather(
    flat_shard: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    streams: CommStreams,
    label: str,
    comm: Any = None,
) -> PendingCollective:
    """All-gather every rank's flat shard buffer into one rank-major output.

    Two ranks with flat shard buffers ``[1, 2]`` (rank 0) and ``[3, 4]``
    (rank 1) both receive ``[1, 2, 3, 4]``. ``flat_shard`` is sent as it is when
    it already has ``dtype`` and lives on ``device`` (no copy-in); otherwise it
    is cast / copied into this rank's slot of the output, which is then the
    all-gather input (in place: rank 0 writes ``[1, 2]`` into ``[_, _, _, _]``
    at 0, rank 1 ``[3, 4]`` at 2). A group of one rank issues no
    collective (``group=None`` means this rank alone): the output is the input.
    ``comm`` (``FSDPModule.set_custom_all_gather``: torch's ``AllGather``) allocates
    the output and runs the collective instead.
    """
    world_size = 1 if group is None else dist.get_world_size(group)
    needs_copy = flat_shard.dtype != dtype or flat_shard.device != device
    with profiled("all_gather", label), streams.all_gather_stream():
        if needs_copy:
            output, inp = _gather_buffers(flat_shard.numel(), dtype, device, world_size, group, comm)
            inp.copy_(flat_shard.view(-1), non_blocking=True)
            if flat_shard.device != device:
                streams.h2d_done = streams.record()
        else:
            output, inp = _gather_output(flat_shard, world_size, comm), flat_shard
        work, ticket = _issue_all_gather(inp, output, group, label, comm, streams)
        # `work.wait()` orders the waiter after the collective, but not after the copy-in when no collective
        # runs (one rank, no elements): the event covers that (and states the order to stream checkers).
        issued = streams.record()
    return PendingCollective(work, output, (inp, output), issued=issued, what=f"all-gather of {failures.group_name(label)}",
                             group=group, ticket=ticket)


def _gather_output(inp: torch.Tensor, world_size: int, comm: Any) -> torch.Tensor:
    """The rank-major output for an all-gather of ``inp`` (``inp`` itself on one rank)."""
    return inp if world_size == 1 else _allocate_output(inp.numel(), inp.dtype, inp.device, world_size, comm)


def _gather_buffers(numel: int, dtype: torch.dtype, device: torch.device, world_size: int,
                    group: dist.ProcessGroup | None, comm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of an all-gather whose input is written by a copy-in, and that input: this rank's slot of the
    output (an in-place all-gather, as NCCL and gloo allow), so no separate input buffer lives while it runs."""
    if world_size == 1:
        inp = torch.empty(numel, dtype=dtype, device=device)
        return inp, inp
    output = _allocate_output(numel, dtype, device, world_size, comm)
    if output.storage_offset() * output.element_size() % ALIGN:
        # ``comm`` allocated off an ALIGN-byte boundary, where a packed input's parts are viewed as other dtypes
        return output, torch.empty(numel, dtype=dtype, device=device)
    assert group is not None
    return output, output.narrow(0, group.rank() * numel, numel)


def _allocate_output(numel: int, dtype: torch.dtype, device: torch.device, world_size: int, comm: Any) -> torch.Tensor:
    """``world_size`` slots of ``numel`` elements, by ``comm`` (torch's ``AllGather``) when given."""
    if comm is not None:
        return comm.allocate((world_size * numel,), dtype=dtype, device=device)  # type: ignore[no-any-return]
    return torch.empty(world_size * numel, dtype=dtype, device=device)


def _issue_all_gather(
    inp: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup | None, label: str, comm: Any,
    streams: CommStreams,
) -> tuple[dist.Work | None, failures.Ticket | None]:
    """Issue the all-gather of ``inp`` into ``output`` (nothing on one rank or without elements)."""
    if output is inp or not inp.numel():
        return None, None
    ticket = streams.issued("all-gather", label, inp.numel(), group)
    if comm is not None:  # by keyword, as FSDP2 calls torch's AllGather protocol
        work = comm(output_tensor=output, input_tensor=inp, group=group, async_op=True)
    else:
        work = _all_gather_into(output, inp, group, True)
    return work, ticket


def _all_gather_into(
    output: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    if is_float8(inp.dtype):  # as bytes: gloo has no float8 type
        return all_gather_single(output.view(torch.uint8), inp.view(torch.uint8), group=group, async_op=async_op)
    return all_gather_single(output, inp, group=group, async_op=async_op)


class ProcessGroupAllocated:
    """Collective buffers from the process group's own allocator where its backend has one for the device (NCCL's
    registered memory, for zero-copy transfers), else from the caching allocator: the all-gather and reduce-scatter
    comms of ``FSDPModule.set_allocate_memory_from_process_group_for_comm(True)``."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self.group._get_backend(device) if self.group is not None else None
        if backend is not None and backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device).view(size)
        return torch.empty(size, dtype=dtype, device=device)


class ProcessGroupAllGather(ProcessGroupAllocated):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None,
                 async_op: bool = False) -> dist.Work | None:
        return _all_gather_into(output_tensor, input_tensor, group, async_op)


class ProcessGroupReduceScatter(ProcessGroupAllocated):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None, op: Any,
                 async_op: bool = False) -> dist.Work | None:
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def all_gather_packed(
    encode: Callable[[], list[torch.Tensor]],
    device: torch.device,
    group: dist.ProcessGroup | None,
    streams: CommStreams,
    label: str,
    comm: Any = None,
) -> PendingCollective:
    """All-gather the tensors ``encode()`` returns (any dtypes) as one byte buffer ([Note: Packed all-gather]).

    ``encode`` runs on the all-gather stream. Each tensor starts at a multiple of
    ``ALIGN`` bytes; ``parts`` of the result says where, so ``unpack`` can cut every
    rank's copies back out.
    """
    world_size = 1 if group is None else dist.get_world_size(group)
    with profiled("all_gather", label), streams.all_gather_stream():
        tensors = encode()
        parts, total = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            parts.append((total, nbytes, t.dtype))
            total += -(-nbytes // ALIGN) * ALIGN
        output, inp = _gather_buffers(total, torch.uint8, device, world_size, group, comm)
        for t, (offset, nbytes, dtype) in zip(tensors, parts):
            inp.narrow(0, offset, nbytes).view(dtype).copy_(t.reshape(-1))
        del tensors
        work, ticket = _issue_all_gather(inp, output, group, label, comm, streams)
        issued = streams.record()
    return PendingCollective(work, output, (inp, output), issued=issued, what=f"all-gather of {failures.group_name(label)}",
                             group=group, ticket=ticket, parts=tuple(parts))


def unpack(output: torch.Tensor, parts: tuple[tuple[int, int, torch.dtype], ...], world_size: int) -> list[torch.Tensor]:
    """Every packed tensor of every rank from a packed all-gather's output, each ``(world_size, numel)``."""
    rank_major = output.view(world_size, -1)
    # An empty part (a zero-element tensor) has no bytes to reinterpret: its column slice may have any stride.
    return [rank_major[:, offset : offset + nbytes].contiguous().view(dtype) if nbytes else
            rank_major.new_empty((world_size, 0), dtype=dtype) for offset, nbytes, dtype in parts]


def reduce_scatter(
    inp: torch.Tensor,
    group: dist.ProcessGroup | None,
    streams: CommStreams,
    label: str,
    op: Any = None,
    comm: Any = None,
) -> PendingCollective:
    """Sum a rank-major ``(world_size, shard_numel)`` input across ranks, each rank keeping its own row.

    Two ranks with inputs ``[1, 2, 3, 4]`` and ``[5, 6, 7, 8]``: rank 0 receives
    ``[6, 8]``, rank 1 ``[10, 12]``. ``op`` is ``ReduceOp.SUM`` unless given
    (``AVG`` divides by the world size inside the collective). Issued on the
    current stream, which must be the reduce-scatter stream on accelerators. A
    group of one rank issues no collective. ``comm`` (torch's ``ReduceScatter``)
    allocates the output and runs the collective instead.
    """
    world_size = 1 if group is None else dist.get_world_size(group)
    with profiled("reduce_scatter", label):
        if world_size == 1 or inp.numel() == 0:
            return PendingCollective(None, inp.view(-1) if world_size == 1 else inp.new_empty(0), (inp,), streams.record())
        op = dist.ReduceOp.SUM if op is None else op
        ticket = streams.issued("reduce-scatter", label, inp.numel(), group)
        if comm is not None:
            output = comm.allocate((inp.shape[1],), dtype=inp.dtype, device=inp.device)
            work = comm(output_tensor=output, input_tensor=inp.view(-1), group=group, op=op, async_op=True)
        else:
            output = torch.empty(inp.shape[1], dtype=inp.dtype, device=inp.device)
            work = reduce_scatter_single(output, inp.view(-1), op=op, group=group, async_op=True)
    pending = PendingCollective(work, output, (inp, output), what=f"reduce-scatter of {failures.group_name(label)}", group=group,
                                ticket=ticket)
    return _ordered(pending, streams)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, streams: CommStreams, label: str, op: Any = None
) -> PendingCollective:
    """Sum ``tensor`` in place across ``group`` (HSDP replicas): ``[1, 2]`` and ``[3, 4]`` both become ``[4, 6]``.

    Issued on the current stream (the all-reduce stream on accelerators).
    """
    with profiled("all_reduce", label):
        ticket = streams.issued("all-reduce", label, tensor.numel(), group)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=True)
    pending = PendingCollective(work, tensor, (tensor,), what=f"all-reduce of {failures.group_name(label)}", group=group,
                                ticket=ticket)
    return _ordered(pending, streams)


def broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, streams: CommStreams, label: str) -> PendingCollective:
    """``tensor`` as the first rank of ``group`` holds it, in place on every rank (issued on the current stream)."""
    with profiled("broadcast", label):
        ticket = streams.issued("broadcast", label, tensor.numel(), group)
        work = dist.broadcast(tensor, group_src=0, group=group, async_op=True)
    pending = PendingCollective(work, tensor, (tensor,), what=f"broadcast of {failures.group_name(label)}", group=group,
                                ticket=ticket)
    return _ordered(pending, streams)


def _ordered(pending: PendingCollective, streams: CommStreams) -> PendingCollective:
    """Accelerators: order the current (side) stream after the collective now and record ``done`` there, so
    the work queued after it, and whoever waits for ``done``, see its result. CPU: left in flight."""
    if streams.on_accelerator:
        pending.wait()  # a stream-level wait for NCCL: the host does not block
        pending.done = streams.record()
    return pending


def run_hook_on(streams: CommStreams, stream: Any, hook: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> Any:
    """Run ``hook(tensor)`` on ``stream`` (ordered after the current stream); return the event to wait for it."""
    if stream is None:
        hook(tensor)
        return None
    if not streams.on_accelerator:  # nothing to order; the hook still finds its stream current, as with FSDP2
        with torch.cpu.stream(stream):
            hook(tensor)
        return None
    stream.wait_stream(streams.current())
    with streams.on(stream):
        hook(tensor)
        return streams.record()
