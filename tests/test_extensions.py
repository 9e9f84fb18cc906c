"""Extension points FSDP2 offers: custom all-gather / reduce-scatter comms and tensor-subclass all-gather hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss, mse_loss
from tests.parity import random_batches, regression_batch, run_parity, token_batch
from tests.wrapper_weight import WrapperWeight


class CountingAllocations:
    """torch's Comm ``allocate``, counting the sizes asked for; subclasses count their calls."""

    def __init__(self) -> None:
        self.allocated: list[tuple[int, ...]] = []
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(CountingAllocations, AllGather):
    """torch's AllGather interface: allocates the output, runs the collective; counts both."""

    # keyword-only: FSDP2 calls torch's AllGather protocol by keyword
    def __call__(self, *, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(CountingAllocations, ReduceScatter):

    def __call__(self, *, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
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
    # 1-D sizes, as FSDP2 asks: the reduce-scatter input is every rank's shard (rank-major), the output one shard
    assert all(len(size) == 1 for size in comms["ag"].allocated + comms["rs"].allocated)
    assert comms["rs"].allocated[0][0] == world_size * comms["rs"].allocated[1][0]


def test_custom_all_gather_and_reduce_scatter() -> None:
    run_ranks(2, _custom_comms)


class AveragingReduceScatter(CountingAllocations, ReduceScatter):
    """Averages whatever ``op`` says (a comm written for FSDP2's ``AVG``), and records the ops it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.ops.append(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.AVG, group=group,
                                          async_op=async_op)


def _custom_reduce_scatter_ops(rank: int, world_size: int, reduce_dtype: torch.dtype | None, hsdp_factor: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp_factor else None
    runs = []
    for shard, policy in ((fully_shard, fullshard.MixedPrecisionPolicy), (torch_fully_shard, TorchPolicy)):
        torch.manual_seed(0)
        model = Transformer()
        mp = policy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            shard(block, mp_policy=mp, mesh=mesh)
        shard(model, mp_policy=mp, mesh=mesh)
        comm = AveragingReduceScatter()
        for block in model.blocks:
            block.set_custom_reduce_scatter(comm)
            if hsdp_factor:  # the shard group's size: FSDP2 averages in the reduce-scatter only
                block.set_gradient_divide_factor(2.0)
        for step_batches in random_batches(2, world_size, token_batch):
            lm_loss(model, step_batches[rank]).backward()
        runs.append((comm.ops, [p.grad.to_local() for p in model.parameters()]))
    (ours, our_grads), (theirs, their_grads) = runs
    assert ours == theirs and len(ours) == 2 * len(model.blocks), (ours, theirs)
    for mine, other in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, other, rtol=0, atol=0)


@pytest.mark.parametrize("reduce_dtype,hsdp_factor", [(None, False), (torch.bfloat16, False), (None, True)],
                         ids=["fp32", "bf16", "hsdp-factor"])
def test_custom_reduce_scatter_gets_the_op_fsdp2_gives(reduce_dtype: torch.dtype | None, hsdp_factor: bool) -> None:
    """The comm gets FSDP2's op (``AVG``) and fullshard does not divide again: a comm that averages regardless
    gives FSDP2's gradients bit for bit (also on a 2 x 2 HSDP mesh with a divide factor of the shard size)."""
    run_ranks(4 if hsdp_factor else 2, _custom_reduce_scatter_ops, reduce_dtype, hsdp_factor)


# ---- tensor-subclass all-gather hooks -------------------------------------------------------------------


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8), scale


class RowInt8Weight(WrapperWeight):
    """Test-only: an fp32 weight that all-gathers as int8 rows with an fp32 scale per row (FSDP2's hooks)."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> Any:
        return quantize_rows(self._data), None

    def fsdp_post_all_gather(self, outputs: Any, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
        q, scale = outputs
        w = q.to(param_dtype) * scale.to(param_dtype).unsqueeze(1)
        if out is not None:
            out.copy_(w[: out.shape[0]])
            return None
        return w, (w,)


class QLinear(nn.Linear):
    """The reference's layer: per-row int8 fake quantization of the weight (straight-through gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, DTensor) and self.fake_quant:
            q, scale = quantize_rows(w.detach())
            w = w + (q.to(w.dtype) * scale.unsqueeze(1) - w).detach()
        return F.linear(x, w, self.bias)

    fake_quant = True


def qmlp() -> nn.Module:
    return nn.Sequential(QLinear(7, 13), nn.ReLU(), QLinear(13, 5), nn.ReLU(), QLinear(5, 3))


def _record_bytes() -> tuple[list[int], Any]:
    sizes: list[int] = []
    orig = dist.all_gather_single

    def recording(output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        sizes.append(inp.numel() * inp.element_size())
        return orig(output, inp, **kwargs)

    dist.all_gather_single = recording  # type: ignore[assignment]
    return sizes, orig


def _subclass_parity(rank: int, world_size: int, reshard_after_forward: bool) -> None:
    def shard(model: nn.Module) -> None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
                fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model)

    sizes, orig = _record_bytes()
    try:
        trace, model = run_parity(rank, world_size, qmlp, shard, regression_batch, mse_loss, steps=4, rtol=1e-5, atol=1e-6)
    finally:
        dist.all_gather_single = orig  # type: ignore[assignment]
    weight = model[0].weight
    assert isinstance(weight, DTensor) and isinstance(weight.to_local(), RowInt8Weight)
    mse_loss(model, regression_batch(torch.Generator().manual_seed(rank))).backward()
    assert type(weight.grad.to_local()) is torch.Tensor and weight.grad.dtype == torch.float32
    # layer 0's all-gather: 7 rows of 7 int8 + 7 fp32 scales per rank (13 rows padded to 14 / 4 ranks -> 4 rows)
    rows = -(-13 // world_size)
    expected = -(-rows * 7 // 16) * 16 + -(-rows * 4 // 16) * 16 + 16 * (-(-rows * 4 // 16))  # q, scale, bias
    assert expected in sizes, (expected, sorted(set(sizes)))
    fp32_bytes = rows * 7 * 4 + rows * 4
    assert expected < 0.6 * fp32_bytes


class OffsetAllGather(CountingAllGather):
    """A custom all-gather whose ``allocate`` returns a view one element into its buffer (a pooled allocator's
    slice), so a packed output does not start on an aligned byte."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append(tuple(size))
        return torch.empty(size[0] + 1, dtype=dtype, device=device)[1:]


def _packed_custom_all_gather(rank: int, world_size: int) -> None:
    comms: list[OffsetAllGather] = []

    def shard(model: nn.Module) -> None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
                fully_shard(layer)
                comms.append(OffsetAllGather())
                layer.set_custom_all_gather(comms[-1])
        fully_shard(model)

    run_parity(rank, world_size, qmlp, shard, regression_batch, mse_loss, steps=3, rtol=1e-5, atol=1e-6)
    assert all(c.calls == 2 * 3 for c in comms)  # forward and backward, 3 steps


def test_packed_all_gather_with_an_unaligned_custom_allocation() -> None:
    run_ranks(2, _packed_custom_all_gather)


@pytest.mark.parametrize("world_size,reshard_after_forward", [(2, True), (4, False)])
def test_tensor_subclass_all_gather_hooks_parity(world_size: int, reshard_after_forward: bool) -> None:
    run_ranks(world_size, _subclass_parity, reshard_after_forward)


class SharedQLayer(nn.Module):
    """Two blocks sharing one quantized layer (its weight all-gathers through the extension's hooks)."""

    def __init__(self) -> None:
        super().__init__()
        shared = QLinear(6, 6)
        self.a = nn.Sequential(QLinear(6, 6), nn.Tanh(), shared)
        self.b = nn.Sequential(shared, nn.Tanh(), QLinear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _shared_extension_weight(rank: int, world_size: int) -> None:
    def shard(model: SharedQLayer) -> None:
        for layer in dict.fromkeys(m for m in model.modules() if isinstance(m, QLinear)):
            layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)  # takes the shared layer over from a's group: its rows are a's shards' local rows

    run_parity(rank, world_size, SharedQLayer, shard, lambda g: regression_batch(g, 6, 3), mse_loss, rtol=1e-5, atol=1e-6)


def test_extension_weight_shared_by_two_calls() -> None:
    run_ranks(2, _shared_extension_weight)


def _subclass_to_empty(rank: int, world_size: int) -> None:
    """``to_empty()`` after sharding a model that has real values (then a load), with a shard of no rows (the last
    layer's 3 rows on 4 ranks): every rank keeps the subclass, and it trains as the unsharded model."""
    def shard(model: nn.Module) -> None:
        values = {k: v.clone() for k, v in model.state_dict().items()}
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
                fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.load_state_dict(values)

    _, model = run_parity(rank, world_size, qmlp, shard, regression_batch, mse_loss, steps=3, rtol=1e-5, atol=1e-6)
    assert all(isinstance(layer.weight.to_local(), RowInt8Weight) for layer in model if isinstance(layer, nn.Linear))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_subclass_kept_through_to_empty(world_size: int) -> None:
    run_ranks(world_size, _subclass_to_empty)
