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
of the exact classes in ``_ELEMENTWISE`` that holds fullshard's parameters, it
hands torch's unmodified ``step`` a stand-in object in place of ``self``: an
instance of a subclass that shares the optimizer's ``__dict__`` (what the step
sets on ``self`` stays set) and differs only in ``param_groups`` and ``state``.
Its groups read and write the real groups' hyperparameters; their ``params``
are decided when the step first reads them, after every pre-hook: aliases of the
local tensors whose ``.grad`` are the local gradients, if every parameter is
fullshard's (or a plain tensor) with its gradient and state sharded like it,
and otherwise the real parameters (the step then runs through DTensor, as it
would without this). The stand-in's ``state`` serves local tensors and writes
every new or replaced state tensor back to the real optimizer's state at once,
as a ``DTensor`` with the parameter's spec. The real optimizer's param groups
are never changed, so an exception inside the step leaves nothing to undo, and
``state_dict()``, LR schedulers and hooks that use the optimizer they are given
see it as they would without this; only ``args[0]`` in the hooks that run after
fullshard's pre-hook is the stand-in.

Anything outside what this covers takes torch's usual path: another optimizer
class or a subclass, a closure, ``differentiable``, compilation, a parameter
that is not fullshard's (fullshard's own registry of groups decides, so
parameters swapped in place by ``to_empty()`` or ``load_state_dict(assign=True)``
stay fullshard's), a parameter or state tensor sharded differently from its
parameter, a local tensor that is a tensor subclass. ``foreach`` left at None
resolves the same way on the local tensors as on the DTensors (torch counts DTensor among
the types its foreach kernels take), so the same kernels run either way.
``fullshard.optim.local_steps(False)`` turns it off. ``torch.optim.Adafactor`` and ``torch.optim.Muon``
(not elementwise: their updates span shards) get a stand-in of their own, whatever that switch says, and
fullshard runs their step: Adafactor's reductions summed across ranks ([Note: Sharded Adafactor] in
adafactor.py), Muon's matrices orthogonalised whole ([Note: Sharded Muon] in muon.py). The same hook also keeps the state of a
0-dim (replicated) parameter shaped like it, whatever loaded it (``replicate_scalar_state``). Three steps run only here: ``Rprop``
(it masks its gradient in place) and fused ``SGD`` and ``Adagrad`` (DTensor has no
sharding rule for their kernels) raise on the DTensor path, as on FSDP2's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, Partial

from fullshard import adafactor, muon
from fullshard.group import group_of

__all__ = ["local_steps", "pre_step"]

# Classes whose step is elementwise in parameter, gradient and state, with state tensors
# shaped like the parameter or 0-dim. Exact classes only: a subclass may add anything.
_ELEMENTWISE: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adadelta,
})

# State entries these classes keep as plain 0-dim tensors for every parameter (counters and schedules);
# every other tensor entry is shaped like its parameter, a 0-dim one included.
SCALAR_STATE: frozenset[str] = frozenset({"step", "mu_product", "eta", "mu"})

_enabled = True


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
    """Every parameter plain or fullshard's (at least one fullshard's), with gradient and state sharded like it."""
    owned = False
    for group in opt.param_groups:
        for p in group["params"]:
            if type(p) is not DTensor:
                if type(p) not in (torch.Tensor, torch.nn.Parameter):
                    return False
                continue
            spec = p._spec
            if group_of(p) is None or type(p._local_tensor) is not torch.Tensor:
                return False
            if any(isinstance(placement, Partial) for placement in spec.placements):
                return False
            grad = p.grad
            if grad is not None and not (type(grad) is DTensor and _matches(grad, spec)):
                return False
            state = opt.state.get(p)
            if state and not all(_matches(v, spec) for v in state.values()):
                return False
            owned = True
    return owned


def pre_step(
    opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The global optimizer step pre-hook (registered at the first ``fully_shard``): a stand-in for ``self``."""
    if "_fullshard_seen" not in opt.__dict__ and not torch.compiler.is_compiling():
        opt.__dict__["_fullshard_seen"] = True
        replicate_scalar_state(opt)
        opt.register_load_state_dict_post_hook(replicate_scalar_state)
    if torch.compiler.is_compiling() or args[0] is not opt:
        return None
    own = _OWN_STEPS.get(type(opt))
    if own is not None and _holds_fullshard_params(opt):
        return (_OwnStep(opt, *own).stand_in(), *args[1:]), kwargs
    if not _enabled or type(opt) not in _ELEMENTWISE:
        return None
    if len(args) > 1 or kwargs.get("closure") is not None:
        return None  # a closure recomputes gradients on the real parameters during the step
    if opt.defaults.get("differentiable") or any(group.get("differentiable") for group in opt.param_groups):
        return None
    if not _holds_fullshard_params(opt):
        return None  # nothing of fullshard's: leave the optimizer alone
    return (_LocalStep(opt).stand_in(), *args[1:]), kwargs


def _holds_fullshard_params(opt: torch.optim.Optimizer) -> bool:
    return any(type(p) is DTensor and group_of(p) is not None for group in opt.param_groups for p in group["params"])


def replicate_scalar_state(opt: torch.optim.Optimizer) -> None:
    """Make state entries of fullshard's 0-dim parameters that are plain 0-dim tensors, counters aside, ``Replicate``
    DTensors like their parameter, as a step through DTensor makes them. torch's distributed state-dict loading
    (``set_optimizer_state_dict``) turns every 0-dim tensor into a plain one, taking it for a counter; a step
    through DTensor then fails on it. Run at an optimizer's first step and after each of its ``load_state_dict``."""
    for group in opt.param_groups:
        for p in group["params"]:
            if type(p) is not DTensor or p.dim() != 0 or group_of(p) is None:
                continue
            state = opt.state.get(p, {})
            for key, value in state.items():
                if type(value) is torch.Tensor and value.dim() == 0 and key not in SCALAR_STATE:
                    local = value.to(p._local_tensor.device)
                    state[key] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)


class _LocalStep:
    """The stand-in for one ``step()``: the optimizer's class, attributes and hyperparameters, local tensors.

    The stand-in shares the optimizer's ``__dict__`` (what the step sets on ``self`` stays), and only its
    ``param_groups`` and ``state`` differ, through properties of a subclass. Which tensors its groups hold
    is decided at the step's first look at a group's ``params``: after every pre-hook, so gradients that a
    later hook replaced are the ones stepped. If by then the parameters cannot be served, the groups hold
    the real parameters and the step runs through DTensor as it would without this.
    """

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.params: list[list[torch.Tensor]] | None = None
        self.owners: dict[torch.Tensor, DTensor] = {}

    def stand_in(self) -> Any:
        """The object ``step()`` gets as ``self``. It refers to this ``_LocalStep`` (through its groups) and
        nothing here refers back to it, so the local tensors and gradients it served are freed as soon as the
        step returns, not at the next garbage collection."""
        stand_in: Any = object.__new__(_stand_in_class(type(self.opt)))
        stand_in._fullshard_groups = [_LocalGroup(group, i, self) for i, group in enumerate(self.opt.param_groups)]
        stand_in._fullshard_state = _LocalStates(self.opt.state, self.owners)
        stand_in.__dict__ = self.opt.__dict__
        return stand_in

    def params_of(self, index: int) -> list[torch.Tensor]:
        if self.params is None:
            groups = self.opt.param_groups
            self.params = [self._local(group["params"]) for group in groups] if _servable(self.opt) else [
                group["params"] for group in groups]
        return self.params[index]

    def _local(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        local = []
        for p in params:
            if type(p) is DTensor:
                alias = p._local_tensor.detach()  # an alias of its own: its gradient dies with it
                grad = p.grad
                if grad is not None:
                    alias.grad = cast(DTensor, grad)._local_tensor
                self.owners[alias] = p
                p = alias
            local.append(p)
        return local


class _OwnStep(_LocalStep):
    """The stand-in for one step of an optimizer whose update spans shards (``_OWN_STEPS``): at the step's first
    look at a group's ``params`` (after every pre-hook and the closure) fullshard runs the whole step, and
    torch's then finds no parameters. If the parameters cannot be served, torch's step gets the real ones and
    runs through DTensor, as on FSDP2's parameters."""

    def __init__(self, opt: torch.optim.Optimizer, servable: Callable[[torch.optim.Optimizer], bool],
                 step: Callable[[torch.optim.Optimizer], None]) -> None:
        super().__init__(opt)
        self._servable, self._step = servable, step

    def params_of(self, index: int) -> list[torch.Tensor]:
        if self.params is None:
            groups = self.opt.param_groups
            if self._servable(self.opt):
                self._step(self.opt)
                self.params = [[] for _ in groups]
            else:
                self.params = [group["params"] for group in groups]
        return self.params[index]


# torch's optimizers whose update is not elementwise, and fullshard's step for them: Adafactor's row, column
# and norm reductions summed across shards ([Note: Sharded Adafactor]); Muon's Newton-Schulz run once per whole
# matrix ([Note: Sharded Muon]), which through DTensor takes collectives per iteration and bf16 partial sums.
_OWN_STEPS: dict[type, tuple[Callable[[torch.optim.Optimizer], bool], Callable[[torch.optim.Optimizer], None]]] = {
    torch.optim.Adafactor: (adafactor.servable, adafactor.step),
    torch.optim.Muon: (muon.servable, muon.sharded_step),
}


_stand_in_classes: dict[type, type] = {}


def _stand_in_class(cls: type) -> type:
    sub = _stand_in_classes.get(cls)
    if sub is None:
        namespace = {
            "__slots__": ("_fullshard_groups", "_fullshard_state"),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "param_groups": property(lambda self: self._fullshard_groups),
            "state": property(lambda self: self._fullshard_state),
        }
        sub = _stand_in_classes[cls] = type(cls.__name__, (cls,), namespace)
    return sub


class _LocalGroup(MutableMapping):  # type: ignore[type-arg]
    """A param group of the stand-in: ``params`` as served by its ``_LocalStep``, every other key the real group's."""

    def __init__(self, real: dict[str, Any], index: int, owner: _LocalStep) -> None:
        self._real = real
        self._index = index
        self._owner = owner

    def __getitem__(self, key: str) -> Any:
        return self._owner.params_of(self._index) if key == "params" else self._real[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._real[key] = value

    def __delitem__(self, key: str) -> None:
        del self._real[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


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
        if isinstance(value, torch.Tensor) and (value.dim() > 0 or (owner.dim() == 0 and key not in SCALAR_STATE)):
            # shaped like the parameter: DTensor's dispatch would have returned it sharded like the parameter
            spec = owner._spec
            if value.dtype is not owner.dtype or not value.is_contiguous():
                value = DTensor.from_local(value, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                           stride=spec.stride)
            else:
                value = DTensor.__new__(DTensor, value, spec, requires_grad=False)
        self._real[key] = value
