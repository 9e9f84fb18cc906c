"""FSDP1's conveniences over the engine: full parameters on demand, no-sync, gradient clipping, reduction hooks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard.collectives import reduce_scatter_single
from fullshard.errors import UnsupportedError, UsageError, expect_module
from fullshard.group import ShardedState
from fullshard.optim import flat_runs
from fullshard.param import sharded_axes
from fullshard.runtime import TrainingState, states_in, take_over_changes

# ---- summon_full_params --------------------------------------------------------------------------


@contextlib.contextmanager
def summon_full_params(
    model: nn.Module,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context every parameter of ``model`` is its full (unsharded) tensor.

    - ``writeback``: changes made inside are copied back into the shards on exit
      (each rank keeps its own rows of its own full copy); otherwise they are dropped.
    - ``rank0_only``: only rank 0 sees full parameters; the other ranks keep their
      sharded ones. Cannot be combined with ``writeback``.
    - ``offload_to_cpu``: the full parameters are CPU copies (device memory stays free).
    - ``with_grads``: each full parameter's ``.grad`` is the full gradient.

    The values shown are the sharded parameters' in their own dtype, also under a
    mixed-precision or quantized-communication policy. A forward inside the context
    computes with them and communicates nothing (``rank0_only=True``: on rank 0
    alone); a backward inside it reduces nothing, and its gradients are dropped at
    the exit.

    Collective: every rank must enter it. Not allowed inside forward or backward.
    """
    expect_module("summon_full_params", model)
    if rank0_only and writeback:
        raise UnsupportedError(
            "summon_full_params: rank0_only=True and writeback=True cannot be combined (ranks other than 0 "
            "have no full parameters to write back); pass writeback=False"
        )
    states = states_in(model)
    busy = [s.label for s in states if s.training_state is not TrainingState.IDLE]
    if busy or any(s.ctx is not None and s.ctx.end_of_backward_queued for s in states):
        raise UsageError(f"summon_full_params cannot run inside forward or backward (busy: {busy or 'backward'})")
    groups = [g for s in states for g in s.groups]
    if any(g.summoned for g in groups):
        raise UsageError("summon_full_params cannot be nested")
    for state in states:  # outermost first: a root takes over what was assigned since fully_shard
        if state.ctx is None:
            state.lazy_init()
    take_over_changes(states)
    groups = [g for s in states for g in s.groups]  # a tie taken over may have moved parameters
    keep_full = not rank0_only or dist.get_rank() == 0
    try:
        for group in groups:
            group.summon(keep_full=keep_full, offload_to_cpu=offload_to_cpu, with_grads=with_grads)
        for state in states:
            state.summoned = True
        yield
    finally:
        for state in states:
            state.summoned = False
        for group in groups:
            group.write_back_summoned(writeback)
        for group in groups:
            group.end_summon()


# ---- no_sync -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate unsharded gradients without communication.

    The same as ``set_requires_gradient_sync(False)`` for the duration; the
    first backward after the context reduces everything accumulated.
    """
    expect_module("no_sync", model)
    settings = [g.reducer.settings for s in states_in(model) for g in s.groups]
    saved = [entry.requires_gradient_sync for entry in settings]
    for entry in settings:
        entry.requires_gradient_sync = False
    try:
        yield
    finally:
        for entry, sync in zip(settings, saved):
            entry.requires_gradient_sync = sync


# ---- clip_grad_norm_ -----------------------------------------------------------------------------------


def _reduce_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    # NCCL reduces device tensors only (offloaded gradients live on CPU).
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else device


def trained_parameters(model: nn.Module) -> list[torch.Tensor]:
    """``model.parameters()`` with the sharded parameter in place of each unsharded one a group registers while
    unsharded (after a forward not back-propagated yet): the ones that hold the gradients."""
    sharded = {id(sp.unsharded): sp.sharded for state in states_in(model) for group in state.groups
               if group.state is not ShardedState.SHARDED for sp in group.params}
    return [sharded.get(id(p), p) for p in model.parameters()]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model`` so their total ``norm_type`` norm is at most ``max_norm``.

    Returns the total norm before clipping, as a 0-dim fp32 tensor (float64 when a gradient is), identical on
    every rank and equal to the unsharded model's. Parameters without a gradient
    (frozen ones) are skipped; replicated gradients are counted once. Norms are
    taken with foreach kernels over the local shards, one all-reduce per mesh axis
    the gradients are sharded over (FSDP + tensor parallel: the dp and the tp
    axis), and the scaling is one foreach multiply per device.
    """
    expect_module("clip_grad_norm_", model)
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | torch.Tensor):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {type(max_norm).__name__}")
    if not float(max_norm) >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be at least 0 (inf: measure only), got {float(max_norm)}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float | str) or str(norm_type) == "nan":
        raise TypeError(f"clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}")
    try:
        norm_type = float(norm_type)
    except ValueError:  # a string that is no number (torch's clip_grad_norm_ raises ValueError too)
        raise ValueError(f"clip_grad_norm_: norm_type must be a number or 'inf', got {norm_type!r}") from None
    infinite = math.isinf(norm_type)
    # Local pieces by (mesh, axes they are sharded over); plain gradients under (None, ()).
    buckets: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    # A whole group's gradients delivered as views of one flat buffer count as one tensor (zero padding).
    runs, single = flat_runs([p for p in trained_parameters(model) if p.grad is not None])
    for owner, _, flat_grad in runs:
        # The flat gradient sits where the flat shard does: it is sharded as the parameters are.
        key = owner.placement_key
        if key is not None:
            buckets.setdefault(key, []).append(flat_grad)
        else:  # tensor parallel: placements differ within the group
            single.extend(sp.sharded for sp in owner.params)
    for p in single:
        grad = p.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            buckets.setdefault((grad.device_mesh, sharded_axes(grad.placements)), []).append(grad._local_tensor)
        else:
            buckets.setdefault((None, ()), []).append(grad)
    locals_ = [g for bucket in buckets.values() for g in bucket]
    device = locals_[0].device if locals_ else torch.device("cpu")
    acc = torch.float64 if any(g.dtype in (torch.float64, torch.complex128) for g in locals_) else torch.float32
    # Per mesh: the buckets' partial norms are summed (max for inf) over every axis any of them is sharded
    # over; a bucket replicated along such an axis enters scaled by 1 / its size, so it counts once.
    per_mesh: dict[DeviceMesh | None, tuple[list[tuple[torch.Tensor, tuple[int, ...]]], set[int]]] = {}
    for (mesh, axes), bucket in buckets.items():
        nonempty = [g for g in bucket if g.numel()]  # a rank past the end of a parameter holds no rows
        part = torch.zeros((), dtype=acc, device=device)
        if nonempty:
            norms = torch.stack([n.to(device, acc) for n in _norms(nonempty, norm_type)])
            part = norms.max() if infinite else norms.pow(norm_type).sum()
        parts, mesh_axes = per_mesh.get(mesh, ([], set()))
        parts.append((part, axes))
        per_mesh[mesh] = (parts, mesh_axes | set(axes))
    total = torch.zeros((), dtype=acc, device=device)
    for mesh, (parts, mesh_axes) in per_mesh.items():
        part = torch.zeros((), dtype=acc, device=device)
        for value, axes in parts:
            if infinite:
                part = torch.maximum(part, value)
                continue
            copies = math.prod(mesh.size(a) for a in mesh_axes - set(axes)) if mesh is not None else 1
            part = part + value / copies
        for axis in sorted(mesh_axes):  # every rank reduces every axis, empty or not
            assert mesh is not None
            group = mesh.get_group(axis)
            part = part.to(_reduce_device(group, device))
            dist.all_reduce(part, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=group)
            part = part.to(device)
        total = torch.maximum(total, part) if infinite else total + part
    if not infinite:
        total = total.pow(1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in locals_:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (dev, dtype), grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device=dev, dtype=dtype))
    return total


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Norms of ``grads``: fp32 and narrower ones accumulated in fp32, float64 and complex ones in their own
    precision (a complex tensor's norm is real: that of its elements' magnitudes)."""
    own = [g.dtype == torch.float64 or g.is_complex() for g in grads]
    narrow = [g for g, keep in zip(grads, own) if not keep]
    wide = [g for g, keep in zip(grads, own) if keep]
    norms = list(torch._foreach_norm(narrow, norm_type, dtype=torch.float32)) if narrow else []
    return norms + list(torch._foreach_norm(wide, norm_type)) if wide else norms


def nonfinite_gradients(model: nn.Module) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an infinity on any rank (the same list everywhere).

    Collective: every rank must call it. Cheap to call only when needed, e.g. when the total norm returned
    by :func:`clip_grad_norm_` is not finite (that norm is identical on every rank, so all ranks agree on it).
    """
    expect_module("nonfinite_gradients", model)
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    flags = torch.tensor(
        [0.0 if bool(torch.isfinite(g._local_tensor if isinstance(g, DTensor) else g).all()) else 1.0 for _, g in named],
        dtype=torch.float32,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flags = flags.to(comm)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [name for (name, _), bad in zip(named, flags.tolist(), strict=True) if bad]


# ---- gradient reduction hooks ----------------------------------------------------------------------


def _divide_factors(world_size: int) -> tuple[float, float]:
    """(before, after): powers of two splitting ``world_size`` so low-precision sums stay in range."""
    before = 1.0
    while world_size % (before * 2) == 0 and world_size / (before * 2) >= before * 2:
        before *= 2
    return before, world_size / before


@dataclass
class ReduceState:
    """What the standard hooks need: the group to reduce over and how to split the averaging division."""

    process_group: dist.ProcessGroup
    divide_before: float = field(init=False)
    divide_after: float = field(init=False)

    def __post_init__(self) -> None:
        self.divide_before, self.divide_after = _divide_factors(dist.get_world_size(self.process_group))


def _reduce_scatter_in(dtype: torch.dtype | None) -> Callable[..., None]:
    def hook(state: ReduceState, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        send = grad if dtype is None else grad.to(dtype)
        send.div_(state.divide_before)
        if output is None:  # NO_SHARD: the whole gradient, averaged in place with one all-reduce
            dist.all_reduce(send, group=state.process_group)
            send.div_(state.divide_after)
            if send is not grad:
                grad.copy_(send)
            return
        recv = output if dtype is None else torch.empty_like(output, dtype=dtype)
        reduce_scatter_single(recv, send, group=state.process_group)
        recv.div_(state.divide_after)
        if recv is not output:
            output.copy_(recv)

    return hook


reduce_scatter_hook = _reduce_scatter_in(None)
reduce_scatter_hook.__doc__ = "Average the gradients with one reduce-scatter in their own dtype."
fp16_compress_hook = _reduce_scatter_in(torch.float16)
fp16_compress_hook.__doc__ = "Average the gradients in fp16 (half the bytes), dividing before and after the sum."
bf16_compress_hook = _reduce_scatter_in(torch.bfloat16)
bf16_compress_hook.__doc__ = "Average the gradients in bf16 (half the bytes), dividing before and after the sum."


def register_comm_hook(model: nn.Module, state: Any, hook: Callable[[Any, torch.Tensor, torch.Tensor], None]) -> None:
    """Reduce every group's gradients with ``hook(state, grad, output)`` instead of the built-in reduce-scatter.

    ``grad`` is the group's padded gradient, rank-major (rank r's rows first for
    r = 0, 1, ...); the hook writes this rank's *averaged* rows into ``output``.
    Groups that shard nothing (``NO_SHARD``) call ``hook(state, grad)``, which
    averages the whole gradient in place (an all-reduce). FSDP1's hooks
    (``torch.distributed.algorithms._comm_hooks.default_hooks``) follow the same
    conventions, so they work too. Not supported with HSDP.
    """
    expect_module("register_comm_hook", model)
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
    for group in (g for s in states_in(model) for g in s.groups):
        if group.mesh_info.replicate_group is not None and group.mesh_info.shard_axis is not None:
            raise NotImplementedError("register_comm_hook is not supported with HSDP (2-D meshes)")
        group.reducer.settings.comm_hook = (state, hook)
