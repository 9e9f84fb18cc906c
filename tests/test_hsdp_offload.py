"""HSDP on a 2-D (replicate, shard) mesh, replicate-only (DDP-like) meshes, and CPU offload."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import Replicate, Shard

from fullshard import CPUOffloadPolicy, UsageError, fully_shard
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import random_batches, run_parity, token_batch


def shard_on_mesh(shape: tuple[int, int], model: nn.Module) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _hsdp(rank: int, world_size: int, shape: tuple[int, int]) -> None:
    _, model = run_parity(rank, world_size, Transformer, functools.partial(shard_on_mesh, shape), token_batch, lm_loss)
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), Shard(0)), name
        assert p.device_mesh.shape == shape
    rec = CommRecorder(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    n_groups, n_blocks = 3, 2
    sharded = shape[1] > 1
    assert rec.count("ag") == (n_groups + n_blocks if sharded else 0), rec.events
    assert rec.count("rs") == (n_groups if sharded else 0), rec.events
    assert rec.count("ar") == n_groups, rec.events  # one all-reduce across replicas per group


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)], ids=["2x2", "4x1_ddp"])
def test_hsdp_parity(shape: tuple[int, int]) -> None:
    run_ranks(4, _hsdp, shape)


def _unnamed_2d_mesh(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    with pytest.raises(UsageError, match="init the 2D mesh for HSDP with mesh_dim_names"):
        fully_shard(nn.Linear(2, 2), mesh=mesh)


def test_2d_mesh_needs_names() -> None:
    run_ranks(4, _unnamed_2d_mesh)


def shard_offloaded(model: nn.Module) -> None:
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)


def _offload(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Transformer, shard_offloaded, token_batch, lm_loss)
    for name, p in model.named_parameters():
        assert p.to_local().device.type == "cpu", name
    group = state_of(model.blocks[0]).group
    assert group.shard_device.type == "cpu"


def test_cpu_offload_parity() -> None:
    run_ranks(2, _offload)


def shard_replicate_only(model: nn.Module) -> None:
    """HSDP whose shard groups are one rank each: DDP on plain parameters."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _replicate_only(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Transformer, shard_replicate_only, token_batch, lm_loss)
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), Shard(0)) and p.to_local().shape == p.shape, name
    rec = CommRecorder(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    rec.close()
    assert rec.count("ag") == 0 and rec.count("rs") == 0, rec.events
    assert rec.count("ar") == 3, rec.events
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="Mesh dim name 'tp' not found"):
        fully_shard(nn.Linear(2, 2), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="tp"))


def test_one_rank_shards_are_ddp() -> None:
    run_ranks(2, _replicate_only)
