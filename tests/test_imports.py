"""Imports flow one way: a parameter group imports its codecs and its gradient reduction, never the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

from torch import nn

import fullshard
from fullshard.codec import CodecGroup
from fullshard.reduce import ReduceGroup
from fullshard.runtime import state_of
from tests.harness import run_ranks

PACKAGE = Path(fullshard.__file__).parent


def imported_modules(name: str) -> set[str]:
    """Every fullshard module ``fullshard.<name>`` imports, also under ``if TYPE_CHECKING:`` or inside functions."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.split(".")[0] == "fullshard"}


def test_codec_and_reduce_do_not_import_group() -> None:
    """codec.py and reduce.py typed the group against fullshard.group (a circle with group's imports of them)."""
    assert {"fullshard.codec", "fullshard.reduce"} <= imported_modules("group")
    for name in ("codec", "reduce"):
        assert "fullshard.group" not in imported_modules(name), name


def _members(protocol: type) -> list[str]:
    return [n for n in vars(protocol) if not n.startswith("_")]


def _group_provides_protocols(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    fullshard.fully_shard(model)
    state = state_of(model)
    assert state is not None and state.group is not None
    group = state.group
    for protocol in (CodecGroup, ReduceGroup):
        members = _members(protocol)
        assert members, protocol.__name__
        missing = [n for n in members if not hasattr(group, n)]
        assert not missing, f"ParamGroup lacks {protocol.__name__} members {missing}"


def test_param_group_provides_what_codecs_and_reduction_read() -> None:
    run_ranks(2, _group_provides_protocols)
