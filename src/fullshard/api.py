"""``fully_shard`` and ``FSDPModule``: the drop-in surface of ``torch.distributed.fsdp``."""

from __future__ import annotations

import functools
import logging
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, NoReturn, cast, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fullshard import fsdp2_state, local_step, replaced
from fullshard.codec import QuantizedCommPolicy, make_codecs, validate_comm_policy
from fullshard.collectives import CommStreams, ProcessGroupAllGather, ProcessGroupReduceScatter
from fullshard.errors import (
    AlreadyShardedError,
    ArgumentTypeError,
    EmptyModulesError,
    OverlappingMeshError,
    ShardedElsewhereError,
    UnsupportedError,
    UsageError,
    expect_bool,
    expect_divisor,
)
from fullshard.group import ParamGroup, ShardedState, group_of
from fullshard.layout import ParamLayout
from fullshard.mesh import MeshInfo, SpmdMesh, concatenate_meshes, mesh_device, post_forward_group, resolve_mesh
from fullshard.param import ParamSite, ShardedParam, TensorParallel, claimant_of
from fullshard.policy import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    validate_mp_policy,
    validate_offload_policy,
)
from fullshard.reduce import ReduceSettings
from fullshard.runtime import (
    HookState,
    hook_unused_submodules,
    reshard_before_step,
    state_of,
    states_in,
    take_over_changes,
)
from fullshard.state_dict import register_state_dict_hooks

log = logging.getLogger("fullshard")
_fsdp2_log = logging.getLogger("torch.distributed.fsdp.fully_shard")
_warned_int_one: list[bool] = []

_ShardPlacementFn = Callable[[nn.Parameter], Shard | None]
_optimizer_hooks_installed = False


def _install_optimizer_hooks() -> None:
    """Once per process, at the first ``fully_shard``: an optimizer still holding parameters that ``fully_shard``
    replaced raises, groups left unsharded register their sharded parameters, and torch's elementwise optimizers
    step fullshard's parameters on their local shards."""
    global _optimizer_hooks_installed
    if not _optimizer_hooks_installed:
        register_optimizer_step_pre_hook(replaced.refuse_replaced)
        register_optimizer_step_pre_hook(local_step.pre_step)
        register_optimizer_step_pre_hook(reshard_before_step)
        _optimizer_hooks_installed = True


@overload
def fully_shard(
    module: nn.Module, *, mesh: DeviceMesh | None = ..., reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ..., dp_mesh_dims: object | None = ...,
    comm_policy: QuantizedCommPolicy | None = ...,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module], *, mesh: DeviceMesh | None = ..., reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _ShardPlacementFn | None = ..., mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ..., ignored_params: set[nn.Parameter] | None = ..., dp_mesh_dims: object | None = ...,
    comm_policy: QuantizedCommPolicy | None = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: _ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: object | None = None,
    comm_policy: QuantizedCommPolicy | None = None,
) -> Any:
    """Shard ``module``'s parameters over ``mesh`` and unshard them around its forward and backward.

    The parameters of ``module`` (or of every module in a list) that no earlier
    ``fully_shard`` call on a submodule took form one group: all-gathered in one
    collective before the module runs, reduce-scattered in one collective after
    its backward. Call it bottom-up (blocks first, root last). Each parameter
    becomes a ``DTensor`` with a ``Shard(0)`` placement (or the one
    ``shard_placement_fn`` returns) whose local tensor is a view into the group's
    flat shard buffer; a 0-dim parameter, which torch's FSDP2 refuses, becomes a
    ``Replicate`` DTensor, whole on every rank. The module's class becomes a subclass of
    :class:`FSDPModule`; the same module object is returned.

    - ``mesh``: 1-D shards over all its ranks; 2-D (with ``mesh_dim_names``) is
      ``(replicate, shard)``, i.e. HSDP; ``None`` is a 1-D mesh over the default
      process group. ``dp_mesh_dims`` names the axes instead (replicate only: DDP).
    - ``reshard_after_forward``: ``True`` frees the unsharded parameters after
      forward and all-gathers them again in backward; ``False`` keeps them;
      ``None`` means ``False`` for the root and ``True`` otherwise; an int ``k``
      keeps a 1/k copy so backward all-gathers within ``k`` ranks.
    - ``mp_policy`` / ``offload_policy``: see :class:`MixedPrecisionPolicy` and
      :class:`CPUOffloadPolicy`.
    - ``ignored_params``: left alone (not sharded, not reduced).
    - ``comm_policy``: :class:`QuantizedCommPolicy` all-gathers weights as block-quantized
      int8 and reduce-scatters gradients in bf16 (not in FSDP2).
    """
    return shard_modules(
        module, lambda: resolve_mesh(mesh, dp_mesh_dims), reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn, mp_policy=mp_policy, offload_policy=offload_policy,
        ignored_params=ignored_params, comm_policy=comm_policy,
    )


fully_shard.state = fsdp2_state.state  # type: ignore[attr-defined]  # torch's pipelining reads it (see there)


def shard_modules(
    module: nn.Module | list[nn.Module],
    mesh_info_of: Callable[[], MeshInfo],
    *,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: _ShardPlacementFn | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    comm_policy: QuantizedCommPolicy | None,
) -> Any:
    """:func:`fully_shard` over the mesh ``mesh_info_of()`` gives, called once the other arguments are checked
    (``shard_model``'s NO_SHARD replicates plain parameters, which ``dp_mesh_dims`` takes as DTensors only)."""
    modules = _validate_modules(module)
    if not isinstance(reshard_after_forward, (bool, int, type(None))):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to reshard to, not "
            f"{reshard_after_forward} (a bool, an int or None: got {type(reshard_after_forward).__name__})"
        )
    mp_policy = validate_mp_policy(mp_policy)
    comm_policy = validate_comm_policy(comm_policy)
    reduce_dtype = mp_policy.reduce_dtype
    if comm_policy is not None:
        if reduce_dtype is not None and reduce_dtype != comm_policy.reduce_dtype:
            raise ValueError(
                f"mp_policy.reduce_dtype={reduce_dtype} and comm_policy.reduce_dtype={comm_policy.reduce_dtype} disagree"
            )
        reduce_dtype = comm_policy.reduce_dtype
    offload_policy = validate_offload_policy(offload_policy)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {type(shard_placement_fn).__name__}")
    if ignored_params is not None and (
        not isinstance(ignored_params, set | frozenset | list | tuple)
        or not all(isinstance(p, torch.Tensor) for p in ignored_params)
    ):
        raise TypeError(f"ignored_params must be a set of parameters, got {type(ignored_params).__name__}")
    mesh_info = mesh_info_of()
    _install_optimizer_hooks()
    device = mesh_device(mesh_info.mesh)
    reshard_arg = reshard_after_forward
    reshard_after_forward, post_forward_size = _resolve_reshard_after_forward(reshard_arg, mesh_info)

    managed = _managed_modules(modules)
    below = _params_of_groups_below(modules)
    below_sharded = {id(sp.sharded): sp for sp in below}
    ignored = set(ignored_params or ())
    sites: dict[torch.Tensor, list[ParamSite]] = {}
    fqns: dict[torch.Tensor, str] = {}
    ties: dict[torch.Tensor, ShardedParam] = {}  # source -> the tie's first claimant, in a group below
    for prefix, mod in managed:
        for name, param in mod.named_parameters(recurse=False):
            if param in ignored:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            tied = _tied_to(param, below, below_sharded)
            if tied is None and isinstance(param, DTensor) and (owner := group_of(param)) is not None:
                if not _encloses(owner, modules):  # a module shared with a sibling call: see the Note
                    continue
                raise ShardedElsewhereError(
                    f"parameter {fqn!r} is already sharded by the fully_shard call on {owner.label!r}, which "
                    "encloses this call: apply fully_shard to submodules before their parents"
                )
            source = param if tied is None else tied.sharded
            if tied is not None:
                ties[source] = tied
            if source not in sites:
                fqns[source] = fqn
                sites[source] = []
            sites[source].append(ParamSite(mod, name))
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf.device != device and buf.device.type != "meta":
                mod._buffers[buf_name] = buf.to(device)
    shared_modules = _shared_beyond_owner(modules, below)
    _check_shared_precision(shared_modules, mp_policy)
    for first in [*_ties_among(below), *shared_modules]:  # modules below sharing a parameter
        ties.setdefault(first.sharded, first)
        fqns.setdefault(first.sharded, first.fqn)
        sites.setdefault(first.sharded, [])
    members = {source: [first, *_tied_with(first, below)] for source, first in ties.items()}
    for tied_source, sharing in members.items():
        for sp in sharing:
            sites[tied_source].extend(site for site in sp.sites if site not in sites[tied_source])

    params = list(sites)
    tp_params = {p for p in params if _is_tensor_parallel(p, ties)}
    # (placements first: a parameter put on a mesh it cannot go on is refused as such, not for what that implies)
    other_meshes: dict[tuple[Any, ...], MeshInfo] = {}
    placed = {p: _placement(p, fqns[p], shard_placement_fn, mesh_info, device, other_meshes) for p in params}
    infos = {p: info for p, (_, info) in placed.items()}
    layouts = {p: _layout(p, fqns[p], placement, infos[p], p in tp_params) for p, (placement, _) in placed.items()}
    _check_params([p for p in params if p not in ties], fqns, device, infos)
    tp = {p: TensorParallel.of(cast(DTensor, p), infos[p], layouts[p].shard_dim) for p in tp_params}
    leaving = _check_ties(members, below, layouts, infos, fqns)
    post_forward_sizes = {mesh_info: post_forward_size}
    post_forward_sizes.update({info: _resolve_reshard_after_forward(reshard_arg, info)[1] for info in other_meshes.values()})
    streams = CommStreams(device)
    for lower, taken in leaving.items():  # every check passed: only now change the groups below
        lower.remove(taken)

    def make_group(sharded: list[ShardedParam], originals: list[torch.Tensor], info: MeshInfo = mesh_info) -> ParamGroup:
        made = ParamGroup(
            sharded, originals, info, device,
            mp_policy.param_dtype, reduce_dtype, streams,
            offload_to_cpu=isinstance(offload_policy, CPUOffloadPolicy),
            pin_memory=isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory,
            reduce_on_wire_only=comm_policy is not None,
        )
        made.label = type(modules[0]).__name__
        made.call_modules = weakref.WeakSet(modules)
        made.codecs = make_codecs(made, comm_policy, mp_policy)
        size = post_forward_sizes[info]
        if size is not None:
            made.check_post_forward_group()  # (on every rank, before the collective creation of the smaller groups)
            made.set_post_forward_group(post_forward_group(info, size))
        register_state_dict_hooks(made, tuple(modules))
        return made

    by_mesh: dict[MeshInfo, list[torch.Tensor]] = {mesh_info: []}  # [Note: Parameters on other meshes]
    for p in params:
        by_mesh.setdefault(infos[p], []).append(p)
    groups = {info: make_group([ShardedParam(fqns[p], sites[p], p, layouts[p], info, tp.get(p)) for p in on_mesh],
                               on_mesh, info)
              for info, on_mesh in by_mesh.items() if on_mesh}
    for lower in leaving:
        if not lower.params:
            for state in below.values():
                if lower in state.groups:
                    state.drop_group(lower)
    state = HookState(tuple(modules), groups.pop(mesh_info, None), device, reshard_after_forward, mp_policy, streams)
    state.other_groups = list(groups.values())
    state.ignored_params = frozenset(ignored)
    state.make_group = make_group  # a group formed later (a tie made after fully_shard), with this call's settings
    hook_unused_submodules(modules)
    for mod in modules:
        _become_fsdp_module(mod)
    return module


def _resolve_reshard_after_forward(value: bool | int | None, mesh_info: MeshInfo) -> tuple[bool | None, int | None]:
    """(reshard after forward?, size of the smaller group to reshard to, if any)."""
    if value is None or isinstance(value, bool):
        return value, None
    size = mesh_info.shard_size
    if value < 1 or value > size or size % value:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {size}, not {value}")
    if value == 1:
        if not _warned_int_one:  # once per process, on torch's FSDP2 logger (code that filters or captures it)
            _warned_int_one.append(True)
            _fsdp2_log.warning("reshard_after_forward=1 (int) reshards to groups of one rank: it keeps the "
                               "parameters unsharded after forward, like False; pass True to reshard")
        return False, None
    if value == size:
        return True, None
    return True, value


def _validate_modules(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise EmptyModulesError("fully_shard got an empty list of modules")
    for mod in modules:
        if not isinstance(mod, nn.Module):
            raise ArgumentTypeError(f"fully_shard expects an nn.Module or a list of them, got {type(mod).__name__}")
        if type(mod).forward is nn.Module.forward and isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {type(mod).__name__}; "
                "shard the modules inside it, or pass them as a list"
            )
        wrapped = next((name for name, sub in mod.named_modules() if isinstance(sub, FullyShardedDataParallel)), None)
        if wrapped is not None:
            where = f"its submodule {wrapped!r}" if wrapped else "it"
            raise ShardedElsewhereError(
                f"fully_shard got a {type(mod).__name__} and {where} is wrapped by torch's FSDP1 "
                "(FullyShardedDataParallel), whose flat parameters cannot be sharded again: pass the unwrapped module "
                "(fullshard.shard_model gives FSDP1's wrapping policies on fully_shard)"
            )
        if state_of(mod) is not None:
            raise AlreadyShardedError(
                f"fully_shard has already been applied to this {original_class(mod).__name__}. Each distinct "
                "composable distributed API can only be applied to a module once. Shard children first, then the root."
            )
    for i, mod in enumerate(modules):
        if any(mod is other for other in modules[:i]):
            raise AlreadyShardedError(
                f"fully_shard got the same {type(mod).__name__} twice in its list of modules (index {i}). Each "
                "distinct composable distributed API can only be applied to a module once."
            )
    return modules


def _managed_modules(modules: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Modules whose own parameters this call takes: stop at already-sharded subtrees."""
    seen: set[nn.Module] = set()
    managed: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module, is_top: bool) -> None:
        if mod in seen or (not is_top and state_of(mod) is not None):
            return
        seen.add(mod)
        managed.append((prefix, mod))
        for name, child in mod.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, False)

    for mod in modules:
        visit("", mod, True)
    return managed


def _params_of_groups_below(modules: list[nn.Module]) -> dict[ShardedParam, HookState]:
    """The sharded parameters of the groups already formed under ``modules``, with their hook states."""
    below: dict[ShardedParam, HookState] = {}
    for top in modules:
        for mod in top.modules():
            state = state_of(mod)
            if state is not None:
                for p in (p for group in state.groups for p in group.params):
                    below[p] = state
    return below


# [Note: Tied parameters across groups]
# A parameter shared by modules of different fully_shard calls (an embedding in one
# group, the output head tied to it in another) belongs to the nearest enclosing call:
# when fully_shard runs on a common ancestor, it takes the parameter out of the groups
# below (which keep the rest, relinked) and shards it itself, with every module using
# it as a site, so one all-gather serves all of them and the tie holds. Found here:
# - a module of this call holds the original parameter, or the sharded parameter of a
#   group below (tied after fully_shard);
# - two groups below sharded the same original (the later one knows the first one).
# - a module used under two calls that do not enclose each other (a block shared by two
#   layers, each sharded on its own): the first call shards its parameters and the
#   second leaves them; the nearest call enclosing every path to the module takes them.
# When no call on a common ancestor takes it, lazy init raises (two copies would train,
# or, for a shared module, the second call's forward would meet sharded parameters).


def _tied_to(
    param: torch.Tensor, below: dict[ShardedParam, HookState], below_sharded: dict[int, ShardedParam]
) -> ShardedParam | None:
    """The first sharded parameter of a group below that ``param`` is, or was sharded from."""
    sp = below_sharded.get(id(param))
    if sp is not None and sp.sharded is param:
        return _first_claimant(sp, below)
    claimant = claimant_of(param)
    return _first_claimant(claimant, below) if claimant in below else None


def _first_claimant(sp: ShardedParam, below: dict[ShardedParam, HookState]) -> ShardedParam:
    while sp.shared_with is not None and sp.shared_with in below:
        sp = sp.shared_with
    return sp


def _encloses(group: ParamGroup, modules: list[nn.Module]) -> bool:
    """Whether the fully_shard call that formed ``group`` was applied to (an ancestor of) one of ``modules``."""
    return any(top is m for owner in group.call_modules for m in owner.modules() for top in modules)


def _shared_beyond_owner(modules: list[nn.Module], below: dict[ShardedParam, HookState]) -> list[ShardedParam]:
    """Sharded parameters of groups below whose modules are also reached by a path that their own call does not
    enclose (a module shared by two sibling calls): this call, the nearest enclosing every path, takes them."""
    paths: dict[nn.Module, list[str]] = {}
    for i, top in enumerate(modules):
        for name, mod in top.named_modules(remove_duplicate=False, prefix=str(i)):
            paths.setdefault(mod, []).append(name)
    taken = []
    for sp, state in below.items():
        users = [path for site in sp.sites for path in paths.get(site.module, ())]
        if len(users) < 2:
            continue
        own = [path for member in state.modules for path in paths.get(member, ())]
        if not all(any(u == o or u.startswith(o + ".") for o in own) for u in users):
            taken.append(_first_claimant(sp, below))
    return taken


def _check_shared_precision(taken: list[ShardedParam], mp_policy: MixedPrecisionPolicy) -> None:
    """Raise if a shared module this call takes over computed in another dtype under its own call (its users
    there would meet parameters of another dtype than their inputs)."""
    for sp in (sp for sp in taken if sp.orig_dtype.is_floating_point):
        lower = group_of(sp.sharded)
        assert lower is not None
        theirs, ours = lower.param_compute_dtype(sp), mp_policy.param_dtype or sp.orig_dtype
        if theirs != ours:
            raise ValueError(
                f"parameter {sp.fqn!r} belongs to a module shared by fully_shard calls that do not enclose each "
                f"other; this call encloses them and takes it over, so it would be gathered in {ours}, while the "
                f"call on {lower.label!r} computes it in {theirs}: pass the same mp_policy to these calls, or shard "
                "the shared module on its own first (fully_shard(shared, mp_policy=...), then the others)"
            )


def _tied_with(first: ShardedParam, below: dict[ShardedParam, HookState]) -> list[ShardedParam]:
    """The other sharded parameters below that share ``first``'s original."""
    return [sp for sp in below if sp is not first and _first_claimant(sp, below) is first]


def _ties_among(below: dict[ShardedParam, HookState]) -> dict[ShardedParam, None]:
    return {_first_claimant(sp, below): None for sp in below if sp.shared_with is not None and sp.shared_with in below}


def _check_ties(
    members: dict[torch.Tensor, list[ShardedParam]], below: dict[ShardedParam, HookState],
    layouts: dict[torch.Tensor, ParamLayout], infos: dict[torch.Tensor, MeshInfo], fqns: dict[torch.Tensor, str],
) -> dict[ParamGroup, list[ShardedParam]]:
    """Which sharded parameters leave which group below; raise before anything changes if one cannot."""
    leaving: dict[ParamGroup, list[ShardedParam]] = {}
    for source, sharing in members.items():
        for sp in sharing:
            group = group_of(sp.sharded)
            assert group is not None
            if sp.tp is not None:
                raise ValueError(
                    f"parameter {fqns[source]!r} is tied to {sp.fqn!r} of the fully_shard group of {group.label!r} "
                    "and is a DTensor (tensor parallel, or on an SPMD mesh); a tie across fully_shard groups is "
                    "supported for plain parameters: shard the modules sharing it in one fully_shard call"
                )
            if sp.mesh_info.mesh != infos[source].mesh or sp.layout != layouts[source]:
                raise ValueError(
                    f"parameter {fqns[source]!r} is tied to {sp.fqn!r} of the fully_shard group of "
                    f"{group.label!r}, which shards it on another mesh or dim; a tied parameter moves to the "
                    "enclosing group only when both shard it alike: pass the same mesh and shard_placement_fn"
                )
            if group.state is not ShardedState.SHARDED or below[sp].ctx is not None:
                raise ValueError(
                    f"parameter {fqns[source]!r} is tied to {sp.fqn!r} of the fully_shard group of "
                    f"{group.label!r}, which has already run; call fully_shard on every module before the first forward"
                )
            leaving.setdefault(group, []).append(sp)
    return leaving


def _is_tensor_parallel(param: torch.Tensor, ties: dict[torch.Tensor, ShardedParam]) -> bool:
    """A DTensor parameter the user brought (not the sharded parameter of a group below)."""
    return isinstance(param, DTensor) and param not in ties


def _check_params(
    params: list[torch.Tensor], fqns: dict[torch.Tensor, str], device: torch.device, infos: dict[torch.Tensor, MeshInfo]
) -> None:
    for p in params:
        fqn, mesh_info = fqns[p], infos[p]
        if mesh_info.spmd is not None:
            _check_spmd_param(p, fqn, mesh_info.spmd)
        elif isinstance(p, DTensor):
            _check_tensor_parallel(p, fqn, mesh_info)
        if p.dim() == 0 and (isinstance(p, DTensor) or hasattr(p, "fsdp_pre_all_gather")):
            # (a ValueError too: what torch's FSDP2 raises for every 0-dim parameter)
            raise UnsupportedError(
                f"parameter {fqn!r} is 0-dim and a {type(p).__name__}; fully_shard replicates plain 0-dim "
                "parameters only (a tensor-parallel or all-gather-extension one needs at least one dimension)"
            )
        if p.device.type != "meta":
            check_param_device(fqn, p.device, device)


def _check_tensor_parallel(param: DTensor, fqn: str, mesh_info: MeshInfo) -> None:
    """A DTensor parameter must be tensor parallel: on a mesh of its own beside the data-parallel one."""
    tp_mesh = param.device_mesh
    if tp_mesh.device_type != mesh_info.mesh.device_type:
        raise ValueError(
            f"Requires DTensor to have mesh of the same type as the FSDP mesh but got {tp_mesh.device_type} for "
            f"DTensor and {mesh_info.mesh.device_type} for FSDP (parameter {fqn!r})"
        )
    if tp_mesh == mesh_info.mesh or set(tp_mesh.mesh_dim_names or ()) & set(mesh_info.mesh.mesh_dim_names or ()):
        raise OverlappingMeshError(
            f"parameter {fqn!r} is already a DTensor on the mesh fully_shard shards over ({tp_mesh}); a DTensor "
            "parameter must be tensor parallel, on other axes of the same mesh (e.g. mesh['tp'] beside mesh['dp'])"
        )
    _check_placements(param, fqn)
    concatenate_meshes(mesh_info.mesh, tp_mesh)  # raises unless both are named axes of one mesh


def _check_spmd_param(param: torch.Tensor, fqn: str, spmd: SpmdMesh) -> None:
    """With dp_mesh_dims, a parameter is a DTensor on the SPMD mesh, Replicate on its data-parallel axes."""
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. via "
            f"distribute_module); parameter {fqn!r} is a plain {type(param).__name__}"
        )
    if param.device_mesh is not spmd.mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on {param.device_mesh}: with dp_mesh_dims, expected param's DTensor "
            f"mesh to be the same mesh passed to fully_shard ({spmd.mesh}), the same object"
        )
    for role, names in (("shard", spmd.shard_names), ("replicate", spmd.replicate_names)):
        for name in names:
            placement = param.placements[spmd.axis(name)]
            if not placement.is_replicate():
                raise ValueError(
                    f"parameter {fqn!r}: Expected Replicate() on DP {role} dim {name!r} (index {spmd.axis(name)}) "
                    f"but got {placement}; fully_shard shards or replicates it over that axis itself"
                )
    _check_placements(param, fqn)


def _check_placements(param: DTensor, fqn: str) -> None:
    if not all(pl.is_shard() or pl.is_replicate() for pl in param.placements):
        raise ValueError(f"parameter {fqn!r} has placements {param.placements}; fully_shard takes Shard or Replicate ones")


def _refuse_custom_comm(call: str, what: str, comm: object, ours: type | tuple[type, ...]) -> None:
    """FSDP2's ``AssertionError`` for ``call`` beside a custom ``what`` comm (one not of the types ``ours``)."""
    if comm is not None and not isinstance(comm, ours):
        raise AssertionError(f"cannot call {call}() when {what} comm is custom: {type(comm).__name__}")


def _check_comm(method: str, comm: Any) -> None:
    if comm is not None and not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method}: comm must be a torch.distributed.fsdp AllGather/ReduceScatter (with allocate() and __call__), "
            f"got {type(comm).__name__}"
        )


def check_param_device(fqn: str, param_device: torch.device, mesh_dev: torch.device) -> None:
    """Parameters on CPU are moved to the mesh's device; any other device must be the mesh's."""
    if param_device.type == "cpu" or param_device == mesh_dev:
        return
    if param_device.type == mesh_dev.type and param_device.index in (None, mesh_dev.index):
        return
    raise ValueError(
        f"parameter {fqn!r} is on {param_device} but the mesh computes on {mesh_dev}; "
        f"move the module to {mesh_dev} (or to cpu) before fully_shard, or pass a mesh of device type "
        f"{param_device.type!r}"
    )


def _layout(
    param: torch.Tensor, fqn: str, placement: Any, mesh_info: MeshInfo, tensor_parallel: bool = False,
) -> ParamLayout:
    if param.dim() == 0:  # whole on every rank ([Note: Replicated scalars] in layout.py); nothing to place
        return ParamLayout((), 0, mesh_info.shard_size)
    if placement is None:
        dim = 0
    elif isinstance(placement, Shard):
        dim = placement.dim if placement.dim >= 0 else placement.dim + param.dim()
        if not 0 <= dim < param.dim():
            raise UsageError(
                f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: shard_placement_fn returned "
                f"{placement} for {fqn!r} with shape {tuple(param.shape)}"
            )
    else:
        raise ValueError(f"Invalid shard_placement_fn result: {placement} (shard_placement_fn must return a Shard or "
                         f"None, got {placement!r} for {fqn!r})")
    data = cast(DTensor, param).to_local() if tensor_parallel else param  # tensor parallel: its local piece
    layout = ParamLayout(tuple(data.shape), dim, mesh_info.shard_size)
    extension = hasattr(data, "fsdp_pre_all_gather") or hasattr(data, "fsdp_post_all_gather")
    # Refused here, before fully_shard changes anything. [Note: Uneven cuts off dim 0]: the rows of every other
    # parameter are stored compact; a tensor-parallel piece and an all-gather extension's hooks take the padded chunk.
    if layout.compact and (tensor_parallel or extension):
        kind = "a tensor-parallel" if tensor_parallel else "an all-gather-extension"
        raise UnsupportedError(
            f"FSDP does not support uneven sharding on dim {dim} for {kind} parameter: sharding {fqn!r} on dim "
            f"{dim} needs its size {layout.dim_size} to be divisible by the shard world size "
            f"{mesh_info.shard_size}; shard it on dim 0 (padding is supported there)"
        )
    if extension and (tensor_parallel or dim != 0):
        raise UnsupportedError(
            f"parameter {fqn!r}: all-gather extensions are supported on dim-0 sharding without tensor parallel"
        )
    return layout


# [Note: Parameters on other meshes]
# shard_placement_fn may return FSDP2's ShardPlacementResult, a placement with a mesh of
# its own: torchtitan's mixture of experts shards the experts over the ranks outside
# their expert-parallel group and the rest of the block over all of them, in one call.
# The call then forms one group per mesh (per pair of shard and replicate process
# groups, as FSDP2): its own mesh's first, the others in the order of their first
# parameter. The state drives them together: each is all-gathered, resharded and
# reduced where a single group would be, with its own collectives over its own ranks,
# gradients divided by its own data-parallel size, and an int reshard_after_forward
# resolved against its own shard size. Setters act on every group, except the three
# FSDP2 also refuses with several (a custom all-gather or reduce-scatter, an all-reduce
# hook: ValueError). With dp_mesh_dims, a mesh_info FSDP2's _get_mesh_info made from
# another SPMD mesh and its dp_mesh_dims (torchtitan's experts on the "sparse" mesh)
# is that mesh's data-parallel axes, as the call's are its own ([Note: SPMD meshes]).


def _placement(
    param: torch.Tensor, fqn: str, shard_placement_fn: _ShardPlacementFn | None, mesh_info: MeshInfo,
    device: torch.device, other_meshes: dict[tuple[Any, ...], MeshInfo],
) -> tuple[Any, MeshInfo]:
    """What ``shard_placement_fn`` says for ``param`` (not called for 0-dim ones): its placement, and the mesh it is
    sharded over, ``mesh_info`` or one of ``other_meshes`` (by process groups and SPMD mesh; a new one is added)."""
    if shard_placement_fn is None or param.dim() == 0:
        return None, mesh_info
    result: Any = shard_placement_fn(cast(nn.Parameter, param))
    if not (hasattr(result, "mesh_info") and hasattr(result, "placement")):
        return result, mesh_info
    info = result.mesh_info
    mesh, dims = getattr(info, "mesh", None), getattr(info, "dp_mesh_dims", None)
    spmd_mesh = getattr(info, "spmd_mesh", None) if dims is not None else None
    shard_axis, replicate_axis = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or shard_axis is None or (dims is not None and spmd_mesh is None):
        raise ValueError(
            f"shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info has no mesh to shard "
            f"over ({info!r}); pass an FSDPMeshInfo or HSDPMeshInfo"
        )
    key = (mesh.get_group(shard_axis), None if replicate_axis is None else mesh.get_group(replicate_axis), spmd_mesh)
    if key == (mesh_info.shard_group, mesh_info.replicate_group, mesh_info.spmd.mesh if mesh_info.spmd else None):
        return result.placement, mesh_info
    if mesh_device(mesh).type != device.type or (dims is None and mesh.ndim != (1 if replicate_axis is None else 2)):
        raise ValueError(
            f"shard_placement_fn put {fqn!r} on {mesh}: a ShardPlacementResult's mesh must be 1-D (sharding) or 2-D "
            f"(replicating and sharding) and of the fully_shard mesh's device type ({device.type})"
        )
    if key not in other_meshes:  # (an SPMD mesh's data-parallel axes: torch's _get_mesh_info(mesh, dp_mesh_dims))
        other_meshes[key] = resolve_mesh(spmd_mesh, dims) if dims is not None else MeshInfo(
            mesh, shard_axis=shard_axis, replicate_axis=replicate_axis)
    return result.placement, other_meshes[key]


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build `type(self)(...)` when sliced; build the original class instead.
        orig_cls: Any = getattr(cls, "_fullshard_original_class", None)
        if orig_cls is None:
            raise TypeError(f"{cls.__name__} cannot be instantiated: fully_shard makes FSDP classes of existing modules")
        obj = orig_cls.__new__(orig_cls)
        obj.__init__(*args, **kwargs)
        return obj

    def _as_module(self) -> nn.Module:
        return cast(nn.Module, self)  # FSDP<Class> is always an nn.Module subclass

    def _only_group(self, method: str, what: str) -> ParamGroup | None:
        """The module's one group; a ``ValueError`` (as FSDP2's) when parameters on other meshes made several."""
        groups = self._get_hook_state().groups
        if len(groups) > 1:
            raise ValueError(
                f"{method} is not supported with multiple param groups (from per-param mesh via shard_placement_fn): "
                f"the {what} would be ambiguous across groups with different meshes"
            )
        return groups[0] if groups else None

    def _get_hook_state(self) -> HookState:
        state = state_of(self)
        if state is None:
            raise AssertionError(f"no fullshard state on {type(self).__name__}")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's group. With ``async_op=True`` return a handle to wait on."""
        expect_bool("unshard", "async_op", async_op)
        state = self._get_hook_state()
        if state.ctx is None:
            state.lazy_init()
        take_over_changes([state])
        for group in state.groups:
            group.unshard(async_op=True)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        state = self._get_hook_state()
        take_over_changes([state])
        for group in state.groups:
            group.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after forward (for this module and, with ``recurse``, below)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}")
        for state in states_in(self._as_module(), recurse):
            state.reshard_after_forward = reshard_after_forward
            state.reshard_after_forward_arg = reshard_after_forward
            for group in state.groups:
                group.set_post_forward_group(None)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward keeps the unsharded gradients (no communication) to add to a later synced backward.

        The equivalent of FSDP1's ``no_sync()``; for HSDP it skips the all-reduce too. The setting of
        :meth:`set_requires_all_reduce` is kept: a synced backward all-reduces when both are ``True``.
        """
        requires_gradient_sync = expect_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        for settings in _reduce_settings(self._as_module(), recurse):
            settings.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but keeps the per-replica sums, all-reduced by a later backward."""
        requires_all_reduce = expect_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        for settings in _reduce_settings(self._as_module(), recurse):
            settings.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the unsharded parameters after backward (saves the next forward's all-gather)."""
        reshard_after_backward = expect_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        for state in states_in(self._as_module(), recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's code: every backward assigns the gradients it reduced ([Note: Last backward]
        in runtime.py), so the flag changes nothing."""
        expect_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        self._get_hook_state()  # raises, as the other setters, on a module without a state

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward needs no parameter of this group (e.g. an embedding), so skip its all-gather."""
        self._get_hook_state().unshard_in_backward = expect_bool("set_unshard_in_backward", "unshard_in_backward",
                                                                 unshard_in_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel world size."""
        value = expect_divisor("set_gradient_divide_factor", "factor", factor)
        for settings in _reduce_settings(self._as_module(), recurse=False):
            settings.divide_factor = value

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The older name of :meth:`set_gradient_divide_factor` (warns, as FSDP2 does)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: object | None = None) -> None:
        """Call ``hook(reduced)`` on each reduced flat gradient (after the all-reduce with HSDP), in place.

        On accelerators the hook runs on ``stream`` when given (ordered after the reduction, and the
        rest of the post-reduce work after the hook), else on the stream doing the reduction. Not
        with HSDP, whose all-reduce stream runs it.
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        group = self._only_group("set_all_reduce_hook", "hook")
        if group is None:
            return
        if stream is not None and group.mesh_info.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        group.reducer.settings.all_reduce_hook = hook
        group.reducer.settings.all_reduce_hook_stream = stream

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """Order the root's next forward all-gathers after ``event`` (recorded after the optimizer step)
        instead of after everything queued on the compute stream. ``None`` (what a CPU stream's ``record_event()``
        returns) leaves the default order."""
        if event is not None and not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event: event must be a torch.Event (or a device Event), got {type(event).__name__}")
        state = self._get_hook_state()
        (state.ctx or state.lazy_init()).post_optim_event = event

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zeros for trainable parameters that got no gradient, so ranks whose control flow used
        different parameters (mixture of experts) still issue matching collectives."""
        reduce_scatter_unused_params = expect_bool("set_reduce_scatter_unused_params", "reduce_scatter_unused_params",
                                                   reduce_scatter_unused_params)
        for settings in _reduce_settings(self._as_module(), recurse):
            settings.reduce_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reductions may be in flight before backward waits for the oldest (default 1)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for settings in _reduce_settings(self._as_module(), recurse):
            settings.max_inputs_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter on a process group of its own, so it can progress while an all-gather runs.

        Collective: every rank of the mesh must call it together.
        """
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in (group for state in states_in(self._as_module(), recurse) for group in state.groups):
            if group.mesh_info.shard_group is None:
                continue
            if not enable:
                group.reducer.settings.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
            if ranks not in created:
                created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            group.reducer.settings.reduce_scatter_group = created[ranks]

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``ReduceOp.SUM`` and a separate division only (no ``AVG``), e.g. for zero-copy NCCL.

        Without it, NCCL reductions whose divide factor is the data-parallel size use ``AVG``.
        """
        enable = expect_bool("set_force_sum_reduction_for_comms", "enable", enable)
        for settings in _reduce_settings(self._as_module(), recurse=False):
            settings.force_sum_reduction = enable

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gather this module's group with ``comm`` (torch's ``AllGather``): it allocates the output (1-D) and
        runs ``comm(output_tensor=..., input_tensor=..., group=..., async_op=True)``. ``None`` restores the default."""
        _check_comm("set_custom_all_gather", comm)
        group = self._only_group("set_custom_all_gather", "custom comm")
        if group is not None:
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's ``ReduceScatter``): it allocates the input
        and the output (1-D) and runs ``comm(output_tensor=..., input_tensor=..., group=..., op=..., async_op=True)``.
        ``None`` restores the default."""
        _check_comm("set_custom_reduce_scatter", comm)
        group = self._only_group("set_custom_reduce_scatter", "custom comm")
        if group is not None:
            group.reducer.settings.custom_comm = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather outputs and reduce-scatter buffers with the process group's own allocator
        where its backend has one for the device (NCCL's registered memory, for zero-copy transfers), else from the
        caching allocator as by default. Not with a custom all-gather or reduce-scatter (``AssertionError``, as
        FSDP2)."""
        enable = expect_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        for group in self._get_hook_state().groups:
            settings = group.reducer.settings
            _refuse_custom_comm("set_allocate_memory_from_process_group", "all gather", group.all_gather_comm,
                                ProcessGroupAllGather)
            _refuse_custom_comm("set_allocate_memory_from_process_group", "reduce scatter", settings.custom_comm,
                                ProcessGroupReduceScatter)
            shard_group = group.mesh_info.shard_group
            group.all_gather_comm = ProcessGroupAllGather(shard_group) if enable else None
            settings.custom_comm = ProcessGroupReduceScatter(settings.reduce_scatter_group or shard_group) if enable else None

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Accepted for code written for FSDP2, where it allocates this module's all-gather buffers from symmetric
        memory (an NCCL transport optimisation that leaves the values unchanged). fullshard checks what FSDP2 checks
        (no custom all-gather or reduce-scatter, including the process group's allocator: ``AssertionError``; torch
        knows ``backend``: ``RuntimeError`` from torch where it does not, as on builds without NCCL), then warns that
        it keeps its buffers where they are."""
        from torch.distributed import _symmetric_memory as symm_mem

        for group in self._get_hook_state().groups:
            _refuse_custom_comm("set_symm_mem", "all gather", group.all_gather_comm, ())
            symm_mem.set_backend(backend)
            _refuse_custom_comm("set_symm_mem", "reduce scatter", group.reducer.settings.custom_comm, ())
        warnings.warn(
            "set_symm_mem_for_comm: fullshard does not allocate its collective buffers from symmetric memory; "
            "they stay in the caching allocator (the values are the same)",
            stacklevel=2,
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted for code written for FSDP2 (where it is private): there it issues the unshards as asynchronous
        collectives whose buffers come from the compute stream. fullshard's all-gathers always run asynchronously on
        their own stream and are waited on right before use, so the flag changes nothing."""
        expect_bool("_set_unshard_async_op", "async_op", async_op)

    def set_modules_to_forward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these modules' groups when this module's forward starts (replaces the implicit next one)."""
        self._get_hook_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: Iterable[FSDPModule]) -> None:
        """All-gather these modules' groups when this module's backward starts (replaces the implicit previous one)."""
        self._get_hook_state().backward_prefetch = _states_of(modules)

    def reset_iter_state(self) -> None:
        """Recover from a forward or backward that raised; the root does this by itself at its next forward."""
        state = self._get_hook_state()
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root module (the outermost fully_shard)")
        if state.ctx is not None:
            state.ctx.recover()

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        """``to()``, ``to_empty()``, ``float()``...: convert, then re-link the flat shard buffer once every module
        of the group has converted (see [Note: Converting a group] in group.py)."""
        state = self._get_hook_state()
        take_over_changes([state])  # so that the conversion reaches the parameters assigned since
        for group in state.groups:
            group.reshard()
            group.adopt_reassigned()  # (before the first forward)
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for group in state.groups:
            group.member_converted(self._as_module(), state.modules)
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise AssertionError("FSDP does not support deepcopy: copy the model before fully_shard, or save and load a state dict")


class UnshardHandle(_TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gather.

    A subclass of torch's ``UnshardHandle``, so checks written for FSDP2 accept it. As on FSDP2, waiting again, or
    after a forward completed the all-gather (and the group was resharded since), does nothing.
    """

    def __init__(self, state: HookState) -> None:
        self._state: HookState | None = state

    def wait(self) -> None:
        state, self._state = self._state, None
        for group in state.groups if state is not None else ():
            if group.state is ShardedState.UNSHARDING:
                group.wait_for_unshard()


def _reduce_settings(module: nn.Module, recurse: bool) -> list[ReduceSettings]:
    """The reduction settings of each state: its group's, or those a group formed later takes."""
    return [settings for s in states_in(module, recurse)
            for settings in [g.reducer.settings for g in s.groups] + ([s.settings_without_group] if s.group is None else [])]


def _states_of(modules: Iterable[FSDPModule]) -> list[HookState]:
    """Any iterable of modules (a list, a ``ModuleList``, a slice of one), as FSDP2 takes; a string is iterated too
    (its characters are not modules: ``ValueError``)."""
    try:
        modules = list(modules)
    except TypeError:
        raise TypeError(f"expected a list of modules passed to fully_shard, got {type(modules).__name__}") from None
    states = []
    for mod in modules:
        state = state_of(mod)
        if state is None:
            raise ValueError(f"Expects FSDPModule but got {type(mod).__name__}: expected modules passed to fully_shard")
        states.append(state)
    return states


def share_comm_ctx(modules: Iterable[FSDPModule]) -> None:
    """Make these modules (roots of separate models, e.g. in pipeline stages) share communication streams."""
    states = _states_of(modules)
    for state in states[1:]:
        state.streams = states[0].streams
        for group in state.groups:
            group.streams = states[0].streams


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` unshard and reshard like ``forward`` does (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    state = state_of(module)
    assert state is not None
    method = getattr(module, method_name)  # the instance's: a method assigned to the module is the one wrapped

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward_hook(self, args, kwargs)
        out = method(*args, **kwargs)
        return state._post_forward_hook(self, args, out)

    # As an attribute assignment (a parameter's, buffer's or submodule's name: nn.Module's TypeError, as FSDP2)
    setattr(module, method_name, types.MethodType(wrapped, module))


_fsdp_classes: dict[type, type] = {}


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` (``Linear`` for ``FSDPLinear``)."""
    return cast(type, getattr(type(module), "_fullshard_original_class", type(module)))


def _become_fsdp_module(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_fullshard_original_class": cls})
    module.__class__ = _fsdp_classes[cls]
