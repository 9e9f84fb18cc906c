"""Model and optimizer state dicts: sharded DTensors by default, full (FQN-keyed) on request.

[Note: State dict hooks]
``model.state_dict()`` always holds the sharded ``DTensor`` parameters; a group
unsharded between steps (e.g. the root after forward) is resharded first, as
FSDP2 does, so that ``named_parameters()`` matches the optimizer's parameters
for torch's ``get_state_dict(model, optim)``. ``load_state_dict``
accepts, per parameter, a ``DTensor`` of any placement or the full tensor:
before loading, the group is resharded, a DTensor the user assigned in place
of a sharded parameter is taken over (the values load into the assigned
object) and every value is turned into this rank's shard; after loading, a
parameter that ``assign=True`` replaced is copied back into the flat shard
buffer and the original parameter object is registered again, so optimizers
keep pointing at the live parameters.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import OptimStateKeyType
from torch.distributed.tensor import DTensor

from fullshard.errors import expect_bool, expect_module, expect_optimizer
from fullshard.group import ParamGroup, ShardedState, group_of
from fullshard.local_step import SCALAR_STATE
from fullshard.param import ShardedParam, full_tensor
from fullshard.runtime import TrainingState, states_in, take_over_changes


def register_state_dict_hooks(group: ParamGroup, members: tuple[nn.Module, ...]) -> None:
    """Register the hooks of [Note: State dict hooks] on every module holding a parameter of ``group``.

    ``members``: the modules of the group's ``fully_shard`` call. The hooks look up the group's
    parameters when they run: a tied parameter taken over by an enclosing group later is then
    handled by that group's hooks. ``group.on_new_sites`` hooks the modules that start holding one
    of its parameters later (a tie made after ``fully_shard``), each module once.
    """
    hooked: set[nn.Module] = set()

    def hook_modules(modules: list[nn.Module]) -> None:
        for module in modules:
            if module in hooked:
                continue
            hooked.add(module)
            entries = functools.partial(_entries, group, module)
            handle = module.register_state_dict_post_hook(_only_on(module, _sharded_values(group, entries)))
            # First of the module's hooks: one registered before fully_shard sees (and may change) the sharded values.
            cast(OrderedDict, module._state_dict_hooks).move_to_end(handle.id, last=False)
            module.register_load_state_dict_pre_hook(_only_on(module, _to_local_shards(group, members[0], entries)))
            module.register_load_state_dict_post_hook(
                _only_on(module, _take_assigned(group, entries, members if module in members else None)))

    group.on_new_sites = hook_modules
    hook_modules(list({site.module: None for p in group.params for site in p.sites} | dict.fromkeys(members)))
    members[0].register_state_dict_pre_hook(_only_on(members[0], _sharded_first(group, members[0])))


def _only_on(owner: nn.Module, hook: Callable[..., None]) -> Callable[..., None]:
    """``hook``, run only for ``owner``: ``copy.deepcopy`` of a plain submodule of a sharded model copies its hooks
    too, and the copy (a plain module of ``DTensor`` copies, as on FSDP2) must not load into, reshard or read the
    live group."""
    def guarded(module: nn.Module, *args: Any) -> None:
        if module is owner:
            hook(module, *args)

    return guarded


def _sharded_first(group: ParamGroup, member: nn.Module):  # type: ignore[no-untyped-def]
    """Before any value is collected (on the group's first module, which ``state_dict()`` reaches before the others):
    take over what was assigned since, so that no entry is a tensor that resharding frees (a tie to a group left
    unsharded by a forward without backward); then a group unsharded between steps (the root after a forward not
    back-propagated yet) registers its sharded parameters, as FSDP2's ``state_dict()`` does: ``named_parameters()``
    then gives what the optimizer holds (``get_state_dict(model, optim)`` pairs the two by name), and a backward that
    follows all-gathers again. Not inside a forward or backward, nor in ``summon_full_params``."""
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        states = states_in(member, recurse=False)
        try:
            take_over_changes(states)
        except ValueError:
            return  # a plain tensor was assigned: the state dict holds it, as FSDP2's; the next forward raises
        if group.state is ShardedState.SHARDED or group.summoned:
            return
        if all(s.training_state is TrainingState.IDLE for s in states):
            group.reshard()

    return hook


def _entries(group: ParamGroup, module: nn.Module) -> list[tuple[str, ShardedParam]]:
    return [(site.name, p) for p in group.params for site in p.sites if site.module is module]


def _sharded_values(group: ParamGroup, entries: Callable[[], list[tuple[str, ShardedParam]]]):  # type: ignore[no-untyped-def]
    """The sharded parameters (also where a group is unsharded), their local tensors starting a storage of
    their own ([Note: Own-storage views]). ``keep_vars=True`` gives the sharded parameter itself (also where
    the unsharded one is registered), and a tensor the user assigned after ``fully_shard`` (taken over at the next
    forward) stays what it is."""
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, p in entries():
            key = prefix + name
            registered = module._parameters.get(name)
            if key not in state_dict or (registered is not p.sharded and registered is not p.unsharded
                                         and not group.summoned):  # summon_full_params' CPU copies are not the user's
                continue
            if state_dict[key] is p.unsharded:  # keep_vars=True while unsharded: the parameter, as when sharded
                state_dict[key] = p.sharded
            elif state_dict[key] is not p.sharded:
                state_dict[key] = p.state_dict_value()

    return hook


def _to_local_shards(group: ParamGroup, member: nn.Module, entries: Callable[[], list[tuple[str, ShardedParam]]]):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        take_over_changes(states_in(member, recurse=False))  # before the reshard registers over an assignment
        group.reshard()
        group.streams.shards_written()  # the load writes into the flat shard buffer on the compute stream
        if group.adopt_reassigned():  # the values load into the assigned objects (an optimizer may hold them)
            group.stale = True
        for name, p in entries():
            key = prefix + name
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, DTensor) and value.placements == p.sharded.placements:
                continue
            if tuple(value.shape) != p.shape:
                continue  # load_state_dict reports the size mismatch itself
            full = full_tensor(value) if isinstance(value, DTensor) else value
            device = p.sharded.to_local().device
            local = p.local_part(full).to(device=group.shard_device if device.type == "meta" else device)
            state_dict[key] = p.as_dtensor_of(local)

    return hook


def _take_assigned(  # type: ignore[no-untyped-def]
    group: ParamGroup, entries: Callable[[], list[tuple[str, ShardedParam]]], members: tuple[nn.Module, ...] | None
):
    """``load_state_dict(assign=True)`` registered new tensors: the sharded parameters (same objects) take them
    over, and once every member module of the group has loaded, the group is linked ([Note: Converting a group])."""
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        for name, p in entries():
            registered = module._parameters.get(name)
            if registered is None or registered is p.sharded or registered is p.unsharded:
                continue
            if group_of(registered) is not None:
                continue  # another group's sharded parameter: a tie made after fully_shard, taken at lazy init
            group.take_over(p, registered)
        if members is not None and group.stale:
            group.member_converted(module, members)

    return hook


# ---- full state dicts -----------------------------------------------------------------------------


def _gather(value: Any, cpu_offload: bool) -> Any:
    """A full copy of ``value``: never an alias of live state (an optimizer's ``step`` is updated in place)."""
    if isinstance(value, DTensor):
        value = full_tensor(value)
    elif isinstance(value, torch.Tensor):
        value = value.detach().clone()
    if isinstance(value, torch.Tensor) and cpu_offload:
        value = value.cpu()
    return value


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's state as full tensors keyed by FQN: ``{}`` on ranks other than 0 when ``rank0_only``.

    Collective: every rank must call it (each parameter is all-gathered in turn).
    """
    expect_module("full_state_dict", model)
    expect_bool("full_state_dict", "rank0_only", rank0_only)
    expect_bool("full_state_dict", "cpu_offload", cpu_offload)
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        gathered = _gather(value, cpu_offload)
        if keep:
            out[key] = gathered
    return out


def _param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: name for name, p in model.named_parameters()}


def _optim_params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optim.param_groups for p in group["params"]]


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool = True) -> dict[str, Any]:
    """``optim.state_dict()`` with full tensors and parameter FQNs in place of ids.

    Tensor states shaped like their parameter are gathered to full shape;
    other tensors (e.g. a 0-dim ``step``) and non-tensor states are carried as
    they are. ``{}`` on ranks other than 0 when ``rank0_only``. Collective.
    """
    expect_module("full_optim_state_dict", model)
    expect_optimizer("full_optim_state_dict", optim)
    expect_bool("full_optim_state_dict", "rank0_only", rank0_only)
    names = _param_names(model)
    params = _optim_params(optim)
    osd = optim.state_dict()
    keep = not rank0_only or dist.get_rank() == 0
    state: dict[str, dict[str, Any]] = {}
    for index, param in enumerate(params):
        param_state = osd["state"].get(index)
        if param_state is None:
            continue
        gathered = {k: _gather(v, cpu_offload=True) for k, v in param_state.items()}
        if keep:
            state[names[param]] = gathered
    if not keep:
        return {}
    groups = []
    for group in osd["param_groups"]:
        groups.append({**group, "params": [names[params[i]] for i in group["params"]]})
    return {"state": state, "param_groups": groups}


def load_full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, full_osd: dict[str, Any] | None) -> None:
    """Load a state from :func:`full_optim_state_dict` into ``optim``, keeping only this rank's shards.

    ``full_osd`` may be given on every rank, or on rank 0 only (``None`` elsewhere): rank 0 then
    broadcasts the structure once and each full tensor in turn. Collective.
    """
    expect_module("load_full_optim_state_dict", model)
    expect_optimizer("load_full_optim_state_dict", optim)
    if full_osd is not None and not (isinstance(full_osd, Mapping) and "state" in full_osd and "param_groups" in full_osd):
        raise TypeError("load_full_optim_state_dict: full_osd must be a dict from full_optim_state_dict (with 'state' "
                        f"and 'param_groups'), or None on ranks other than 0; got {type(full_osd).__name__}")
    names = _param_names(model)
    params = _optim_params(optim)
    by_name = {names[p]: p for p in params}
    managed: dict[torch.Tensor, ShardedParam] = {
        p.sharded: p for state in states_in(model) for group in state.groups for p in group.params
    }
    full_osd = _broadcast_from_rank0(full_osd, device=_comm_device())
    unknown = sorted(set(full_osd["state"]) - set(by_name))
    if unknown:
        raise ValueError(f"optimizer state names parameters this optimizer does not have: {unknown}")
    position = {name: i for i, name in enumerate(names[p] for p in params)}
    state: dict[int, dict[str, Any]] = {}
    for name, param_state in full_osd["state"].items():
        param = by_name[name]
        state[position[name]] = {k: _shard_like(managed.get(param), k, v) for k, v in param_state.items()}
    saved_groups = full_osd["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"load_full_optim_state_dict: the state has {len(saved_groups)} param groups, the optimizer "
                         f"{len(optim.param_groups)}")
    # torch's load_state_dict pairs a group's saved ids with its parameters by position: list them in the
    # optimizer's own order, whatever order the state was saved in.
    groups = []
    for i, (saved, current) in enumerate(zip(saved_groups, optim.param_groups)):
        current_names = [names[p] for p in current["params"]]
        if sorted(saved["params"]) != sorted(current_names):
            raise ValueError(f"load_full_optim_state_dict: param group {i} holds {sorted(saved['params'])} in the "
                             f"state and {sorted(current_names)} in the optimizer")
        groups.append({**saved, "params": [position[n] for n in current_names]})
    optim.load_state_dict({"state": state, "param_groups": groups})


def _shard_like(sharded: ShardedParam | None, key: str, value: Any) -> Any:
    """A full tensor shaped like a sharded parameter becomes a DTensor sharded like it; other tensors (a counter,
    also beside a 0-dim parameter) are copied."""
    if not isinstance(value, torch.Tensor):
        return value
    if sharded is None or tuple(value.shape) != sharded.shape or (not sharded.shape and key in SCALAR_STATE):
        return value.detach().clone()
    local = sharded.local_part(value).to(device=sharded.sharded.to_local().device)
    return sharded.as_dtensor_of(local.clone())


def _comm_device() -> torch.device:
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_from_rank0(full_osd: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """Every rank's copy of a state given on rank 0 (or on all ranks): structure by pickling, tensors by broadcast."""
    have = torch.tensor([full_osd is not None], dtype=torch.int32, device=device)
    dist.all_reduce(have)
    if int(have.item()) == dist.get_world_size():
        assert full_osd is not None
        return full_osd
    skeleton: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if dist.get_rank() == 0:
        if full_osd is None:
            raise ValueError("load_full_optim_state_dict: rank 0 must be given the full optimizer state dict")
        skeleton[0] = _strip_tensors(full_osd, tensors)
    dist.broadcast_object_list(skeleton, src=0)
    return _fill_tensors(skeleton[0], tensors, device)


class _TensorSlot:
    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def _strip_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        return {k: _strip_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_strip_tensors(v, tensors) for v in tree]
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _TensorSlot(tree.shape, tree.dtype)
    return copy.copy(tree)


def _fill_tensors(tree: Any, tensors: list[torch.Tensor], device: torch.device) -> Any:
    source = iter(tensors)

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if isinstance(node, _TensorSlot):
            buf = next(source).to(device) if dist.get_rank() == 0 else torch.empty(node.shape, dtype=node.dtype, device=device)
            dist.broadcast(buf, src=0)
            return buf.cpu()
        return node

    return fill(tree)


def rekey_optim_state_dict(
    osd: dict[str, Any], model: nn.Module, key_type: OptimStateKeyType, optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Convert an optimizer state dict between parameter ids (positions) and parameter names (FQNs).

    Ids are positions in ``optim``'s parameter order when ``optim`` is given,
    else in ``model.parameters()`` order: the order ``torch.optim`` uses for an
    optimizer built on ``model.parameters()``.
    """
    if not isinstance(key_type, OptimStateKeyType):
        raise TypeError(f"key_type must be an OptimStateKeyType, got {key_type!r}")
    expect_module("rekey_optim_state_dict", model)
    if optim is not None:
        expect_optimizer("rekey_optim_state_dict", optim)
    if not (isinstance(osd, Mapping) and "state" in osd and "param_groups" in osd):
        raise TypeError("rekey_optim_state_dict: osd must be an optimizer state dict (with 'state' and "
                        f"'param_groups'), got {type(osd).__name__}")
    names = _param_names(model)
    order = _optim_params(optim) if optim is not None else list(model.parameters())
    id_to_name = {i: names[p] for i, p in enumerate(order)}
    if key_type is OptimStateKeyType.PARAM_NAME:
        mapping: dict[Any, Any] = id_to_name
    else:
        mapping = {name: i for i, name in id_to_name.items()}
    try:
        return {
            **osd,
            "state": {mapping[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [mapping[k] for k in g["params"]]} for g in osd["param_groups"]],
        }
    except KeyError as err:
        expected = "id" if key_type is OptimStateKeyType.PARAM_NAME else "name"
        raise ValueError(
            f"optimizer state key {err.args[0]!r} is not a parameter {expected} of this model; "
            "is the state dict already keyed that way?"
        ) from None
