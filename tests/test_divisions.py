"""Gradient divisions: at 2 and 4 ranks the reduced gradients equal torch's FSDP2 bit for bit in every reduce dtype.

fp16 divides part before the sum (a power of two) and the rest after, as torch's FSDP2 does, so the
sum cannot overflow and the result rounds as FSDP2's does; fp32 and bf16 sum and divide once.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.reduce import split_division
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import random_batches, regression_batch


class _Group:
    """What torch's factor function reads of a process group: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_split_division_as_torch() -> None:
    """fp16's divide-before / divide-after for 1..16 ranks and custom factors, against a table and torch's own."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    table = {1: (1.0, 1.0), 2: (2.0, 1.0), 3: (2.0, 1.5), 4: (2.0, 2.0), 5: (2.0, 2.5), 6: (4.0, 1.5), 8: (4.0, 2.0),
             12: (4.0, 3.0), 16: (4.0, 4.0), 0.5: (1.0, 0.5), 2.5: (1.0, 2.5), 24.0: (8.0, 3.0), 64.0: (8.0, 8.0)}
    for factor, expected in table.items():
        assert split_division(factor) == expected, factor
    customs = [0.5, 1.0, 2.5, 3.0, 7.0, 24.0, 64.0, 100.0, 1e-3]
    for shard in range(1, 17):
        for replicate in (None, 2):
            for custom in [None, *customs]:
                shard_group: Any = _Group(shard)
                replicate_group: Any = None if replicate is None else _Group(replicate)
                pre, post, _, _ = _get_gradient_divide_factors(shard_group, replicate_group, torch.float16, "cpu", custom)
                total = custom if custom is not None else float(shard * (replicate or 1))
                before, after = split_division(total)
                assert (before, after) == (pre, post), (shard, replicate, custom)
                assert before * after == pytest.approx(total, rel=1e-15)
                assert math.log2(before).is_integer()


def _grads(rank: int, world_size: int, reduce_dtype: torch.dtype, hsdp: bool, factor: float | None) -> dict[str, Any]:
    """The sharded gradients of fullshard and of torch's FSDP2, same model and data, two steps."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    param_dtype = torch.float16 if reduce_dtype == torch.float16 else torch.bfloat16
    models = []
    for shard, policy in ((fullshard.fully_shard, fullshard.MixedPrecisionPolicy),
                          (torch_fully_shard, TorchMixedPrecisionPolicy)):
        torch.manual_seed(0)
        model = MLP((7, 33, 29, 3))
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        shard(model, mesh=mesh, mp_policy=policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        if factor is not None:
            for module in model.modules():
                if isinstance(module, (fullshard.FSDPModule, TorchFSDPModule)):
                    module.set_gradient_divide_factor(factor)
        models.append(model)
    for step, step_batches in enumerate(random_batches(2, world_size, regression_batch)):
        x, y = step_batches[rank]
        for model in models:
            (mse_loss(model, (x, y)) * 100).backward()  # gradients with many significant bits at fp16
        for (name, ours), theirs in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            assert isinstance(ours.grad, DTensor) and isinstance(theirs.grad, DTensor), name
            assert ours.grad.placements == theirs.grad.placements, name
            torch.testing.assert_close(ours.grad.to_local(), theirs.grad.to_local(), rtol=0, atol=0,
                                       msg=lambda m: f"step {step} {name}: {m}")
        for model in models:
            for p in model.parameters():
                p.grad = None
    return {}


CASES = [  # world size, HSDP, custom factor
    (2, False, None), (2, False, 3.0), (4, False, None), (4, False, 6.0), (4, True, None), (4, True, 8.0),
    (2, False, -3.0),  # a negative factor flips the gradients' sign, as in FSDP2
]


@pytest.mark.parametrize("world_size,hsdp,factor", CASES)
def test_fp16_gradients_equal_torch_bit_for_bit(world_size: int, hsdp: bool, factor: float | None) -> None:
    """fp16 divides by a power of two before the sum and the rest after, as torch's FSDP2 (was sqrt before and after)."""
    run_ranks(world_size, _grads, torch.float16, hsdp, factor)


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float32, torch.float64], ids=["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("world_size,hsdp,factor", [(2, False, None), (2, False, 3.0), (4, True, None)])
def test_other_reduce_dtypes_equal_torch_bit_for_bit(reduce_dtype: torch.dtype, world_size: int, hsdp: bool,
                                                     factor: float | None) -> None:
    """bf16 and fp32 sum and divide once after; fp64 is split as fp16 is (as in torch's FSDP2)."""
    if factor is not None and reduce_dtype != torch.float64:
        pytest.skip("torch's FSDP2 reduces with PREMUL_SUM here, which gloo does not have")
    run_ranks(world_size, _grads, reduce_dtype, hsdp, factor)
