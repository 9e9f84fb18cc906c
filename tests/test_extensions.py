"""Extension points FSDP2 offers: custom all-gather / reduce-scatter comms and tensor-subclass all-gather hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from fullshard import fully_shard
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import run_parity, token_batch


class CountingAllGather(AllGather):
    """torch's AllGather interface: allocates the output, runs the collective; counts both."""

    def __init__(self) -> None:
        self.allocated: list[tuple[int, ...]] = []
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    def __init__(self) -> None:
        self.allocated: list[tuple[int, ...]] = []
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms(rank: int, world_size: int) -> None:
    comms: dict[str, Any] = {}

    def shard(model: Transformer) -> None:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        comms["ag"], comms["rs"] = CountingAllGather(), CountingReduceScatter()
        model.blocks[0].set_custom_all_gather(comms["ag"])  # this module's group only, as in FSDP2
        model.blocks[0].set_custom_reduce_scatter(comms["rs"])

    steps = 3
    run_parity(rank, world_size, Transformer, shard, token_batch, lm_loss, steps=steps)
    # blocks.0: all-gathered in forward and again in backward, reduced once per step
    assert comms["ag"].calls == 2 * steps and len(comms["ag"].allocated) == 2 * steps
    assert comms["rs"].calls == steps and len(comms["rs"].allocated) == 2 * steps  # input and output
    assert comms["rs"].allocated[0][0] == world_size  # rank-major input


def test_custom_all_gather_and_reduce_scatter() -> None:
    run_ranks(2, _custom_comms)
