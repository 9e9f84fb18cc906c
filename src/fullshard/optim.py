"""Optimizers that step the local shards of a sharded model, without DTensor dispatch per operation.

``fullshard.optim.Adam``, ``AdamW`` and ``SGD`` are subclasses of torch's, with
the same arguments, param groups, state and ``state_dict()`` layout (state
tensors are ``DTensor``s sharded like their parameters, so
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, DCP checkpoints and
torch's own optimizers interchange with them). Only ``step()`` differs: it
hands the *local* tensors of parameters, gradients and state to torch's
functional implementation, with ``foreach`` kernels unless ``foreach=False``
is given, or with torch's fused kernel (Adam, AdamW) when ``fused=True`` is:
on CPU (CPU training, CPU offload) it is several times faster than foreach.
The arithmetic is torch's own, so results equal torch's optimizer with the
same options stepping the ``DTensor``s; what goes away is the dispatch of every
elementwise operation through ``DTensor`` (tens of microseconds per operation
and parameter). Plain (unsharded) parameters work too. ``capturable`` and
``differentiable`` fall back to torch's ``step()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

from fullshard.group import group_of
from fullshard.local_step import local_steps
from fullshard.param import FLAT_GRAD, FlatGrad, own_storage_view

__all__ = ["SGD", "Adam", "AdamW", "Muon", "local_steps"]


def _local(t: torch.Tensor) -> torch.Tensor:
    # `_local_tensor` is the DTensor's local tensor itself: `to_local()` adds an autograd node per call.
    return t._local_tensor if isinstance(t, DTensor) else t


def _torch_steps(group: dict[str, Any]) -> bool:
    """Options whose step stays torch's."""
    return bool(group.get("capturable") or group.get("differentiable"))


def _foreach(group: dict[str, Any]) -> bool:
    foreach = group.get("foreach")
    if foreach is None:  # as torch's default: a Tensor lr (without capturable) takes the per-tensor loop
        return not isinstance(group["lr"], torch.Tensor)
    return bool(foreach)


class _LocalAdamStep:
    """``step()`` of Adam / AdamW over local shards."""

    state: Any
    param_groups: list[dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if any(_torch_steps(g) for g in self.param_groups):
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in with_grad):
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            # Flat steps with foreach kernels only: torch's fused CPU kernel rounds elements differently
            # where its vector/scalar boundaries move (a flat buffer is one long tensor), by up to ~1e-6.
            runs, per_tensor = flat_runs(with_grad) if _foreach(group) and not group.get("fused") else ([], with_grad)
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            shared_steps: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            keys = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] if group["amsgrad"] else ["exp_avg", "exp_avg_sq"]
            for owner, flat_param, flat_grad in runs:
                flats = self._flat_state(owner, flat_param, keys)
                states = [self.state[sp.sharded] for sp in owner.params]
                for state in states:
                    if "step" not in state:
                        state["step"] = self._new_step(group, owner.params[0].sharded)
                # Parameters step flat in spans of equal step counts: one span unless some parameter missed
                # a step (no gradient then) or its state was loaded from elsewhere ([Note: Flat optimizer steps]).
                values = [float(state["step"]) for state in states]
                if values.count(values[0]) == len(values):
                    cuts: list[tuple[int, int, slice | None]] = [(0, len(states), None)]  # the whole flat buffers
                else:
                    ends = (*owner.layout.shard_offsets, flat_param.numel())
                    cuts = [(start, stop, slice(ends[start], ends[stop])) for start, stop in equal_step_spans(values)]
                for start, stop, cut in cuts:
                    params.append(flat_param if cut is None else flat_param[cut])
                    grads.append(flat_grad if cut is None else flat_grad[cut])
                    exp_avgs.append(flats["exp_avg"] if cut is None else flats["exp_avg"][cut])
                    exp_avg_sqs.append(flats["exp_avg_sq"] if cut is None else flats["exp_avg_sq"][cut])
                    if group["amsgrad"]:
                        max_exp_avg_sqs.append(flats["max_exp_avg_sq"] if cut is None else flats["max_exp_avg_sq"][cut])
                    steps.append(states[start]["step"])
                    for state in states[start + 1 : stop]:  # the span's step counters follow its first
                        shared_steps[0].append(state["step"])
                        shared_steps[1].append(states[start]["step"])
            for p in per_tensor:
                assert p.grad is not None
                state = self.state[p]
                if not state:
                    state["step"] = self._new_step(group, p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(_local(p))
                grads.append(_local(p.grad))
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
            if params:
                _adam_update(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if shared_steps[0]:
                torch._foreach_copy_(*shared_steps)
        return loss

    def _new_step(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        # As torch: a CPU scalar (fused: on the parameter's device), float64 only under a float64 default.
        double = torch.get_default_dtype() == torch.float64 and not group.get("fused")
        return torch.tensor(0.0, dtype=torch.float64 if double else torch.float32,
                            device=_local(p).device if group.get("fused") else "cpu")

    def _flat_state(self, owner: Any, flat_param: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
        """The group's flat state buffers; each parameter's state entries are DTensor views of them.

        Made on the first step, and again when a state entry is no longer the view made here
        (``load_state_dict`` put new tensors there) or the group's parameters changed (a tie taken over
        between steps): their values are copied in first.
        """
        cache: dict[int, Any] = self.__dict__.setdefault("_flat_buffers", {})
        entry = cache.get(id(owner))
        if entry is not None and entry[0]() is owner and entry[1].keys() == set(keys) and len(entry[2]) == len(owner.params) \
                and entry[1][keys[0]].numel() == flat_param.numel() and all(
            self.state[sp.sharded].get(key) is view for sp, views in zip(owner.params, entry[2]) for key, view in views.items()
        ):
            return dict(entry[1])
        flats = {key: torch.zeros_like(flat_param) for key in keys}
        made = []
        for sp, chunk in zip(owner.params, owner.chunks(flat_param)):
            state = self.state[sp.sharded]
            offset = chunk.storage_offset() - flat_param.storage_offset()
            views = {}
            for key in keys:
                rows = sp.local_rows(flats[key].narrow(0, offset, chunk.numel()))
                if key in state:
                    rows.copy_(_local(state[key]))
                state[key] = views[key] = sp.as_dtensor_of(own_storage_view(rows))
            made.append(views)
        cache[id(owner)] = (weakref.ref(owner), flats, made)
        return flats


# [Note: Flat optimizer steps]
# A fullshard group keeps its shards in one flat buffer, and the reduce-scatter
# delivers its gradients as views of one flat buffer laid out alike (padding zero).
# When every parameter of a group is in one param group and has such a gradient, Adam
# (and AdamW) with foreach kernels steps the whole flat buffer as one tensor - one
# kernel per group instead of one per parameter - with its state in flat buffers too; each
# parameter's state entries are DTensor views of those (the state_dict() layout is
# unchanged). Padding stays zero (zero gradient, zero moments). All flat buffers and the
# per-parameter rest of a param group go into one foreach call.
# Each parameter keeps its own step count, which Adam's bias correction reads. The counts
# part when a parameter gets no gradient in some step (it is left out of that step, as
# torch leaves it out) or when state with several counts is loaded (torch's AdamW after
# such steps). A flat buffer is therefore stepped in spans of consecutive parameters with
# equal counts, each span a slice of the flat buffers with the first member's step tensor
# (copied to the others afterwards); in the common case the one span is the whole buffer.
# Reading the counts costs one float() of a CPU scalar per parameter (~0.2 us).
# Finding the runs is cheap: the reduce-scatter marks each gradient it creates with one
# FlatGrad per delivery (the flat buffer, the group weakly), so a group qualifies when all
# its parameters' gradients carry the same mark - an attribute lookup per parameter. The
# mark lives on the gradient object: a gradient replaced by another tensor loses it, one
# changed in place or accumulated into keeps it (still a view of the buffer), and
# torch.utils.swap_tensors (module.to() on DTensor parameters) exchanges __dict__ with the
# data, so the mark stays with the delivered data. Gradients placed by other means are
# still taken when their addresses show they sit in one buffer laid out as the flat shard.
# Anything else (a parameter without a gradient, parameters of several dtypes, extensions)
# takes the per-tensor path; the arithmetic is the same elementwise either way.


def flat_runs(params: list[torch.Tensor]) -> tuple[list[tuple[Any, torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Split ``params`` into whole fullshard groups steppable flat (group, flat params, flat grads) and the rest."""
    marked: dict[int, tuple[FlatGrad, list[torch.Tensor]]] = {}
    unmarked: list[torch.Tensor] = []
    for p in params:
        mark = getattr(p.grad, FLAT_GRAD, None)
        if not isinstance(mark, FlatGrad):
            unmarked.append(p)
        else:
            marked.setdefault(id(mark), (mark, []))[1].append(p)
    runs, rest = [], []
    for mark, members in marked.values():
        owner = mark.group()
        # The reduce-scatter marked these gradients fresh; they are still every parameter's of the group.
        if owner is not None and len(members) == len(owner.params) and owner.sharded_ids.issuperset(map(id, members)) \
                and mark.flat.numel() == owner.flat_shard.numel():
            runs.append((owner, owner.flat_shard, mark.flat))
        else:
            unmarked.extend(members)
    # Gradients placed by other means may still be views of one buffer laid out as the flat shard.
    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in unmarked:
        owner = group_of(p) if isinstance(p, DTensor) else None
        if owner is None:
            rest.append(p)
        else:
            by_group.setdefault(id(owner), (owner, []))[1].append(p)
    for owner, members in by_group.values():
        flat = _flat_views(owner, members)
        if flat is None:
            rest.extend(members)
        else:
            runs.append((owner, *flat))
    return runs, rest


def equal_step_spans(steps: list[float]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each longest span of consecutive equal ``steps``, in order.

    ``[3, 3, 2, 2, 3]`` gives ``[(0, 2), (2, 4), (4, 5)]``; equal steps give one span.
    """
    spans, start = [], 0
    for i in range(1, len(steps)):
        if steps[i] != steps[start]:
            spans.append((start, i))
            start = i
    spans.append((start, len(steps)))
    return spans


def _flat_views(owner: Any, members: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if len(members) != len(owner.params) or not owner.flat_steppable:
        return None
    flat = owner.flat_shard
    # Each gradient must sit where its parameter sits in the flat shard, in one buffer: the address its
    # parameter's offset implies for the buffer's start is the same for all (checked against one storage below).
    dtype, size, base = flat.dtype, flat.element_size(), None
    buffer_start = flat.untyped_storage().data_ptr()
    for sp in owner.params:
        grad = sp.sharded.grad
        if not isinstance(grad, DTensor):
            return None
        local, param = grad._local_tensor, sp.sharded._local_tensor
        if local.dtype != dtype or local.stride() != param.stride():
            return None
        if param.numel() == 0:
            continue  # no rows here: nothing to place (an empty local tensor owns no memory of the buffer)
        implied = local.data_ptr() - (param.data_ptr() - buffer_start)  # the parameter's byte offset in the buffer
        if base is None:
            base = implied
        elif implied != base:
            return None
    if base is None:
        return None
    first = owner.params[0].sharded.grad._local_tensor
    storage = first.untyped_storage()
    start = flat.storage_offset() * size + base - storage.data_ptr()
    if first.device != flat.device or start < 0 or start % size or start + flat.numel() * size > storage.nbytes():
        return None  # the buffer would leave the first gradient's storage: they are not all in one
    return flat, torch.as_strided(first, (flat.numel(),), (1,), start // size)


def _adam_update(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor]) -> None:
    beta1, beta2 = group["betas"]
    fused = bool(group.get("fused"))
    _adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        foreach=_foreach(group) and not fused, fused=fused or None,
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        has_complex=any(p.is_complex() for p in params),  # (steps their real views: local tensors, not DTensors)
    )


class Adam(_LocalAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` stepping local shards (see the module docstring)."""


class AdamW(_LocalAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` stepping local shards (see the module docstring)."""


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` stepping local shards (see the module docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if any(_torch_steps(g) for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p.grad.is_sparse for p in with_grad):
                return super().step(closure)
            buffers = [self.state[p].get("momentum_buffer") for p in with_grad]
            local_buffers: list[torch.Tensor | None] = [None if b is None else _local(b) for b in buffers]
            _sgd(
                [_local(p) for p in with_grad], [_local(p.grad) for p in with_grad], local_buffers,
                foreach=_foreach(group), weight_decay=group["weight_decay"], momentum=group["momentum"],
                lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            )
            if group["momentum"] != 0:
                for p, before, local in zip(with_grad, buffers, local_buffers, strict=True):
                    if before is None and local is not None:  # created by this step: keep it sharded like p
                        self.state[p]["momentum_buffer"] = _like(p, local)
        return loss


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor sharded like ``p``."""
    if not isinstance(p, DTensor):
        return local
    return DTensor(local, p._spec, requires_grad=False)  # same shape, stride, dtype; `local` stays on its device


from fullshard.muon import Muon  # noqa: E402  (re-exported: fullshard.optim.Muon)
