"""All-gather and reduce-scatter over flat buffers, asynchronous on every device.

[Note: Streams and lifetimes]
One abstraction serves CUDA-like devices and CPU:

- Every tensor a collective touches is *allocated on the compute stream*,
  before the communication stream is entered. The caching allocator then only
  hands that memory out again in compute-stream order.
- At issue time the communication stream waits for the compute stream (the
  optimizer step and the allocations above come first), then the copy-in and
  the collective are launched on it, so they overlap with compute.
- ``wait()`` orders the *current* stream after the collective (NCCL) or blocks
  the host until it is done (gloo), and only then drops the references the
  pending handle held; freeing before that point would let the allocator reuse
  memory the collective still reads or writes.

On CPU there are no streams: the same calls run inline and the collectives are
asynchronous ``Work`` handles completed by gloo's threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


class CommStreams:
    """Side streams for all-gather and reduce-scatter; no-ops on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device)
        # High priority so communication kernels are not queued behind compute.
        self.all_gather = self._module.Stream(priority=-1) if self._module else None
        self.reduce_scatter = self._module.Stream(priority=-1) if self._module else None

    def wait_event(self, event: torch.Event) -> None:
        """Order the next all-gathers after ``event`` too (e.g. recorded after the optimizer step)."""
        if self.all_gather is not None:
            self.all_gather.wait_event(event)  # type: ignore[attr-defined]

    def host_sync(self) -> None:
        """Block the host until the current stream's work (e.g. device-to-host copies) is done."""
        if self._module is not None:
            self._module.current_stream().synchronize()

    @contextlib.contextmanager
    def issue_on(self, stream: object | None) -> Iterator[None]:
        """Run the block on ``stream`` after everything already queued on the current stream."""
        if self._module is None or stream is None:
            yield
            return
        stream.wait_stream(self._module.current_stream())  # type: ignore[attr-defined]
        with self._module.stream(stream):
            yield


@dataclass
class PendingCollective:
    """An issued collective; ``wait()`` returns its output once it is safe to read."""

    work: dist.Work | None
    output: torch.Tensor
    # Inputs (and the tensors they were packed from) stay referenced until wait().
    keep_alive: tuple[object, ...]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.keep_alive = ()
        return self.output


def _all_gather_single(*args: Any, **kwargs: Any) -> dist.Work | None:
    # torch 2.13 renamed the single-tensor collectives; older releases have only the old names.
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> dist.Work | None:
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


def all_gather(
    flat_shard: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    streams: CommStreams,
    label: str,
) -> PendingCollective:
    """All-gather every rank's flat shard buffer into one rank-major output.

    Two ranks with flat shard buffers ``[1, 2]`` (rank 0) and ``[3, 4]``
    (rank 1) both receive ``[1, 2, 3, 4]``. ``flat_shard`` is sent as it is when
    it already has ``dtype`` and lives on ``device`` (no copy-in); otherwise it
    is cast / copied into a new all-gather input. A group of one rank issues no
    collective (``group=None`` means this rank alone): the output is the input.
    """
    world_size = 1 if group is None else dist.get_world_size(group)
    needs_copy = flat_shard.dtype != dtype or flat_shard.device != device
    inp = torch.empty(flat_shard.shape, dtype=dtype, device=device) if needs_copy else flat_shard
    output = inp if world_size == 1 else torch.empty(world_size * flat_shard.numel(), dtype=dtype, device=device)
    with record_function(f"fullshard::all_gather {label}"), streams.issue_on(streams.all_gather):
        if needs_copy:
            inp.copy_(flat_shard, non_blocking=True)
        work = None if world_size == 1 else _all_gather_single(output, inp, group=group, async_op=True)
    return PendingCollective(work, output, (inp,))


def reduce_scatter(
    sources: list[torch.Tensor],
    fill_input: Callable[[list[torch.Tensor], torch.Tensor], None],
    shard_numel: int,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    streams: CommStreams,
    label: str,
) -> PendingCollective:
    """Sum a rank-major input across ranks, each rank keeping its own row.

    ``fill_input(sources, input)`` packs ``sources`` into the
    ``(world_size, shard_numel)`` input on the reduce-scatter stream. Two ranks
    with inputs ``[1, 2, 3, 4]`` and ``[5, 6, 7, 8]``: rank 0 receives
    ``[6, 8]``, rank 1 ``[10, 12]``. The caller divides. A group of one rank
    issues no collective.
    """
    world_size = 1 if group is None else dist.get_world_size(group)
    inp = torch.empty(world_size, shard_numel, dtype=dtype, device=device)
    output = inp.view(-1) if world_size == 1 else torch.empty(shard_numel, dtype=dtype, device=device)
    with record_function(f"fullshard::reduce_scatter {label}"), streams.issue_on(streams.reduce_scatter):
        fill_input(sources, inp)
        work = None
        if world_size > 1:
            work = _reduce_scatter_single(output, inp.view(-1), op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingCollective(work, output, (inp, sources))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, streams: CommStreams, label: str) -> PendingCollective:
    """Sum ``tensor`` in place across ``group`` (HSDP replicas): ``[1, 2]`` and ``[3, 4]`` both become ``[4, 6]``."""
    with record_function(f"fullshard::all_reduce {label}"), streams.issue_on(streams.reduce_scatter):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingCollective(work, tensor, ())
