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
from fullshard.errors import expect_module
from fullshard.mesh import MeshInfo, default_device_type, resolve_mesh
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.runtime import BackwardPrefetchMode, state_of

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
    """Shard every module for which ``fn(module)`` is true."""

    def __init__(self, fn: Callable[[nn.Module], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"CustomPolicy expects a callable (module) -> bool, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else bool(self.fn(module))


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


def _modules_to_shard(root: nn.Module, policy: PolicyFn | None, ignored: set[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Post-order: every module the policy wraps, children first (FSDP1's recursion protocol)."""
    chosen: list[tuple[str, nn.Module]] = []
    taken: dict[nn.Parameter, str] = {}  # parameter -> the picked module that takes it
    ignored_params = {p for m in ignored for p in m.parameters()}

    def unwrapped_numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p not in taken and p not in ignored_params)

    def visit(name: str, module: nn.Module) -> None:
        if module in ignored:
            return
        if policy is None or not policy(module=module, recurse=True, nonwrapped_numel=unwrapped_numel(module)):
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is root or _is_container(module):
            return
        numel = unwrapped_numel(module)
        if policy(module=module, recurse=False, nonwrapped_numel=numel):
            if numel == 0:
                _explain_empty_pick(name, module, taken)
            chosen.append((name, module))
            taken.update({p: name for p in module.parameters() if p not in taken})

    visit("", root)
    return chosen


def _explain_empty_pick(name: str, module: nn.Module, taken: dict[nn.Parameter, str]) -> None:
    """Raise for a picked module with nothing left to shard, naming a shared parameter if that is why."""
    for param_name, param in module.named_parameters():
        owner = taken.get(param)
        if owner is not None and not owner.startswith(f"{name}."):
            raise ValueError(
                f"auto_wrap_policy picked module {name!r}, whose parameter {name}.{param_name} is shared with "
                f"module {owner!r}, also picked: a parameter can be sharded only once; shard the modules that "
                "share it together (e.g. leave both to their common parent)"
            )
    raise ValueError(
        f"auto_wrap_policy picked module {name!r} ({type(module).__name__}), which would shard nothing: "
        "it has no parameters that are not ignored or already taken by a sharded submodule"
    )


def _hybrid_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh:
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ValueError(f"HYBRID_SHARD needs a 2-D (replicate, shard) device_mesh, got {device_mesh.ndim} dimensions")
        return device_mesh
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
        return resolve_mesh(_hybrid_mesh(device_mesh)), strategy is ShardingStrategy.HYBRID_SHARD
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
    if not isinstance(sharding_strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a fullshard.ShardingStrategy, got {sharding_strategy!r}")
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a fullshard.BackwardPrefetch or None, got {backward_prefetch!r}")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a fullshard.CPUOffload, got {type(cpu_offload).__name__}")
    ignored = set(ignored_modules or ())
    for name, module in model.named_modules():
        if state_of(module) is not None:
            label = name or original_class(model).__name__
            raise ValueError(f"shard_model: module {label!r} is already sharded; shard a model once")
    mesh_info, reshard = _mesh_and_resharding(sharding_strategy, device_mesh)
    common: dict[str, Any] = {
        "offload_policy": CPUOffloadPolicy() if cpu_offload is not None and cpu_offload.offload_params else OffloadPolicy(),
        "ignored_params": {p for m in ignored for p in m.parameters()},
        "comm_policy": comm_policy,
        "shard_placement_fn": shard_placement_fn,
    }
    if not any(p not in common["ignored_params"] for p in model.parameters()):
        raise ValueError(f"shard_model: {type(model).__name__} has no parameters to shard")
    for name, module in _modules_to_shard(model, _as_policy_fn(auto_wrap_policy), ignored):
        shard_modules(module, lambda: mesh_info, reshard_after_forward=reshard,
                      mp_policy=_mp_policy(mixed_precision, root=False), **common)
    shard_modules(model, lambda: mesh_info, reshard_after_forward=None if reshard else reshard,
                  mp_policy=_mp_policy(mixed_precision, root=True), **common)
    if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
        _cast_buffers(model, mixed_precision.buffer_dtype)
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


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point buffers to ``dtype`` for training; state dicts give them in their own dtypes, as
    FSDP1's do (values rounded through ``dtype``), and loading one casts back through ``load_state_dict``'s copy."""
    for module in model.modules():
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
