"""Exception types shared by the package.

Where torch's FSDP2 raises another type for the same mistake, fullshard raises
a class that is both: code written for FSDP2 catches it, and so does code that
catches this package's documented type.
"""

from __future__ import annotations


class UsageError(ValueError, AssertionError):
    """Misuse that torch's FSDP2 reports with ``AssertionError``.

    Both a ``ValueError`` (what misuse raises in this package) and an
    ``AssertionError`` (what code written for FSDP2 may catch).
    """


class AlreadyShardedError(UsageError):
    """``fully_shard`` was applied to a module twice."""


class UnsupportedError(ValueError, NotImplementedError):
    """A model that torch's FSDP2 rejects with ``NotImplementedError`` (also a ``ValueError``)."""


class MetaParameterError(ValueError, RuntimeError):
    """A parameter still on the meta device at the first forward (FSDP2 raises ``RuntimeError``)."""


class ArgumentTypeError(TypeError, AttributeError):
    """An argument of the wrong type: a tensor where a module goes, a string for a mesh, another object for a
    policy. FSDP2 fails on it with ``AttributeError`` where it first uses it (also a ``TypeError``)."""


class EmptyModulesError(ValueError, IndexError):
    """``fully_shard([])`` (FSDP2 raises ``IndexError``)."""


class DtypeError(ValueError, RuntimeError):
    """A policy dtype that is not a floating-point dtype (FSDP2 fails with ``RuntimeError`` at the first forward)."""


class ZeroDivisorError(ValueError, ZeroDivisionError):
    """A gradient divide factor of zero (FSDP2 raises ``ZeroDivisionError`` when it reduces)."""


class ReduceDtypeError(DtypeError, TypeError):
    """A ``reduce_dtype`` that is not a floating-point dtype (FSDP2 fails with ``TypeError`` at the first reduction)."""


class ShardedElsewhereError(ValueError, TypeError):
    """``fully_shard`` on a module whose parameter is sharded over the mesh already: by another call (a child after
    its parent; FSDP2 raises ``TypeError``), or as a ``DTensor`` on that mesh itself (:class:`OverlappingMeshError`)."""


class OverlappingMeshError(ShardedElsewhereError, RuntimeError):
    """A ``DTensor`` parameter on (axes of) the mesh ``fully_shard`` shards over, or ``dp_mesh_dims`` naming an axis
    twice (FSDP2 raises ``RuntimeError``: the meshes overlap)."""


class UnnamedMeshError(ValueError, TypeError):
    """A tensor-parallel parameter beside a data-parallel mesh without axis names (FSDP2 fails with ``TypeError``)."""


def expect_bool(where: str, name: str, value: object) -> bool:
    """``value`` as a bool when it is one (numpy's too); else ``TypeError`` naming the argument (``where``: the
    function). FSDP2 reads any object's truth instead: ``None`` as ``False``, the string ``"False"`` as ``True``."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}")


def expect_divisor(where: str, name: str, value: object) -> float:
    """``value`` as a float when it is a finite nonzero number (negative ones flip the sign, as in FSDP2); else
    ``TypeError`` / ``ValueError`` naming it, a ``ZeroDivisionError`` too for zero (FSDP2's, at the reduction)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    if value == 0:
        raise ZeroDivisorError(f"{where}: {name} must not be zero")
    if not abs(value) < float("inf"):
        raise ValueError(f"{where}: {name} must be a finite number, got {value}")
    return float(value)


def expect_optimizer(where: str, value: object) -> None:
    """``TypeError`` unless ``value`` is a ``torch.optim.Optimizer``."""
    import torch

    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{where}: optim must be a torch.optim.Optimizer, got {type(value).__name__}")


def expect_module(where: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an ``nn.Module``."""
    from torch import nn

    if not isinstance(value, nn.Module):
        raise TypeError(f"{where} expects an nn.Module, got {type(value).__name__}")
