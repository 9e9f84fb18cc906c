"""shard_model: FSDP1 auto-wrap policies and sharding strategies on the engine, and the prefetch orders they give."""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import fullshard
from fullshard import (
    BackwardPrefetch,
    CPUOffload,
    CustomPolicy,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    shard_model,
    size_based_auto_wrap_policy,
)
from fullshard.gpt import Block
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import random_batches, run_parity, token_batch


def sharded_names(model: nn.Module) -> list[str]:
    return [name or "<root>" for name, m in model.named_modules() if state_of(m) is not None and m is state_of(m).modules[0]]


def block_policy_fn(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Block)


POLICIES: dict[str, Any] = {
    "module_wrap": ModuleWrapPolicy({Block}),
    "torch_module_wrap": TorchModuleWrapPolicy({Block}),
    "custom": CustomPolicy(lambda m: isinstance(m, Block)),
    "callable": block_policy_fn,
}


def shard_with(policy_name: str, model: nn.Module) -> None:
    shard_model(model, auto_wrap_policy=POLICIES[policy_name])


def _policy(rank: int, world_size: int, policy_name: str) -> None:
    _, model = run_parity(rank, world_size, Transformer, functools.partial(shard_with, policy_name), token_batch, lm_loss)
    assert sharded_names(model) == ["<root>", "blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    ("policy_name", "world_size"), [(name, 2) for name in POLICIES] + [("module_wrap", 4), ("custom", 4)]
)
def test_policies_pick_blocks(policy_name: str, world_size: int) -> None:
    run_ranks(world_size, _policy, policy_name)


def _size_based(rank: int, world_size: int) -> None:
    # Block: attn.qkv 12*36+36=468, attn.proj 156, mlp.0 390, mlp.2 372, 2 LayerNorms 48: 1434 in all.
    model = Transformer()
    shard_model(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=450))
    # Bottom-up: qkv (468) and mlp (762) are taken first; what is left of a block (156 + 48) is too small,
    # and so is the (tied) embedding (444).
    assert sharded_names(model) == ["<root>", "blocks.0.attn.qkv", "blocks.0.mlp", "blocks.1.attn.qkv", "blocks.1.mlp"]
    big = Transformer()
    shard_model(big, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000))
    assert sharded_names(big) == ["<root>", "blocks.0", "blocks.1"]
    no_policy = Transformer()
    shard_model(no_policy)
    assert sharded_names(no_policy) == ["<root>"]


def test_size_based_policy_is_bottom_up() -> None:
    run_ranks(2, _size_based)


def _bad_policies(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"picked module 'blocks.0.mlp.1' \(GELU\), which would shard nothing"):
        shard_model(Transformer(), auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, (Block, nn.GELU))))
    with pytest.raises(ValueError, match=r"picked module 'head', whose parameter head.weight is shared with module 'tok'"):
        shard_model(Transformer(), auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, (nn.Embedding, nn.Linear))
                                                                  and m.weight.shape[0] == 37))
    model = Transformer()
    shard_model(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    with pytest.raises(ValueError, match="module 'Transformer' is already sharded"):
        shard_model(model)
    with pytest.raises(TypeError, match="sharding_strategy must be a fullshard.ShardingStrategy"):
        shard_model(Transformer(), sharding_strategy="FULL_SHARD")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads=True"):
        shard_model(Transformer(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    with pytest.raises(ValueError, match="has no parameters to shard"):
        shard_model(nn.Sequential(nn.ReLU()))
    square = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match="NO_SHARD needs a 1-D device_mesh, got 2 dimensions"):
        shard_model(Transformer(), sharding_strategy=ShardingStrategy.NO_SHARD, device_mesh=square)
    with pytest.raises(TypeError, match="device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"):
        shard_model(Transformer(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh="mesh")  # type: ignore


def test_bad_policies_are_rejected() -> None:
    run_ranks(2, _bad_policies)


# ---- strategies ---------------------------------------------------------------------------------------


def shard_strategy(strategy: ShardingStrategy, model: nn.Module, unnamed_mesh: bool = False) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    mesh = init_device_mesh("cpu", (2, 2)) if unnamed_mesh else None  # FSDP1 takes a 2-D mesh's axes by position
    shard_model(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy, device_mesh=mesh)


EXPECTED = {  # placements, all-gathers per step (forward + backward), reduce-scatters, all-reduces (3 groups)
    ShardingStrategy.FULL_SHARD: ((Shard(0),), 3 + 2, 3, 0),
    ShardingStrategy.SHARD_GRAD_OP: ((Shard(0),), 3, 3, 0),
    ShardingStrategy.NO_SHARD: ((Replicate(),), 0, 0, 3),
    ShardingStrategy.HYBRID_SHARD: ((Replicate(), Shard(0)), 3 + 2, 3, 3),
    ShardingStrategy._HYBRID_SHARD_ZERO2: ((Replicate(), Shard(0)), 3, 3, 3),
}


def _strategy(rank: int, world_size: int, strategy: ShardingStrategy, unnamed_mesh: bool = False) -> None:
    _, model = run_parity(rank, world_size, Transformer, functools.partial(shard_strategy, strategy,
                                                                           unnamed_mesh=unnamed_mesh), token_batch, lm_loss)
    placements, gathers, scatters, all_reduces = EXPECTED[strategy]
    assert all(p.placements == placements for p in model.parameters())
    rec = CommRecorder(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    rec.close()
    assert (rec.count("ag"), rec.count("rs"), rec.count("ar")) == (gathers, scatters, all_reduces), rec.events


@pytest.mark.parametrize("strategy", list(EXPECTED), ids=lambda s: s.name)
def test_sharding_strategies(strategy: ShardingStrategy) -> None:
    run_ranks(4, _strategy, strategy)


def test_hybrid_shard_on_a_mesh_without_names() -> None:
    run_ranks(4, _strategy, ShardingStrategy.HYBRID_SHARD, True)


def per_block_settings(module: nn.Module) -> bool | dict[str, Any]:
    """FSDP1's CustomPolicy: block 0 computes in fp32 and is replicated, block 1 takes the model's settings."""
    if module is getattr(per_block_settings, "special", None):
        fp32 = MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True)  # bf16 activations come in
        return {"mixed_precision": fp32, "sharding_strategy": ShardingStrategy.NO_SHARD}
    return isinstance(module, Block)


def _custom_policy_settings(rank: int, world_size: int, torch_policy: bool) -> None:
    from torch.distributed.fsdp.wrap import CustomPolicy as TorchCustomPolicy

    model = Transformer()
    per_block_settings.special = model.blocks[0]  # type: ignore[attr-defined]
    policy = (TorchCustomPolicy if torch_policy else CustomPolicy)(per_block_settings)
    shard_model(model, auto_wrap_policy=policy,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True))
    seen: dict[str, torch.dtype] = {}
    for name in ("blocks.0", "blocks.1"):
        model.get_submodule(name + ".mlp.0").register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, m.weight.dtype))
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    assert seen == {"blocks.0": torch.float32, "blocks.1": torch.bfloat16}
    assert model.blocks[0].mlp[0].weight.placements == (Replicate(),)
    assert model.blocks[1].mlp[0].weight.placements == (Shard(0),)
    with pytest.raises(NotImplementedError, match=r"gives module 'blocks.0' settings of its own for \['device_id'\]"):
        shard_model(Transformer(), auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, Block) and {"device_id": 0}))


@pytest.mark.parametrize("torch_policy", [False, True], ids=["fullshard", "torch"])
def test_custom_policy_gives_a_module_its_own_settings(torch_policy: bool) -> None:
    run_ranks(2, _custom_policy_settings, torch_policy)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(7, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x))
        self.bn_out = h.dtype
        return self.fc2(torch.relu(h))


def _batch_norm_mixed_precision(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = Normed()
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="BatchNorm1d modules are sharded on their own and compute in their parameters"):
        shard_model(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    assert model.bn.running_mean.dtype == torch.float32  # kept in its own dtype too
    x = torch.randn(world_size, 8, 7, generator=torch.Generator().manual_seed(3))
    out = model(x[rank])
    assert out.dtype == torch.bfloat16 and model.bn_out == torch.bfloat16  # cast back after the norm
    torch.testing.assert_close(out.float(), ref(x[rank]), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert model.bn.weight.grad is not None and model.bn.weight.grad.dtype == torch.float32


def test_batch_norm_keeps_full_precision_under_mixed_precision() -> None:
    run_ranks(2, _batch_norm_mixed_precision)


def shard_on_dim_1(model: nn.Module) -> None:
    shard_model(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)


def _placement_fn(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Transformer, shard_on_dim_1, token_batch, lm_loss)
    for name, p in model.named_parameters():
        assert p.placements == ((Shard(1),) if p.dim() == 2 else (Shard(0),)), name


def test_shard_placement_fn() -> None:
    run_ranks(2, _placement_fn)


def shard_mixed_precision_offload(model: nn.Module) -> None:
    model.register_buffer("scale", torch.ones(3))
    shard_model(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True),
    )


def _mp_and_offload(rank: int, world_size: int) -> None:
    model = Transformer()
    shard_mixed_precision_offload(model)
    assert model.scale.dtype == torch.bfloat16
    group = state_of(model.blocks[0]).group
    assert group.compute_dtype == torch.bfloat16 and group.reduce_dtype == torch.float32
    assert group.shard_device.type == "cpu" and group.flat_shard.dtype == torch.float32
    assert state_of(model).mp_policy.cast_forward_inputs and not state_of(model.blocks[0]).mp_policy.cast_forward_inputs
    loss = lm_loss(model, random_batches(1, world_size, token_batch)[0][rank])
    loss.backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32 for p in model.parameters())
    # State dicts give the buffer in its own dtype, as FSDP1's do; loading one casts it back to buffer_dtype.
    state = model.state_dict()
    assert state["scale"].dtype == torch.float32 and model.scale.dtype == torch.bfloat16
    full = fullshard.full_state_dict(model, rank0_only=False)
    assert full["scale"].dtype == torch.float32
    state["scale"] = torch.full((3,), 1.5)
    model.load_state_dict(state)
    assert model.scale.dtype == torch.bfloat16 and torch.equal(model.scale, torch.full((3,), 1.5, dtype=torch.bfloat16))


def test_fsdp1_mixed_precision_and_offload() -> None:
    run_ranks(2, _mp_and_offload)


# ---- prefetch orders ----------------------------------------------------------------------------------


def _prefetch_order(rank: int, world_size: int, options: dict[str, Any]) -> list[Any]:
    torch.manual_seed(0)
    model = Transformer()
    shard_model(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **options)
    batches = random_batches(2, world_size, token_batch)
    lm_loss(model, batches[0][rank]).backward()  # records the forward order
    states: list[str] = []
    rec = CommRecorder(model)
    original = rec._all_gather

    def snapshot(output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        # When block 0's all-gather is issued in backward, has block 1 already computed and resharded?
        if rec._names.get(inp.data_ptr()) == "blocks.0" and ("fwd", "blocks.1") in rec.events:
            states.append(state_of(model.blocks[1]).group.state.name)
        return original(output, inp, **kwargs)

    torch.distributed.all_gather_single = snapshot  # type: ignore[assignment]
    lm_loss(model, batches[1][rank]).backward()
    rec.close()
    return [rec.events, states]


FORWARD_NO_PREFETCH = [("ag", "root"), ("fwd", "root"), ("ag", "blocks.0"), ("fwd", "blocks.0"), ("ag", "blocks.1"),
                       ("fwd", "blocks.1")]
FORWARD_PREFETCH = [("ag", "root"), ("ag", "blocks.0"), ("fwd", "root"), ("ag", "blocks.1"), ("fwd", "blocks.0"),
                    ("fwd", "blocks.1")]
FORWARD_UNLIMITED = [("ag", "root"), ("ag", "blocks.0"), ("ag", "blocks.1"), ("fwd", "root"), ("fwd", "blocks.0"),
                     ("fwd", "blocks.1")]


@pytest.mark.parametrize(
    ("options", "forward", "block1_state"),
    [
        ({}, FORWARD_NO_PREFETCH, ["UNSHARDED"]),  # FSDP1 defaults: BACKWARD_PRE, no forward prefetch
        ({"forward_prefetch": True}, FORWARD_PREFETCH, ["UNSHARDED"]),
        ({"forward_prefetch": True, "limit_all_gathers": False}, FORWARD_UNLIMITED, ["UNSHARDING"]),
        ({"backward_prefetch": BackwardPrefetch.BACKWARD_POST}, FORWARD_NO_PREFETCH, ["SHARDED"]),
        ({"backward_prefetch": None}, FORWARD_NO_PREFETCH, ["SHARDED"]),
    ],
    ids=["defaults", "forward_prefetch", "unlimited", "backward_post", "no_backward_prefetch"],
)
def test_prefetch_options_change_issue_order(options: dict[str, Any], forward: list[Any], block1_state: list[str]) -> None:
    """``block1_state``: block 1's state when block 0's backward all-gather is issued: UNSHARDED (its own all-gather
    copied out first, its backward still to run: the prefetch goes out before it), UNSHARDING (unlimited all-gathers:
    block 0's is issued before block 1's is even copied out) or SHARDED (after its backward)."""
    events, states = run_ranks(2, _prefetch_order, options)[0]
    assert events[: len(forward)] == forward, events
    assert states == block1_state, events
    backward = events[len(forward):]
    gathers_then_scatter = [e[0] for e in backward[:3]]
    if options.get("backward_prefetch", BackwardPrefetch.BACKWARD_PRE) is None:
        assert gathers_then_scatter == ["ag", "rs", "ag"], backward  # block 0 gathered only when its backward starts
    else:
        assert gathers_then_scatter == ["ag", "ag", "rs"], backward


class SharedOnly(nn.Module):
    """Two blocks sharing one layer; the second holds nothing else."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(5, 5)
        self.a = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), shared)
        self.b = nn.Sequential(shared)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _policies_on_a_shared_module(rank: int, world_size: int, policy: str) -> None:
    from tests.models import mse_loss
    from tests.parity import regression_batch
    from tests.test_drop_in import SharedBlocks

    classes = {nn.Linear} if policy == "linear" else {nn.Sequential}
    for build in (SharedBlocks, SharedOnly):
        _, model = run_parity(rank, world_size, build, lambda m: shard_model(m, auto_wrap_policy=ModuleWrapPolicy(classes)),
                              lambda g: regression_batch(g, 5, 3), mse_loss)
        assert model.a[2] is model.b[0] and isinstance(model.b[0].weight, DTensor)


@pytest.mark.parametrize("policy", ["linear", "blocks"])
def test_policies_on_a_module_shared_by_two_blocks(policy: str) -> None:
    """The shared layer is picked once (a Linear policy), or left by the second block to the root (a block
    policy); both train as the unsharded model. (A module was visited by each path and refused as picked twice.)"""
    run_ranks(2, _policies_on_a_shared_module, policy)
