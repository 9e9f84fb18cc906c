"""torch's own elementwise optimizers stepping fullshard's parameters on their local shards.

[Note: Local steps for stock optimizers]
``torch.optim.AdamW(model.parameters())`` on a sharded model runs every one of its
operations (about ten per parameter) through DTensor's dispatch: tens of
microseconds per operation and parameter, more than the whole forward and
backward runtime of fullshard on models with many small parameters. For an
optimizer whose update is elementwise (each output element depends on the same
element of the parameter, its gradient and its state, and on scalars), a
``DTensor`` whose gradient and state tensors are sharded exactly like it gives
the same numbers when the update runs on the local tensors: that is all DTensor
does with such operands.

fullshard registers one global optimizer step pre-hook (torch calls it before
every ``step()``, ahead of the optimizer's own hooks). For an optimizer of one
of the exact classes in ``_ELEMENTWISE`` whose parameters are all fullshard's
(or plain tensors), it hands torch's unmodified ``step`` a stand-in object in
place of ``self``: the same class and attributes, with param groups whose
``params`` are aliases of the local tensors (their ``.grad`` the local
gradients) and a ``state`` that serves local tensors and writes every new or
replaced state tensor back to the real optimizer's state as a ``DTensor`` with
the parameter's spec, at once. The real optimizer's param groups are never
changed, so an exception inside the step leaves nothing to undo, and its hooks,
``state_dict()`` and LR schedulers see what they would without this.

Anything outside what this covers takes torch's usual path: another optimizer
class or a subclass, a closure, ``differentiable``, compilation, a parameter or
a state tensor that is some other DTensor or sharded differently from its
parameter, a local tensor that is a tensor subclass. ``foreach`` left at None
resolves the same way on the local tensors as on the DTensors (torch counts DTensor among
the types its foreach kernels take), so the same kernels run either way.
``fullshard.optim.local_steps(False)`` turns it off.
"""

from __future__ import annotations

import collections
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["local_steps", "own"]

# Classes whose step is elementwise in parameter, gradient and state, with state tensors
# shaped like the parameter or 0-dim. Exact classes only: a subclass may add anything.
_ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adadelta,
})

# Set on fullshard's sharded parameters. An attribute rather than a registry: a tensor with a weak
# reference cannot be swapped (``torch.utils.swap_tensors``), and specs are shared with other DTensors
# through DTensor's propagation cache.
_MARK = "_fullshard_local_step"
_enabled = True
_installed = False


def own(param: torch.Tensor) -> None:
    """Mark ``param``, a sharded parameter fullshard created, as one local steps may serve."""
    global _installed
    setattr(param, _MARK, True)
    if not _installed:  # the global pre-hook, once per process
        register_optimizer_step_pre_hook(_pre_step)
        _installed = True


def local_steps(enabled: bool) -> None:
    """Turn local steps for torch's elementwise optimizers on (the default) or off."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"local_steps(enabled) takes a bool, got {type(enabled).__name__}")
    _enabled = enabled


def _matches(value: Any, spec: Any) -> bool:
    """A state value the local step can serve: not a tensor, a 0-dim plain tensor, or a DTensor sharded like its parameter."""
    if not isinstance(value, torch.Tensor):
        return True
    if type(value) is DTensor:
        return (value._spec is spec or value._spec == spec) and type(value._local_tensor) is torch.Tensor
    return type(value) is torch.Tensor and value.dim() == 0


def _servable(opt: torch.optim.Optimizer) -> bool:
    for group in opt.param_groups:
        for p in group["params"]:
            if type(p) is not DTensor:
                if type(p) not in (torch.Tensor, torch.nn.Parameter):
                    return False
                continue
            spec = p._spec
            if not getattr(p, _MARK, False) or type(p._local_tensor) is not torch.Tensor or p.dim() == 0:
                return False
            if any(isinstance(placement, Partial) for placement in spec.placements):
                return False
            grad = p.grad
            if grad is not None and not (type(grad) is DTensor and _matches(grad, spec)):
                return False
            state = opt.state.get(p)
            if state and not all(_matches(v, spec) for v in state.values()):
                return False
    return True


def _pre_step(
    opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if not _enabled or type(opt) not in _ELEMENTWISE or torch.compiler.is_compiling():
        return None
    if args[0] is not opt or len(args) > 1 or kwargs.get("closure") is not None:
        return None  # a closure recomputes gradients on the real parameters during the step
    if any(group.get("differentiable") for group in opt.param_groups) or not _servable(opt):
        return None
    stand_in = object.__new__(type(opt))
    stand_in.__dict__.update(opt.__dict__)
    owners: dict[torch.Tensor, DTensor] = {}
    groups = []
    for group in opt.param_groups:
        params = group["params"]
        local = []
        for p in params:
            if type(p) is DTensor:
                alias = p._local_tensor.detach()
                grad = p.grad
                if grad is not None:
                    alias.grad = cast(DTensor, grad)._local_tensor
                owners[alias] = p
                local.append(alias)
            else:
                local.append(p)
        # reads go through to the real group: a pre-hook of the optimizer's own that runs after this one and
        # sets the learning rate is seen
        groups.append(collections.ChainMap({"params": local}, group))
    stand_in.param_groups = groups  # type: ignore[assignment]
    stand_in.state = _LocalStates(opt.state, owners)
    return (stand_in, *args[1:]), kwargs


class _LocalStates(dict):  # type: ignore[type-arg]
    """The stand-in's ``state``: per-parameter state of the real optimizer, seen through local tensors."""

    def __init__(self, real: Any, owners: dict[torch.Tensor, DTensor]) -> None:
        super().__init__()
        self._real = real
        self._owners = owners

    def __missing__(self, key: torch.Tensor) -> Any:
        owner = self._owners.get(key)
        value = self._real[key] if owner is None else _LocalState(self._real[owner], owner)
        self[key] = value
        return value


class _LocalState(dict):  # type: ignore[type-arg]
    """One parameter's state as local tensors; a write also lands in the real state, as a DTensor."""

    def __init__(self, real: dict[str, Any], owner: DTensor) -> None:
        super().__init__((k, v._local_tensor if type(v) is DTensor else v) for k, v in real.items())
        self._real = real
        self._owner = owner

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        current = self._real.get(key)
        if type(current) is DTensor and current._local_tensor is value:
            return  # updated in place (``state["step"] += 1`` assigns the same tensor back)
        owner = self._owner
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            # shaped like the parameter: DTensor's dispatch would have returned it sharded like the parameter
            spec = owner._spec
            if value.dtype is not owner.dtype or not value.is_contiguous():
                value = DTensor.from_local(value, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                           stride=spec.stride)
            else:
                value = DTensor.__new__(DTensor, value, spec, requires_grad=False)
        self._real[key] = value
