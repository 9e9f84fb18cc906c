"""Sharded training equals single-process training: MLP and a small transformer at 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest
from torch import nn

from fullshard import fully_shard
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import regression_batch, run_parity, token_batch


def shard_each(children_attr: str):  # type: ignore[no-untyped-def]
    """``fully_shard`` every module of ``model.<children_attr>``, then the root."""

    def shard(model: nn.Module) -> None:
        for child in getattr(model, children_attr):
            fully_shard(child)
        fully_shard(model)

    return shard


def shard_mlp(model: nn.Module) -> None:
    shard_each("layers")(model)


def shard_transformer(model: nn.Module) -> None:
    shard_each("blocks")(model)


def _mlp(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, MLP, shard_mlp, regression_batch, mse_loss)


def _transformer(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, Transformer, shard_transformer, token_batch, lm_loss)


def _root_only(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, Transformer, fully_shard, token_batch, lm_loss)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mlp_parity(world_size: int) -> None:
    run_ranks(world_size, _mlp)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformer_parity(world_size: int) -> None:
    run_ranks(world_size, _transformer)


@pytest.mark.parametrize("world_size", [2])
def test_root_only_parity(world_size: int) -> None:
    run_ranks(world_size, _root_only)
