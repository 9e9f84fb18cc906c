"""Misuse fails at the call with a message naming the module or parameter; failures leave the model usable."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor

from fullshard import AlreadyShardedError, CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fullshard.api import check_param_device
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import assert_parity, random_batches, regression_batch, train


def _twice(rank: int, world_size: int) -> None:
    model = MLP()
    fully_shard(model.layers[0])
    with pytest.raises(AlreadyShardedError, match="already been applied to this Linear"):
        fully_shard(model.layers[0])
    # torch's fully_shard raises AssertionError for the same mistake; so do we.
    with pytest.raises(AssertionError):
        fully_shard(model.layers[0])


def _bad_arguments(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
        fully_shard(nn.Linear(3, 3), reshard_after_forward="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh"):
        fully_shard(nn.Linear(3, 3), mesh="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fully_shard(nn.Linear(3, 3), mp_policy={"param_dtype": torch.bfloat16})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.param_dtype must be a floating-point"):
        fully_shard(nn.Linear(3, 3), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(ValueError, match="does not support containers that do not implement forward: ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(3, 3)]))
    mesh = init_device_mesh("cpu", (world_size,))
    tp = nn.Linear(4, 4)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="parameter 'weight' is already a DTensor on the mesh fully_shard shards over"):
        fully_shard(tp)


class Lion(torch.optim.Optimizer):
    """An optimizer of the user's own (not one of torch's elementwise classes)."""

    def __init__(self, params, lr: float = 1e-3) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[no-untyped-def,override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def _optimizer_before_fully_shard(rank: int, world_size: int) -> None:
    for make in (lambda params: torch.optim.AdamW(params), lambda params: torch.optim.SGD(params, lr=0.1, foreach=True),
                 Lion):
        model = MLP()
        model.layers[2].bias.requires_grad_(False)
        early = make(model.parameters())  # holds the originals that fully_shard replaces
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        mse_loss(model, regression_batch(torch.Generator().manual_seed(rank))).backward()
        with pytest.raises(ValueError, match=r"holds the original parameter 'layers.0.weight', which fully_shard "
                                             r"replaced .* Build the optimizer after fully_shard"):
            early.step()
        before = [p.full_tensor() for p in model.parameters()]
        make(model.parameters()).step()  # built after: trains
        assert all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()) if p.requires_grad)
    # Only frozen originals: nothing would train anyway, and the step goes on.
    model = MLP()
    frozen = [p.requires_grad_(False) for p in model.parameters()]
    early = torch.optim.SGD(frozen, lr=0.1)
    fully_shard(model)
    early.step()
    # An original still used outside fully_shard's reach (it has a gradient) steps as before.
    model, outside = MLP(), nn.Linear(7, 13)
    outside.weight = model.layers[0].weight
    kept = outside.weight
    early = torch.optim.SGD([kept], lr=0.1)
    fully_shard(model)
    outside(torch.ones(2, 7)).sum().backward()
    before = kept.detach().clone()
    early.step()
    assert not torch.equal(before, kept)


def _optimizer_from_unsharded_parameters(rank: int, world_size: int) -> None:
    """model.parameters() after a forward without backward lists the groups still unsharded (as in FSDP2): an
    optimizer built from them would step nothing, so its step names them; one built after a backward trains."""
    model = MLP()
    for layer in model.layers[:2]:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model)
    batch = regression_batch(torch.Generator().manual_seed(rank))
    mse_loss(model, batch)  # a forward without backward: layers 0 and 1 and the root stay unsharded
    late = torch.optim.AdamW(model.parameters())
    mse_loss(model, batch).backward()
    with pytest.raises(ValueError, match=r"holds the unsharded parameter 'layers.0.weight', which model.parameters\(\) "
                                         r"lists while its group is unsharded .* Build the optimizer from the sharded"):
        late.step()
    before = [p.full_tensor() for p in model.parameters()]
    torch.optim.AdamW(model.parameters()).step()  # built after the backward: every group is sharded again
    assert all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))


def _sparse_gradient(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6, sparse=True), nn.Linear(6, 1))
    ref = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 1))
    ref.load_state_dict(model.state_dict())
    fully_shard(model[0])
    fully_shard(model)
    tokens = torch.arange(8).view(2, 4) + rank
    # torch's FSDP2 raises NotImplementedError here too, from inside its reduce-scatter copy-in.
    with pytest.raises(NotImplementedError, match=r"0.weight got a torch.sparse_coo gradient; fully_shard reduces "
                                                  r"dense gradients only \(build the module with sparse=False"):
        model(tokens).sum().backward()
    model[0].sparse = False  # the next forward recovers from the failed backward
    model.zero_grad()  # gradients reduced before the failure stay, as unsharded
    model(tokens).sum().backward()
    for r in range(world_size):
        (ref(torch.arange(8).view(2, 4) + r).sum() / world_size).backward()
    for p, expected in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), expected.grad)


@pytest.mark.parametrize("body", [_twice, _bad_arguments, _optimizer_before_fully_shard,
                                  _optimizer_from_unsharded_parameters, _sparse_gradient])
def test_misuse_is_rejected(body) -> None:  # type: ignore[no-untyped-def]
    run_ranks(2, body)


def test_parameter_on_other_device_than_mesh() -> None:
    check_param_device("w", torch.device("cpu"), torch.device("cuda", 0))  # moved by fully_shard
    check_param_device("w", torch.device("cuda", 0), torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"parameter 'layers.0.weight' is on cuda:1 but the mesh computes on cuda:0"):
        check_param_device("layers.0.weight", torch.device("cuda", 1), torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"is on cuda:0 but the mesh computes on cpu"):
        check_param_device("w", torch.device("cuda", 0), torch.device("cpu"))


def test_no_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs an initialized default process group when mesh=None"):
        fully_shard(nn.Linear(2, 2))


# ---- a failed forward or backward leaves the model usable ------------------------------------------


class Tripwire(torch.autograd.Function):
    """Identity that raises in backward while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        if Tripwire.armed:
            raise RuntimeError("tripwire in backward")
        return grad


class TrippedMLP(MLP):
    fail_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.layers[0](x))
        x = Tripwire.apply(torch.relu(self.layers[1](x)))
        if TrippedMLP.fail_forward:
            raise RuntimeError("tripwire in forward")
        return self.layers[2](x)


def shard_layers(model: nn.Module) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def _recovers(rank: int, world_size: int, where: str, setup: str) -> None:
    torch.manual_seed(0)
    ref = TrippedMLP()
    torch.manual_seed(0)
    model = TrippedMLP()
    kwargs: dict[str, Any] = {}
    if setup == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif setup == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    batches = random_batches(4, world_size, regression_batch)
    assert_parity(train(ref, batches[:2], mse_loss, rank=None), train(model, batches[:2], mse_loss, rank=rank), rank)
    if setup == "no_sync":  # a micro-batch whose gradients the failure then drops
        model.set_requires_gradient_sync(False)
        mse_loss(model, batches[1][rank]).backward()
        model.set_requires_gradient_sync(True)
    try:
        Tripwire.armed, TrippedMLP.fail_forward = where == "backward", where == "forward"
        with pytest.raises(RuntimeError, match=f"tripwire in {where}"):
            mse_loss(model, batches[2][rank]).backward()
    finally:
        Tripwire.armed = TrippedMLP.fail_forward = False
    for p in model.parameters():
        p.grad = None
    assert_parity(train(ref, batches[2:], mse_loss, rank=None), train(model, batches[2:], mse_loss, rank=rank), rank)


@pytest.mark.parametrize("setup", ["plain", "offload", "no_sync", "hsdp"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_usable_after_failure(where: str, setup: str) -> None:
    run_ranks(4 if setup == "hsdp" else 2, _recovers, where, setup)
