"""Run code written for torch's FSDP2 (torchtitan, torchtune, Accelerate, transformers) on fullshard, unedited.

Frameworks import ``fully_shard`` and its companions from ``torch.distributed.fsdp`` (or the older
``torch.distributed._composable.fsdp``). :func:`use_as_fsdp2` points those names at fullshard's, so a
framework that imports them afterwards shards with fullshard. Three ways to use it:

- as a launcher, also under ``torchrun`` (the rest of the command line is the program to run, as
  ``python`` would take it)::

      torchrun --nproc-per-node 8 -m fullshard.as_fsdp2 -m torchtitan.train --job.config_file llama3_8b.toml
      torchrun --nproc-per-node 8 -m fullshard.as_fsdp2 train.py --lr 3e-4

- as a call at the top of a training script, before the framework is imported::

      import fullshard
      fullshard.use_as_fsdp2()
      from accelerate import Accelerator

- as a context manager, which puts torch's names back on exit::

      with fullshard.use_as_fsdp2():
          ...

torch's own FSDP2 modules (``torch.distributed.fsdp._fully_shard``) are left alone. Rank 0 (or a
process outside any launcher) says once on stderr that the names were swapped; a module that had
already taken torch's names (imported before the swap) is named in a warning, since it keeps
torch's FSDP2.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from typing import Any

import fullshard

# The FSDP2 names frameworks import, and the public modules they import them from.
NAMES = (
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle",
    "register_fsdp_forward_method", "share_comm_ctx", "DataParallelMeshDims",
)
MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
# torch's own modules that import those names and treat an FSDPModule stage as FSDP2's (its micro-batches
# without gradient sync, one reduction at the end; [Note: Pipeline schedules] in runtime.py): when they were
# imported first, their FSDPModule becomes both classes (they only test isinstance), so stages sharded by
# fullshard, by torch's FSDP2 or by torch's replicate() are all recognised, and their fully_shard becomes
# fullshard's, whose ``state`` answers for torch's modules with torch's own state. A module imported while
# the names are swapped keeps fullshard's names after restore(), as any importer does.
USERS_IN_TORCH = (
    "torch.distributed.pipelining.stage",
    "torch.distributed.pipelining.schedules",
)


class Swap:
    """What :func:`use_as_fsdp2` replaced; ``restore()`` (or leaving the ``with`` block) puts it back."""

    def __init__(self, replaced: list[tuple[types.ModuleType, str, Any]]) -> None:
        self.replaced = replaced

    def restore(self) -> None:
        for module, name, value in reversed(self.replaced):
            setattr(module, name, value)
        self.replaced = []
        _active.remove(self)

    def __enter__(self) -> Swap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


_active: list[Swap] = []


def use_as_fsdp2(*, announce: bool = True) -> Swap:
    """Point torch's public FSDP2 names at fullshard's (see the module docstring). Idempotent.

    ``announce``: say so once on stderr, on rank 0 only. Returns a :class:`Swap` that can restore
    torch's names (also as a context manager).
    """
    if not isinstance(announce, bool):
        raise TypeError(f"use_as_fsdp2: announce must be a bool, got {type(announce).__name__}")
    replaced: list[tuple[types.ModuleType, str, Any]] = []
    originals: dict[int, str] = {}
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an older or newer torch without this path
            continue
        for name in NAMES:
            ours = getattr(fullshard, name, None)
            theirs = getattr(module, name, None)
            if ours is None or theirs is None or theirs is ours:
                continue
            originals[id(theirs)] = name
            replaced.append((module, name, theirs))
            setattr(module, name, ours)
    for user in filter(None, map(sys.modules.get, USERS_IN_TORCH)):
        for name in NAMES:
            theirs = getattr(user, name, None)
            if theirs is not None and id(theirs) in originals:
                replaced.append((user, name, theirs))
                ours = getattr(fullshard, name)
                setattr(user, name, (ours, theirs) if name == "FSDPModule" else ours)
    swap = Swap(replaced)
    _active.append(swap)
    if replaced:
        _warn_earlier_importers(originals)
        if announce and _is_rank_zero():
            names = ", ".join(sorted({name for _, name, _ in replaced}))
            print(f"fullshard {_version()}: torch.distributed.fsdp's FSDP2 names ({names}) now point at fullshard",
                  file=sys.stderr, flush=True)
    return swap


def _warn_earlier_importers(originals: dict[int, str]) -> None:
    """Name the modules outside torch that hold torch's FSDP2 objects: they imported them before the swap."""
    holders = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name == "torch" or module_name.startswith(("torch.", "fullshard")):
            continue
        try:
            names = {originals[id(v)] for v in vars(module).values() if id(v) in originals}
        except TypeError:  # a module object without a __dict__
            continue
        if names:
            holders.append(f"{module_name} ({', '.join(sorted(names))})")
    if holders:
        warnings.warn(
            "these modules imported torch's FSDP2 names before fullshard.use_as_fsdp2() and keep torch's FSDP2: "
            f"{'; '.join(holders)}; call use_as_fsdp2() (or launch with python -m fullshard.as_fsdp2) before "
            "importing them", stacklevel=3,
        )


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fullshard")
    except Exception:  # running from a source tree that is not installed
        return "(source)"
