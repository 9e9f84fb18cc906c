"""Code written for torch's FSDP2 keeps working: its exception types and messages, and what it tolerates.

Where FSDP2 raises a type other than this package's documented one, fullshard
raises a class that is both; where user code matches FSDP2's message, ours
contains it. A failed ``fully_shard`` leaves the module as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fullshard import FSDPModule, fully_shard
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import assert_parity, random_batches, regression_batch, token_batch, train


def _assert_untouched(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert not isinstance(module, FSDPModule)
    for name, p in module.named_parameters():
        assert not isinstance(p, DTensor), name
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)


def _fsdp2_exceptions(rank: int, world_size: int) -> None:
    model = MLP()
    fully_shard(model)
    with pytest.raises(AssertionError, match="Each distinct composable distributed API can only be applied to a module once."):
        fully_shard(model)
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(model)

    # Shard(1) of a 1-D bias: AssertionError (and ValueError), the module left alone.
    linear = nn.Linear(16, 16)
    before = {n: p.detach().clone() for n, p in linear.named_parameters()}
    with pytest.raises(AssertionError, match="Shard dim 1 is invalid for 1D tensor") as bad_dim:
        fully_shard(linear, shard_placement_fn=lambda p: Shard(1))
    assert isinstance(bad_dim.value, ValueError)
    with pytest.raises(AssertionError, match=r"Shard dim -3 is invalid for 2D tensor.*'weight'"):
        fully_shard(linear, shard_placement_fn=lambda p: Shard(-3))
    _assert_untouched(linear, before)

    # Uneven sharding on a dim other than 0: NotImplementedError (and ValueError).
    with pytest.raises(NotImplementedError, match="FSDP does not support uneven sharding on dim 1") as uneven:
        fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    assert isinstance(uneven.value, ValueError)

    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    before = {n: p.detach().clone() for n, p in conv.named_parameters()}
    with pytest.raises(NotImplementedError, match=r"FSDP does not support non-contiguous parameters.*'weight'"):
        fully_shard(conv)
    _assert_untouched(conv, before)
    fully_shard(conv.to(memory_format=torch.contiguous_format))  # the fix the message suggests works

    with torch.device("meta"):
        never = MLP()
    fully_shard(never)
    # FSDP2 raises RuntimeError here; code that catches it keeps working.
    with pytest.raises(RuntimeError, match=r"still on the meta device \(layers.0.weight"):
        never(torch.zeros(2, 7))


def test_fsdp2_exception_types_and_messages() -> None:
    run_ranks(2, _fsdp2_exceptions)


# ---- a parameter tied across two groups is never silently untied ------------------------------------


def _tie_across_groups(rank: int, world_size: int, layout: str) -> None:
    model = Transformer()  # head.weight is tok.weight
    fully_shard(model.tok)
    if layout == "siblings":
        fully_shard(model.head)
    fully_shard(model)  # "nested": the tie's other user is left to the root
    tokens = token_batch(torch.Generator().manual_seed(0))
    # As with FSDP2, at lazy init (the first forward), on every rank, naming both parameters.
    with pytest.raises(ValueError, match=r"Parameter 'head.weight' is shared with 'tok.weight', a parameter already managed by"):
        lm_loss(model, tokens)


def _tie_made_after_fully_shard(rank: int, world_size: int) -> None:
    model = Transformer()
    model.head.weight = nn.Parameter(torch.randn(37, 12))
    fully_shard(model.tok)
    model.head.weight = model.tok.weight  # the sharded DTensor of the tok group
    with pytest.raises(ValueError, match=r"'head.weight' is the sharded parameter of 'tok.weight', already managed by another"):
        fully_shard(model)


@pytest.mark.parametrize("layout", ["siblings", "nested"])
def test_tie_across_groups_is_an_error(layout: str) -> None:
    run_ranks(2, _tie_across_groups, layout)


def test_tie_made_after_fully_shard_is_an_error() -> None:
    run_ranks(2, _tie_made_after_fully_shard)


def _layer_by_layer(rank: int, world_size: int) -> None:
    # Materialise, shard and drop blocks one by one: ids of freed originals are reused, never a false tie.
    blocks = nn.ModuleList()
    for _ in range(8):
        block = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6, bias=False))
        fully_shard(block)
        blocks.append(block)
        del block
    root = nn.Sequential(*blocks)
    fully_shard(root)
    root(torch.randn(3, 6)).sum().backward()


def test_layer_by_layer_sharding_has_no_false_tie() -> None:
    run_ranks(2, _layer_by_layer)


# ---- a parameter assigned after fully_shard is taken over at lazy init --------------------------------


class NormScaled(nn.Module):
    """Two layers and a parameter computed from their weights once they hold values (like a weight norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(7, 5, bias=False)
        self.layer2 = nn.Linear(5, 5, bias=False)
        self.scale = nn.Parameter(torch.empty(5))

    def init_scale(self) -> None:
        with torch.no_grad():
            scale = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.scale = nn.Parameter(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x))) * self.scale


def _shard_norm_scaled(model: NormScaled) -> None:
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)


def _reassigned_after_fully_shard(rank: int, world_size: int, init: str) -> None:
    torch.manual_seed(0)
    ref = NormScaled()
    ref.init_scale()
    if init == "meta":
        with torch.device("meta"):
            model = NormScaled()
        _shard_norm_scaled(model)
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
        for layer, ref_layer in ((model.layer1, ref.layer1), (model.layer2, ref.layer2)):
            layer.load_state_dict(ref_layer.state_dict())  # full tensors: each rank keeps its rows
    else:
        torch.manual_seed(0)
        model = NormScaled()
        _shard_norm_scaled(model)
    if init == "replicated":
        mesh = model.layer1.weight.device_mesh
        model.scale = nn.Parameter(distribute_tensor(ref.scale.detach().clone(), mesh, [Replicate()]))
    else:
        model.init_scale()  # computed from the sharded weights: a DTensor sharded like the parameter
        assert model.scale.placements == (Shard(0),)
    scale_param = model.scale
    batches = random_batches(3, world_size, regression_batch)
    loss_fn = lambda m, b: (m(b[0]) - b[1][:, :1]).square().mean()  # noqa: E731
    trace = train(model, batches, loss_fn, rank=rank)
    assert_parity(train(ref, batches, loss_fn, rank=None), trace, rank)
    # The assigned object stays the parameter (the optimizer was built before the first forward).
    assert model.scale is scale_param and model.scale.placements == (Shard(0),)


@pytest.mark.parametrize("init", ["meta", "dtensor", "replicated"])
def test_parameter_assigned_after_fully_shard(init: str) -> None:
    run_ranks(2, _reassigned_after_fully_shard, init)


def _reassigned_with_wrong_shape(rank: int, world_size: int) -> None:
    model = NormScaled()
    _shard_norm_scaled(model)
    model.scale = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"'scale' was re-assigned after fully_shard with shape \(4,\); it was sharded with"):
        mse_loss(model, (torch.randn(2, 7), torch.randn(2, 5)))


def _reassigned_with_plain_tensor(rank: int, world_size: int) -> None:
    model = NormScaled()
    _shard_norm_scaled(model)
    model.scale = nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError, match=r"'scale' was re-assigned after fully_shard with a plain tensor; assign a DTensor"):
        mse_loss(model, (torch.randn(2, 7), torch.randn(2, 5)))


def test_parameter_assigned_with_wrong_shape_or_type() -> None:
    run_ranks(2, _reassigned_with_wrong_shape)
    run_ranks(2, _reassigned_with_plain_tensor)
