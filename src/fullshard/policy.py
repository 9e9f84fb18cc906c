"""Policies are data: small frozen dataclasses checked when ``fully_shard`` is called.

torch's own policy objects (``torch.distributed.fsdp.MixedPrecisionPolicy``,
``CPUOffloadPolicy``, ``OffloadPolicy``) are accepted too, as the equal policy
here: code that imports its policies from torch and ``fully_shard`` from here
works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import fsdp as torch_fsdp

from fullshard.errors import ArgumentTypeError, DtypeError, ReduceDtypeError

# torch's classes, bound before fullshard.use_as_fsdp2() can point torch's names at the classes below.
_TORCH_MIXED_PRECISION = torch_fsdp.MixedPrecisionPolicy
_TORCH_OFFLOAD, _TORCH_CPU_OFFLOAD = torch_fsdp.OffloadPolicy, torch_fsdp.CPUOffloadPolicy


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and forward outputs.

    - ``param_dtype``: dtype of the unsharded parameters (all-gather and compute);
      ``None`` keeps the original dtype.
    - ``reduce_dtype``: dtype of the gradient reduction; ``None`` uses
      ``param_dtype`` (or the original dtype when that is ``None``).
    - ``output_dtype``: floating-point forward outputs are cast to it; ``None``
      leaves them alone.
    - ``cast_forward_inputs``: cast floating-point forward inputs to
      ``param_dtype``.

    Sharded parameters, gradients and optimizer state always stay in the
    original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; the optimizer step runs there.

    ``pin_memory`` pins the CPU shards so host/device copies can be asynchronous.
    """

    pin_memory: bool = True


def validate_mp_policy(policy: object) -> MixedPrecisionPolicy:
    if isinstance(policy, _TORCH_MIXED_PRECISION):
        policy = MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
                                      policy.cast_forward_inputs)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ArgumentTypeError(f"mp_policy must be a MixedPrecisionPolicy, got {_described(policy)}")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            kind = ReduceDtypeError if field == "reduce_dtype" else DtypeError
            raise kind(f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype or None, got {dtype!r}")
    return policy


def validate_offload_policy(policy: object) -> OffloadPolicy:
    if isinstance(policy, _TORCH_CPU_OFFLOAD):
        policy = CPUOffloadPolicy(policy.pin_memory)
    elif isinstance(policy, _TORCH_OFFLOAD):
        policy = OffloadPolicy()
    if not isinstance(policy, OffloadPolicy):
        raise ArgumentTypeError(f"offload_policy must be an OffloadPolicy, got {_described(policy)}")
    pin_memory = getattr(policy, "pin_memory", False)
    if not isinstance(pin_memory, bool):
        raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {type(pin_memory).__name__}")
    return policy


def _described(value: object) -> str:
    """A wrong argument's type, or the class itself when a class was passed where an instance goes."""
    if isinstance(value, type):
        return f"the class {value.__name__} (an instance is needed: {value.__name__}())"
    return type(value).__name__
