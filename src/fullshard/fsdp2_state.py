"""``fully_shard.state(module)``: FSDP2's state of a sharded module, as far as torch's pipeline schedules read it.

``torch.distributed.pipelining`` treats a stage whose module is an ``FSDPModule`` as FSDP2's: after the
micro-batches' backwards it reduces through ``fully_shard.state(stage_module)``, reading
``_state_ctx.all_states``, each state's ``_fsdp_param_groups`` (calling ``post_backward()`` on each) and the
root's ``_root_post_backward_final_callback()``. These views answer those names from fullshard's runtime
([Note: Pipeline schedules] in runtime.py); nothing else of FSDP2's internals is emulated.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from fullshard.group import ParamGroup
from fullshard.runtime import HookState, state_of


class ParamGroupView:
    """One of a state's groups, as FSDP2's ``FSDPParamGroup``."""

    def __init__(self, state: HookState, group: ParamGroup) -> None:
        self._state, self._group = state, group

    def post_backward(self) -> None:
        self._state.reduce_outside_backward(self._group)


class StateContextView:
    """What every state under one root shares, as FSDP2's ``FSDPStateContext``."""

    def __init__(self, state: HookState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[StateView]:
        ctx = self._state.ctx
        return [StateView(s) for s in ctx.states] if ctx is not None else []


class StateView:
    """A ``fully_shard`` call's state, as FSDP2's ``FSDPState``."""

    def __init__(self, state: HookState) -> None:
        self._state = state

    @property
    def _state_ctx(self) -> StateContextView:
        return StateContextView(self._state)

    @property
    def _fsdp_param_groups(self) -> list[ParamGroupView]:
        return [ParamGroupView(self._state, group) for group in self._state.groups]

    def _root_post_backward_final_callback(self) -> None:
        ctx = self._state.ctx
        if ctx is not None:
            ctx.settle_reductions()


# Bound at import, before fullshard.use_as_fsdp2() can point torch's name at fullshard's fully_shard.
_torch_state = _torch_fully_shard.state  # type: ignore[attr-defined]


def state(module: nn.Module) -> Any:
    """The view of ``module``'s ``fully_shard`` state; for a module that torch's FSDP2 sharded, torch's own state
    (torch's pipelining reaches it through this name while the names are swapped); else ``None``, as FSDP2's
    ``fully_shard.state``."""
    found = state_of(module)
    return StateView(found) if found is not None else _torch_state(module)
