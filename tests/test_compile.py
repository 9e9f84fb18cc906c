"""torch.compile: compiled blocks and a compiled whole model train with parity; fullshard's hooks stay out of the graphs."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fullshard import fully_shard
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import run_parity, token_batch

TOL = {"rtol": 1e-4, "atol": 1e-5}  # inductor fuses and reorders float ops


def _compiled_blocks(rank: int, world_size: int) -> dict[str, int]:
    torch._dynamo.reset()
    counters.clear()

    def shard(model: Transformer) -> None:
        for block in model.blocks:
            fully_shard(block)
            block.compile()
        fully_shard(model)

    run_parity(rank, world_size, Transformer, shard, token_batch, lm_loss, steps=3, **TOL)
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def test_compiled_blocks_parity_one_graph_no_breaks() -> None:
    for result in run_ranks(2, _compiled_blocks, timeout=300):
        # both blocks run the same code: one graph, reused; the hooks (collectives, waits) are not in it
        assert result == {"graphs": 1, "breaks": 0}, result


def _compiled_model(rank: int, world_size: int, reshard_after_forward: bool) -> int:
    torch._dynamo.reset()
    counters.clear()

    def shard(model: Transformer) -> None:
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model)
        model.compile()  # torch.compile of the whole model, default backend

    run_parity(rank, world_size, lambda: Transformer(n_blocks=1), shard, token_batch, lm_loss, steps=3, **TOL)
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("reshard_after_forward", [True])
def test_compiled_whole_model_parity(reshard_after_forward: bool) -> None:
    # The root's and the block's hooks run eagerly between compiled pieces (a graph break at each FSDP module).
    breaks = run_ranks(4, _compiled_model, reshard_after_forward, timeout=300)
    print(f"graph breaks per rank: {breaks}")
