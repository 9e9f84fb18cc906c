"""Checkpoints that are complete or absent, on top of ``torch.distributed.checkpoint`` (DCP).

[Note: Atomic checkpoints]
``save`` writes into ``PATH.partial`` and only then swaps it into place: the
old ``PATH`` becomes ``PATH.previous``, ``PATH.partial`` becomes ``PATH``, and
``PATH.previous`` is deleted. A save killed at any point leaves either the old
checkpoint at ``PATH`` or, killed between the two renames, at
``PATH.previous``, where ``load`` finds it. DCP writes its ``.metadata`` file
last, so a directory without one is never treated as a checkpoint. All ranks
must see the same file system (as DCP itself requires).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def is_complete(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ".metadata").is_file()


def complete_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path``, or its ``.previous`` copy left by a save interrupted while swapping; else ``FileNotFoundError``."""
    path = Path(path)
    for candidate in (path, _sibling(path, PREVIOUS_SUFFIX)):
        if is_complete(candidate):
            return candidate
    raise FileNotFoundError(f"no complete checkpoint at {path} (a checkpoint directory holds a .metadata file)")


def save(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Save ``state`` (e.g. ``{"model": model.state_dict(), "optim": ...}``) to ``path`` atomically. Collective."""
    path = Path(path)
    partial, previous = _sibling(path, PARTIAL_SUFFIX), _sibling(path, PREVIOUS_SUFFIX)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=partial, no_dist=not dist.is_initialized())
    _barrier()
    if _rank() == 0:
        if path.exists():
            shutil.rmtree(previous, ignore_errors=True)
            path.rename(previous)
        partial.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()
    return path


def load(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Load ``path`` into ``state`` in place (resharding as needed); raise if it does not match. Collective.

    Every tensor ``state`` asks for must be in the checkpoint, and every tensor
    the checkpoint holds under the same top-level keys must be asked for:
    otherwise ``ValueError`` names the missing and the unexpected keys.
    """
    found = complete_checkpoint(path)
    metadata = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
    wanted = set(tensor_keys(state))
    stored = {k for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    sections = {key.split(".", 1)[0] for key in wanted}
    missing = sorted(wanted - set(metadata))
    unexpected = sorted(k for k in stored - wanted if k.split(".", 1)[0] in sections)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {found} does not match what is being loaded: "
            f"missing keys {_preview(missing)}, unexpected keys {_preview(unexpected)}"
        )
    dcp.load(state, checkpoint_id=found, no_dist=not dist.is_initialized())
    return found


def tensor_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the tensors in nested dicts, the way DCP names them."""
    keys = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            keys.append(name)
        elif isinstance(value, Mapping):
            keys.extend(tensor_keys(value, name + "."))
    return keys


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"[{shown}{more}]"
