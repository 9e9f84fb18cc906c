"""Sharding on a dim other than 0 whose size the ranks do not divide, which torch's FSDP2 refuses: compact slots
([Note: Uneven cuts off dim 0] in layout.py), trained as the unsharded model trains, every local and unsharded
tensor contiguous."""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fullshard
from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedCommPolicy, fully_shard
from fullshard.errors import UnsupportedError
from fullshard.layout import ParamLayout
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import full_params, random_batches, regression_batch, run_parity, train


def columns(p: nn.Parameter) -> Shard | None:
    return Shard(1) if p.dim() == 2 else None


class ViewingLinear(nn.Linear):
    """Views its weight flat, which needs it contiguous."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.view(-1).view(self.weight.shape), self.bias)


class ViewingMLP(MLP):
    """``MLP`` (widths 7 -> 13 -> 5 -> 3: every weight's columns uneven on 2 and 4 ranks) of ``ViewingLinear``s."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViewingLinear(a, b) for a, b in ((7, 13), (13, 5), (5, 3)))


def shard_columns(kind: str, model: nn.Module) -> None:
    kwargs: dict[str, Any] = {"shard_placement_fn": columns}
    world_size = dist.get_world_size()
    if kind == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    elif kind == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif kind == "reshard_int":  # backward gathers from 2-rank slots: 13 columns cut 7 + 6 there, 4 + 4 + 4 + 1 here
        kwargs["reshard_after_forward"] = 2
    elif kind == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif kind == "quantized":
        kwargs["comm_policy"] = QuantizedCommPolicy(block_size=8)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def assert_compact(model: nn.Module, full: dict[str, torch.Tensor], exact: bool = True) -> None:
    """Every weight is Shard(1) with a contiguous local tensor holding this rank's columns (torch.chunk's rule) of
    ``full`` (bit for bit when ``exact``; else a reference trained apart, to float32 tolerance)."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        local = p.to_local()
        assert local.is_contiguous(), name
        if p.dim() == 2:
            assert p.placements[-1] == Shard(1), (name, p.placements)
        expected = distribute_tensor(full[name], p.device_mesh, p.placements, src_data_rank=None).to_local()
        assert local.shape == expected.shape, (name, local.shape, expected.shape)
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {}
        torch.testing.assert_close(local, expected, msg=lambda m: f"{name}: {m}", **tol)


def _train(rank: int, world_size: int, kind: str) -> None:
    tol = {"rtol": 2e-2, "atol": 2e-2} if kind in ("bf16", "quantized") else {}

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return mse_loss(model, batch).float()

    _, model = run_parity(rank, world_size, ViewingMLP, functools.partial(shard_columns, kind), regression_batch, loss,
                          **tol)
    assert_compact(model, full_params(model))


@pytest.mark.parametrize(("world_size", "kind"), [(2, "plain"), (4, "plain"), (4, "hsdp"), (2, "offload"),
                                                  (4, "reshard_int"), (2, "bf16"), (4, "quantized")])
def test_uneven_columns_train(world_size: int, kind: str) -> None:
    """Parity with the unsharded model; at 4 ranks the 5-column weight leaves rank 3 no columns."""
    run_ranks(world_size, _train, kind)


def test_compact_layout_arithmetic() -> None:
    assert ParamLayout((3, 5), 1, 2).compact and not ParamLayout((3, 6), 1, 2).compact
    assert not ParamLayout((5, 3), 0, 2).compact and not ParamLayout((), 0, 2).compact
    lay = ParamLayout((3, 5), 1, 4)  # 2 + 2 + 1 + 0 columns, slots of 6
    assert [lay.local_shape(r) for r in range(4)] == [(3, 2), (3, 2), (3, 1), (3, 0)] and lay.shard_numel == 6


def _optimizers_checkpoint_and_summon(rank: int, world_size: int, path: str) -> None:
    """torch's and fullshard's AdamW and clip_grad_norm_ match the unsharded model; a DCP checkpoint saved here
    loads at another world size (test below); summon_full_params writes changed values back."""
    torch.manual_seed(0)
    ref, model = ViewingMLP(), ViewingMLP()
    model.load_state_dict(ref.state_dict())
    shard_columns("plain", model)
    opts = [torch.optim.AdamW(ref.parameters(), lr=0.05), fullshard.optim.AdamW(model.parameters(), lr=0.05)]
    for batches in random_batches(3, world_size, regression_batch):
        (sum(mse_loss(ref, b) for b in batches) / world_size).backward()
        mse_loss(model, batches[rank]).backward()
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        norm = fullshard.clip_grad_norm_(model, 0.1)
        torch.testing.assert_close(norm.full_tensor() if isinstance(norm, DTensor) else norm, ref_norm)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[name].detach(), msg=lambda m: f"{name}: {m}")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    with fullshard.summon_full_params(model, writeback=True):
        for layer in model.layers:
            assert layer.weight.is_contiguous()
            layer.weight.data.mul_(2)
    assert_compact(model, {n: 2 * p.detach() if p.dim() == 2 else p.detach() for n, p in ref.named_parameters()},
                   exact=False)


def _resume(rank: int, world_size: int, path: str) -> None:
    torch.manual_seed(0)
    model = ViewingMLP()
    shard_columns("plain", model)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    torch.manual_seed(0)  # the saving run's values: the reference trained the same way
    ref = ViewingMLP()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for batches in random_batches(3, 2, regression_batch):
        (sum(mse_loss(ref, b) for b in batches) / 2).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    assert_compact(model, {n: p.detach() for n, p in ref.named_parameters()}, exact=False)
    train(model, random_batches(2, world_size, regression_batch, seed=7), mse_loss, rank=rank)  # and it trains on


def test_uneven_columns_optimizers_checkpoint_and_summon() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_ranks(2, _optimizers_checkpoint_and_summon, path)
        run_ranks(4, _resume, path)


def _refused(rank: int, world_size: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.test_extensions import RowInt8Weight

    layer = nn.Linear(5, 4)
    layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
    with pytest.raises(UnsupportedError, match="uneven sharding on dim 1 for an all-gather-extension parameter") as err:
        fully_shard(layer, shard_placement_fn=columns)
    assert isinstance(err.value, NotImplementedError)
    # an extension cut evenly on dim 1 (8 columns) is refused too, before anything changed: dim 0 then works
    layer = nn.Linear(8, 4)
    layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
    before = dict(layer.named_parameters())
    with pytest.raises(UnsupportedError, match="all-gather extensions are supported on dim-0 sharding"):
        fully_shard(layer, shard_placement_fn=columns)
    assert dict(layer.named_parameters()) == before and not isinstance(layer, fullshard.FSDPModule)
    fully_shard(layer)
    layer(torch.zeros(2, 8)).sum().backward()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(5, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})  # local (2, 5): 5 columns over 2 dp ranks
    with pytest.raises(UnsupportedError, match="uneven sharding on dim 1 for a tensor-parallel parameter"):
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=columns)


def test_uneven_columns_refused_for_tensor_parallel_and_extensions() -> None:
    run_ranks(4, _refused)
