"""FSDP1's one-call entry point: auto-wrap policies and sharding strategies mapped onto ``fully_shard``.

``shard_model`` walks the module tree bottom-up, asks the policy about each
module, calls ``fully_shard`` on the chosen ones (children before parents) and
finally on the root. FSDP1's enums and configuration dataclasses are torch's
own (``torch.distributed.fsdp.ShardingStrategy`` etc.), so code written for
``FullyShardedDataParallel`` passes the same objects.

Strategies:

=====================  ============================================================
``FULL_SHARD``         shard; free parameters after forward (root: kept, as FSDP2)
``SHARD_GRAD_OP``      shard; keep parameters from forward to backward
``NO_SHARD``           replicate (a 1-D replicate mesh), all-reduce gradients
``HYBRID_SHARD``       2-D mesh: shard within a node, replicate across nodes
``HYBRID_SHARD_ZERO2`` as ``HYBRID_SHARD``, parameters kept from forward to backward
=====================  ============================================================
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from fullshard.api import original_class, shard_modules
from fullshard.codec import QuantizedCommPolicy
from fullshard.errors import ArgumentTypeError, expect_module
from fullshard.mesh import MeshInfo, default_device_type, resolve_mesh
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.runtime import BackwardPrefetchMode, cast_floats, state_of, tensors_in

__all__ = [
    "BackwardPrefetch", "CPUOffload", "CustomPolicy", "MixedPrecision", "ModuleWrapPolicy", "ShardingStrategy",
    "shard_model", "size_based_auto_wrap_policy",
]

PolicyFn = Callable[..., Any]  # (module, recurse, nonwrapped_numel) -> bool


class ModuleWrapPolicy:
    """Shard every module whose class is one of ``module_classes`` (e.g. the transformer block)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        if isinstance(module_classes, type) or not isinstance(module_classes, Iterable):
            raise TypeError(f"ModuleWrapPolicy expects a set of module classes, got {module_classes!r}")
        self.module_classes = tuple(module_classes)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in self.module_classes):
            raise TypeError(f"ModuleWrapPolicy expects nn.Module subclasses, got {self.module_classes}")

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)


class CustomPolicy:
    """Shard every module for which ``fn(module)`` is true; a dict it returns also shards the module, with those
    of ``shard_model``'s settings for that module alone (``OVERRIDABLE``), as FSDP1's ``CustomPolicy``."""

    def __init__(self, fn: Callable[[nn.Module], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"CustomPolicy expects a callable (module) -> bool, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool | dict[str, Any]:
        if recurse:
            return True
        picked = self.fn(module)
        return dict(picked) if isinstance(picked, dict) else bool(picked)


# shard_model's settings a CustomPolicy may give one module; the others (prefetching, ignored modules) are the
# whole model's.
OVERRIDABLE = frozenset({"sharding_strategy", "mixed_precision", "cpu_offload", "device_mesh", "comm_policy",
                         "shard_placement_fn"})
OWN_PRECISION = "_fullshard_own_precision"  # marks a module of MixedPrecision._module_classes_to_ignore


def _as_policy_fn(policy: Any) -> PolicyFn | None:
    if policy is None:
        return None
    if hasattr(policy, "_lambda_fn"):  # torch.distributed.fsdp.wrap.CustomPolicy
        return CustomPolicy(policy._lambda_fn)
    if callable(policy):  # ours, torch's ModuleWrapPolicy, or a plain function
        return policy
    raise TypeError(f"auto_wrap_policy must be a policy or a callable (module, recurse, nonwrapped_numel), got {policy!r}")


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _modules_to_shard(
    root: nn.Module, policy: PolicyFn | None, ignored: set[nn.Module], own_precision: tuple[type, ...] = ()
) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """Post-order: every module the policy wraps, children first (FSDP1's recursion protocol), with the settings
    the policy gives it alone; a module of an ``own_precision`` class is wrapped on its own, without mixed
    precision (``MixedPrecision._module_classes_to_ignore``)."""
    chosen: list[tuple[str, nn.Module, dict[str, Any]]] = []
    taken: dict[nn.Parameter, tuple[str, nn.Module]] = {}  # parameter -> the picked module that takes it
    ignored_params = {p for m in ignored for p in m.parameters()}
    seen: set[nn.Module] = set()  # a module reached again by another path (shared by two parents) is decided

    def unwrapped_numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p not in taken and p not in ignored_params)

    def visit(name: str, module: nn.Module) -> None:
        if module in ignored or module in seen:
            return
        seen.add(module)
        if policy is None or not policy(module=module, recurse=True, nonwrapped_numel=unwrapped_numel(module)):
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is root or _is_container(module):
            return
        numel = unwrapped_numel(module)
        picked = policy(module=module, recurse=False, nonwrapped_numel=numel)
        if isinstance(module, own_precision) and numel:
            picked = {"mixed_precision": None, OWN_PRECISION: True}
        if isinstance(picked, dict) or picked:
            if numel == 0:
                _explain_empty_pick(name, module, taken)
            chosen.append((name, module, picked if isinstance(picked, dict) else {}))
            taken.update({p: (name, module) for p in module.parameters() if p not in taken})

    visit("", root)
    return chosen


def _explain_empty_pick(name: str, module: nn.Module, taken: dict[nn.Parameter, tuple[str, nn.Module]]) -> None:
    """Raise for a picked module with nothing left to shard, naming a shared parameter if that is why; return
    when what it holds is a module shared with another pick (fully_shard leaves it to a call enclosing both)."""
    inside = set(module.modules())
    shared = False
    for param_name, param in module.named_parameters():
        owner, owner_module = taken.get(param, ("", module))
        holder = module.get_submodule(param_name.rpartition(".")[0])
        if owner_module not in inside and holder in set(owner_module.modules()):
            shared = True  # the same module under both
        elif owner_module not in inside:  # (a module inside it, maybe picked first by another path, is its own)
            raise ValueError(
                f"auto_wrap_policy picked module {name!r}, whose parameter {name}.{param_name} is shared with "
                f"module {owner!r}, also picked: a parameter can be sharded only once; shard the modules that "
                "share it together (e.g. leave both to their common parent)"
            )
    if shared:
        return
    raise ValueError(
        f"auto_wrap_policy picked module {name!r} ({type(module).__name__}), which would shard nothing: "
        "it has no parameters that are not ignored or already taken by a sharded submodule"
    )


def _hybrid_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise ArgumentTypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                                    f"{type(device_mesh).__name__}")
        if device_mesh.ndim != 2:
            raise ValueError(f"HYBRID_SHARD needs a 2-D (replicate, shard) device_mesh, got {device_mesh.ndim} dimensions")
        return device_mesh  # its axes by position, named or not, as FSDP1 takes them
    world = dist.get_world_size()
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if node < 1 or world % node:
        raise ValueError(f"HYBRID_SHARD: LOCAL_WORLD_SIZE={node} does not divide the world size {world}")
    return init_device_mesh(default_device_type(), (world // node, node), mesh_dim_names=("replicate", "shard"))


def _mesh_and_resharding(
    strategy: ShardingStrategy, device_mesh: DeviceMesh | None
) -> tuple[MeshInfo, bool | None]:
    """The data-parallel mesh for ``strategy`` and the non-root ``reshard_after_forward``."""
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        hybrid = MeshInfo(_hybrid_mesh(device_mesh), shard_axis=1, replicate_axis=0)
        return hybrid, strategy is ShardingStrategy.HYBRID_SHARD
    if strategy is ShardingStrategy.NO_SHARD:
        mesh = device_mesh or init_device_mesh(default_device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))
        if mesh.ndim != 1:
            raise ValueError(f"NO_SHARD needs a 1-D device_mesh, got {mesh.ndim} dimensions")
        # Nothing is sharded, so there is nothing to free after forward.
        return MeshInfo(mesh, shard_axis=None, replicate_axis=0), False
    if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        raise ValueError(f"unknown sharding_strategy {strategy!r}")
    return resolve_mesh(device_mesh), strategy is ShardingStrategy.FULL_SHARD


def _mp_policy(mixed_precision: MixedPrecision | None, root: bool) -> MixedPrecisionPolicy:
    """FSDP1's MixedPrecision: the root casts its inputs (``cast_root_forward_inputs``), others only on request."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a fullshard.MixedPrecision, got {type(mixed_precision).__name__}")
    if mixed_precision.keep_low_precision_grads:
        raise NotImplementedError(
            "MixedPrecision(keep_low_precision_grads=True) is not supported: sharded gradients always have the "
            "parameters' dtype (an optimizer cannot take gradients of another dtype)"
        )
    cast = mixed_precision.cast_forward_inputs or (root and mixed_precision.cast_root_forward_inputs)
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype, cast_forward_inputs=cast
    )


def shard_model(
    model: nn.Module,
    *,
    auto_wrap_policy: Any = None,
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    device_mesh: DeviceMesh | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    comm_policy: QuantizedCommPolicy | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
) -> nn.Module:
    """Shard ``model`` in place the way ``FullyShardedDataParallel(model, ...)`` would, and return it.

    Every module ``auto_wrap_policy`` picks becomes one ``fully_shard`` group
    (children before parents); the root takes the rest. Containers
    (``ModuleList``, ``ModuleDict``) are never sharded themselves.
    ``backward_prefetch`` chooses when backward all-gathers the previous group:
    ``BACKWARD_PRE`` before this group's gradients are computed, ``BACKWARD_POST``
    after, ``None`` not at all. ``forward_prefetch=True`` all-gathers the next
    group before this one computes. ``limit_all_gathers=False`` lets prefetching
    run further ahead (every remaining group), trading memory for overlap.
    ``comm_policy`` and ``shard_placement_fn`` go to every ``fully_shard`` call
    (:class:`QuantizedCommPolicy`; a ``Shard`` or ``None`` per parameter).
    """
    expect_module("shard_model", model)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a fullshard.BackwardPrefetch or None, got {backward_prefetch!r}")
    ignored = set(ignored_modules or ())
    for name, module in model.named_modules():
        if state_of(module) is not None:
            label = name or original_class(model).__name__
            raise ValueError(f"shard_model: module {label!r} is already sharded; shard a model once")
    ignored_params = {p for m in ignored for p in m.parameters()}
    if not any(p not in ignored_params for p in model.parameters()):
        raise ValueError(f"shard_model: {type(model).__name__} has no parameters to shard")
    defaults = {"sharding_strategy": sharding_strategy, "mixed_precision": mixed_precision, "cpu_offload": cpu_offload,
                "device_mesh": device_mesh, "comm_policy": comm_policy, "shard_placement_fn": shard_placement_fn}
    meshes: dict[tuple[ShardingStrategy, DeviceMesh | None], tuple[MeshInfo, bool | None]] = {}

    def settings_of(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(overrides) - OVERRIDABLE - {OWN_PRECISION})
        if unknown:
            raise NotImplementedError(
                f"shard_model: the auto_wrap_policy gives module {name!r} settings of its own for {unknown}; a module "
                f"may have its own {sorted(OVERRIDABLE)}, the others are the whole model's"
            )
        settings = {**defaults, **overrides}
        strategy, offload = settings["sharding_strategy"], settings["cpu_offload"]
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a fullshard.ShardingStrategy, got {strategy!r}")
        if offload is not None and not isinstance(offload, CPUOffload):
            raise TypeError(f"cpu_offload must be a fullshard.CPUOffload, got {type(offload).__name__}")
        key = (strategy, settings["device_mesh"])
        if key not in meshes:
            meshes[key] = _mesh_and_resharding(strategy, settings["device_mesh"])
        return settings

    def shard(module: nn.Module, settings: dict[str, Any], own_dtype: bool) -> None:
        root = module is model
        offload = settings["cpu_offload"]
        mesh_info, reshard = meshes[(settings["sharding_strategy"], settings["device_mesh"])]
        shard_modules(
            module, lambda: mesh_info, reshard_after_forward=(None if reshard else reshard) if root else reshard,
            mp_policy=_mp_policy(settings["mixed_precision"], root=root),
            offload_policy=CPUOffloadPolicy() if offload is not None and offload.offload_params else OffloadPolicy(),
            ignored_params=ignored_params, comm_policy=settings["comm_policy"],
            shard_placement_fn=settings["shard_placement_fn"],
        )
        if own_dtype:
            _compute_in_own_dtype(module)

    own_precision: tuple[type, ...] = ()
    if mixed_precision is not None and auto_wrap_policy is not None:
        own_precision = tuple(mixed_precision._module_classes_to_ignore)
    picked = _modules_to_shard(model, _as_policy_fn(auto_wrap_policy), ignored, own_precision)
    plan = [(module, settings_of(name, overrides), bool(overrides.get(OWN_PRECISION)))
            for name, module, overrides in [*picked, ("", model, {})]]  # every setting checked before any is used
    kept = sorted({type(module).__name__ for module, _, own_dtype in plan if own_dtype})
    if kept:
        warnings.warn(f"shard_model: {', '.join(kept)} modules are sharded on their own and compute in their "
                      "parameters' dtype (MixedPrecision._module_classes_to_ignore), their inputs cast to it and their "
                      "outputs back", stacklevel=2)
    for module, settings, own_dtype in plan:
        shard(module, settings, own_dtype)
    if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
        _cast_buffers(model, mixed_precision.buffer_dtype, skip={module for module, _, own_dtype in plan if own_dtype})
    root = state_of(model)
    assert root is not None
    ctx = root.lazy_init()
    ctx.backward_prefetch_mode = {
        BackwardPrefetch.BACKWARD_PRE: BackwardPrefetchMode.PRE,
        BackwardPrefetch.BACKWARD_POST: BackwardPrefetchMode.POST,
        None: BackwardPrefetchMode.NONE,
    }[backward_prefetch]
    ctx.set_prefetch_depth(
        forward=0 if not forward_prefetch else (1 if limit_all_gathers else len(ctx.states)),
        backward=1 if limit_all_gathers else len(ctx.states),
    )
    return model


def _compute_in_own_dtype(module: nn.Module) -> None:
    """``module`` computes in its parameters' dtype: floating inputs are cast to it, floating outputs back to the
    dtype of its first floating input."""
    dtype = next(p.dtype for p in module.parameters())
    seen: list[torch.dtype] = []

    def cast_in(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        first = next((t.dtype for t in tensors_in((args, kwargs)) if t.is_floating_point()), dtype)
        seen.append(first)
        return cast_floats((args, kwargs), dtype)

    def cast_out(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return cast_floats(output, seen.pop())

    module.register_forward_pre_hook(cast_in, prepend=True, with_kwargs=True)
    module.register_forward_hook(cast_out, prepend=False)


def _cast_buffers(model: nn.Module, dtype: torch.dtype, skip: set[nn.Module]) -> None:
    """Cast the floating-point buffers (but those of the ``skip`` modules) to ``dtype`` for training; state dicts
    give them in their own dtypes, as FSDP1's do (values rounded through ``dtype``), and loading one casts back
    through ``load_state_dict``'s copy."""
    for module in model.modules():
        if module in skip:
            continue
        original = {}
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype:
                original[buf_name] = buf.dtype
                module._buffers[buf_name] = buf.to(dtype)
        if original:
            module.register_state_dict_post_hook(functools.partial(_buffers_in_own_dtypes, original))


def _buffers_in_own_dtypes(original: dict[str, torch.dtype], module: nn.Module, state_dict: dict[str, Any],
                           prefix: str, local_metadata: Any) -> None:
    for buf_name, dtype in original.items():
        key = prefix + buf_name
        if key in state_dict:
            state_dict[key] = state_dict[key].to(dtype)
