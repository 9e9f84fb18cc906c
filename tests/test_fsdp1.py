"""FSDP1 conveniences: summon_full_params, no_sync, clip_grad_norm_, gradient-reduction hooks."""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fullshard
from fullshard import (
    FSDPModule,
    ReduceState,
    bf16_compress_hook,
    clip_grad_norm_,
    fp16_compress_hook,
    fully_shard,
    no_sync,
    reduce_scatter_hook,
    register_comm_hook,
    summon_full_params,
)
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss, mse_loss
from tests.parity import (
    assert_parity,
    full_grads,
    full_params,
    random_batches,
    regression_batch,
    run_parity,
    token_batch,
    train,
)
from tests.test_parity import shard_transformer
from tests.test_state_dict import assert_linked, build_pair

# ---- summon_full_params --------------------------------------------------------------------------


def _summon(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    batches = random_batches(4, world_size, token_batch)
    assert_parity(train(ref, batches[:1], lm_loss, rank=None), train(model, batches[:1], lm_loss, rank=rank), rank)
    expected = full_params(ref)

    with summon_full_params(model):
        for name, p in model.named_parameters():
            assert type(p) is nn.Parameter, name
            torch.testing.assert_close(p.detach(), expected[name])
        with torch.no_grad():
            model.blocks[0].mlp[0].weight.mul_(0.5)  # persists: writeback=True
    with torch.no_grad():
        ref.blocks[0].mlp[0].weight.mul_(0.5)
    assert_linked(model)
    torch.testing.assert_close(full_params(model), full_params(ref))

    with summon_full_params(model, writeback=False):
        with torch.no_grad():
            model.blocks[1].attn.proj.weight.zero_()  # dropped on exit
    torch.testing.assert_close(full_params(model), full_params(ref))

    with summon_full_params(model, writeback=False, rank0_only=True):
        kinds = {type(p) for p in model.parameters()}
        assert kinds == ({nn.Parameter} if rank == 0 else {DTensor}), kinds

    with summon_full_params(model, offload_to_cpu=True):
        assert all(p.device.type == "cpu" and type(p) is nn.Parameter for p in model.parameters())
    # requires_grad_ inside holds after the context, as on a plain module (on the full parameters and their CPU copies)
    for offload in (False, True):
        for frozen in (True, False):
            with summon_full_params(model, offload_to_cpu=offload):
                model.blocks[0].mlp[0].weight.requires_grad_(not frozen)
            assert model.blocks[0].mlp[0].weight.requires_grad is not frozen, (offload, frozen)

    lm_loss(model, batches[1][rank]).backward()
    (sum(lm_loss(ref, b) for b in batches[1]) / world_size).backward()
    with summon_full_params(model, writeback=False, with_grads=True):
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, msg=lambda m: f"{name}: {m}")
    model.zero_grad()
    ref.zero_grad()

    # Between micro-batches without sync: this rank's accumulated gradients are not shown inside and survive it.
    for sync, micro in ((False, batches[2]), (True, batches[3])):
        model.set_requires_gradient_sync(sync)
        lm_loss(model, micro[rank]).backward()
        (sum(lm_loss(ref, b) for b in micro) / world_size).backward()
        if not sync:
            with summon_full_params(model, with_grads=True):
                assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(full_grads(model), {n: p.grad for n, p in ref.named_parameters()})
    model.zero_grad()
    ref.zero_grad()

    # Both a ValueError and the type FSDP1 raises: NotImplementedError, AssertionError.
    with pytest.raises(NotImplementedError, match="rank0_only=True and writeback=True cannot be combined") as err:
        with summon_full_params(model, rank0_only=True):
            pass
    assert isinstance(err.value, ValueError)
    with pytest.raises(AssertionError, match="cannot be nested") as nested:
        with summon_full_params(model), summon_full_params(model.blocks[0]):
            pass
    assert isinstance(nested.value, ValueError)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert_parity(train(ref, batches[2:], lm_loss, rank=None), train(model, batches[2:], lm_loss, rank=rank), rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_summon_full_params(world_size: int) -> None:
    run_ranks(world_size, _summon)


def _summon_shows_what_trains(rank: int, world_size: int, policy: str) -> None:
    """Under a mixed-precision or quantized-communication policy the context shows the fp32 sharded values, an
    empty context changes nothing and with_grads gives the fp32 gradients; edits are written back in fp32."""
    torch.manual_seed(0)
    model = Transformer()
    kwargs = ({"mp_policy": fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if policy == "bf16"
              else {"comm_policy": fullshard.QuantizedCommPolicy()})
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    batches = random_batches(2, world_size, token_batch)
    train(model, batches[:1], lm_loss, rank=rank)
    before = full_params(model)
    lm_loss(model, batches[1][rank]).backward()
    grads = full_grads(model)
    with summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
            assert torch.equal(p.detach(), before[name]), name
            assert torch.equal(p.grad, grads[name]), name
    assert all(torch.equal(v, before[k]) for k, v in full_params(model).items())
    with summon_full_params(model):
        with torch.no_grad():
            model.blocks[0].mlp[0].weight.add_(1e-4)  # below bf16's resolution at these values
    edited = full_params(model)["blocks.0.mlp.0.weight"]
    assert torch.equal(edited, before["blocks.0.mlp.0.weight"] + 1e-4)


@pytest.mark.parametrize("policy", ["bf16", "quantized"])
def test_summon_shows_the_values_that_train(policy: str) -> None:
    run_ranks(2, _summon_shows_what_trains, policy)


def _summon_data_assigned(rank: int, world_size: int, writeback: bool) -> None:
    ref, model = build_pair()
    batches = random_batches(4, world_size, token_batch)
    assert_parity(train(ref, batches[:1], lm_loss, rank=None), train(model, batches[:1], lm_loss, rank=rank), rank)
    new = torch.randn(ref.blocks[0].mlp[0].weight.shape, generator=torch.Generator().manual_seed(5))
    with summon_full_params(model, writeback=writeback):
        model.blocks[0].mlp[0].weight.data = new.clone()
    if writeback:
        ref.blocks[0].mlp[0].weight.data = new.clone()
    # Later forwards compute with the parameters the optimizer steps (the reassigned tensor is not left in use).
    assert_parity(train(ref, batches[1:], lm_loss, rank=None), train(model, batches[1:], lm_loss, rank=rank), rank)


@pytest.mark.parametrize("writeback", [True, False])
def test_summon_with_data_assigned_inside(writeback: bool) -> None:
    run_ranks(2, _summon_data_assigned, writeback)


def _forward_inside_summon(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    batches = random_batches(3, world_size, token_batch)
    assert_parity(train(ref, batches[:1], lm_loss, rank=None), train(model, batches[:1], lm_loss, rank=rank), rank)
    tokens = batches[1][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is reported as assigned inside the context
        # FSDP1's evaluation idiom: the full model on rank 0 alone; the forward communicates nothing.
        with summon_full_params(model, rank0_only=True, writeback=False), torch.no_grad():
            if rank == 0:
                torch.testing.assert_close(lm_loss(model, tokens), lm_loss(ref, tokens), rtol=0, atol=0)
        with summon_full_params(model), torch.inference_mode():  # every rank, written back unchanged
            torch.testing.assert_close(lm_loss(model, tokens), lm_loss(ref, tokens), rtol=0, atol=0)
            assert all(type(p) is nn.Parameter for p in model.parameters())
    assert_parity(train(ref, batches[1:], lm_loss, rank=None), train(model, batches[1:], lm_loss, rank=rank), rank)


def test_forward_inside_summon_full_params() -> None:
    run_ranks(2, _forward_inside_summon)


# ---- no_sync --------------------------------------------------------------------------------------------


def micro_batches_no_sync(world_size: int, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if not isinstance(model, FSDPModule):
        (lm_loss(model, tokens[:2]) / world_size).backward()
        return lm_loss(model, tokens[2:])
    with no_sync(model):
        lm_loss(model, tokens[:2]).backward()
        assert all(p.grad is None for p in model.parameters())
    return lm_loss(model, tokens[2:])


def _no_sync(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Transformer, shard_transformer, token_batch,
                          functools.partial(micro_batches_no_sync, world_size), steps=3)
    with pytest.raises(RuntimeError, match="inside"):
        with no_sync(model):
            raise RuntimeError("inside")
    from fullshard.runtime import state_of

    assert all(state_of(m).group.reducer.settings.requires_gradient_sync for m in (model, *model.blocks))  # restored


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync(world_size: int) -> None:
    run_ranks(world_size, _no_sync)


# ---- clip_grad_norm_ -----------------------------------------------------------------------------------


def shard_mixed_placements(model: nn.Module) -> None:
    """Block 0 replicated (like DDP: HSDP with shards of one rank), block 1 and the root sharded; one frozen
    parameter."""
    model.blocks[1].ln2.weight.requires_grad_(False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    replicated = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.blocks[0], mesh=replicated)
    fully_shard(model.blocks[1], mesh=mesh)
    fully_shard(model, mesh=mesh)


def _clip(rank: int, world_size: int, norm_type: float, max_norm: float) -> None:
    torch.manual_seed(0)
    ref = Transformer()
    ref.blocks[1].ln2.weight.requires_grad_(False)
    torch.manual_seed(0)
    model = Transformer()
    shard_mixed_placements(model)
    batches = random_batches(2, world_size, token_batch)
    for step_batches in batches:
        (sum(lm_loss(ref, b) for b in step_batches) / world_size).backward()
        lm_loss(model, step_batches[rank]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        norm = clip_grad_norm_(model, max_norm, norm_type)
        assert type(norm) is torch.Tensor and norm.dim() == 0 and norm.dtype == torch.float32
        torch.testing.assert_close(norm, ref_norm.float())
        gathered = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(gathered, norm)
        assert all(torch.equal(g, norm) for g in gathered)  # identical on every rank
        grads, ref_grads = full_grads(model), full_grads(ref)
        assert grads["blocks.1.ln2.weight"] is None
        for name, ref_grad in ref_grads.items():
            if ref_grad is not None:
                torch.testing.assert_close(grads[name], ref_grad, msg=lambda m: f"{name}: {m}")
        model.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize(
    ("norm_type", "max_norm", "world_size"),
    [(2.0, 0.5, 2), (math.inf, 0.05, 2), (1.0, 1e6, 2), (2.0, 0.5, 4), (math.inf, 0.05, 4)],
    ids=["l2-2", "inf-2", "l1_no_clip-2", "l2-4", "inf-4"],
)
def test_clip_grad_norm(norm_type: float, max_norm: float, world_size: int) -> None:
    run_ranks(world_size, _clip, norm_type, max_norm)


def _clip_inf_over_empty_shards(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    model = copy.deepcopy(ref)
    fully_shard(model)  # the head's weight and bias have one row: the ranks past 0 hold none of it
    assert model[2].bias.to_local().numel() == (1 if rank == 0 else 0)
    batches = random_batches(1, world_size, lambda gen: regression_batch(gen, in_dim=3, out_dim=1))[0]
    (sum(mse_loss(ref, b) for b in batches) / world_size).backward()
    mse_loss(model, batches[rank]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=math.inf)
    torch.testing.assert_close(clip_grad_norm_(model, 0.01, norm_type=math.inf), ref_norm)
    ref_grads = full_grads(ref)
    for name, grad in full_grads(model).items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m: f"{name}: {m}")


def test_clip_grad_norm_inf_with_shards_holding_no_rows() -> None:
    """torch's clip_grad_norm_ raises on the rank without rows (`_foreach_norm` of an empty tensor); ours counts 0."""
    run_ranks(2, _clip_inf_over_empty_shards)


def _clip_float64(rank: int, world_size: int) -> None:
    """A group holding a float64 layer beside fp32 ones (mixed dtypes): the norm and the clipped gradients
    equal torch's clip_grad_norm_ on the unsharded model (float64 norms were refused by the fp32 kernel)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        model[0].double()
        return model

    class AsDouble(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[2](self.inner[1](self.inner[0](x.double())).float())

    ref, model = AsDouble(build()), AsDouble(build())
    fully_shard(model)
    x = torch.randn(4 * world_size, 5, generator=torch.Generator().manual_seed(3))
    ref(x).square().mean().backward()
    model(x.chunk(world_size)[rank]).square().mean().backward()
    norm = clip_grad_norm_(model, 0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert norm.dtype == torch.float64  # summed in float64 (in fp32 the clipped float64 gradients were 1e-10 off)
    torch.testing.assert_close(norm, ref_norm)
    for name, grad in full_grads(model).items():
        torch.testing.assert_close(grad, dict(ref.named_parameters())[name].grad, msg=lambda m: f"{name}: {m}")


def test_clip_grad_norm_of_float64_gradients() -> None:
    run_ranks(2, _clip_float64)


def _nonfinite(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    assert fullshard.nonfinite_gradients(model) == []
    # Only the last rank's rows of one parameter go bad: every rank names it, and the norm is non-finite everywhere.
    if rank == world_size - 1:
        model.blocks[1].mlp[0].weight.grad.to_local()[0, 0] = float("nan")
    model.head.weight.grad.to_local().fill_(float("inf") if rank == 0 else 0.0)
    assert fullshard.nonfinite_gradients(model) == ["tok.weight", "blocks.1.mlp.0.weight"]  # head.weight is tok.weight
    assert not torch.isfinite(fullshard.clip_grad_norm_(model, 1.0))


def test_nonfinite_gradients_named_on_every_rank() -> None:
    run_ranks(2, _nonfinite)


# ---- reduction hooks -----------------------------------------------------------------------------------


def shard_with_hook(hook_name: str, model: nn.Module) -> None:
    shard_transformer(model)
    group = dist.group.WORLD
    if hook_name == "torch_fsdp1_default":
        register_comm_hook(model, default_hooks.DefaultState(group), default_hooks.reduce_scatter_hook)
    else:
        hook = {"reduce_scatter": reduce_scatter_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook_name]
        register_comm_hook(model, ReduceState(group), hook)


def _hooks(rank: int, world_size: int, hook_name: str) -> None:
    low = hook_name in ("fp16", "bf16")
    tol = {"rtol": 2e-2, "atol": 2e-3} if low else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_parity(rank, world_size, Transformer, functools.partial(shard_with_hook, hook_name), token_batch, lm_loss,
                   steps=3, **tol)
    if hook_name != "torch_fsdp1_default":  # ours call torch 2.13's collective names, not the deprecated ones
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    assert ReduceState(dist.group.WORLD).divide_before * ReduceState(dist.group.WORLD).divide_after == world_size


@pytest.mark.parametrize("hook_name", ["reduce_scatter", "fp16", "bf16", "torch_fsdp1_default"])
def test_comm_hooks(hook_name: str) -> None:
    run_ranks(4, _hooks, hook_name)


def _hooks_without_sharding(rank: int, world_size: int, hook_name: str) -> None:
    def shard(model: nn.Module) -> None:
        fullshard.shard_model(model, auto_wrap_policy=fullshard.ModuleWrapPolicy({type(model.blocks[0])}),
                              sharding_strategy=fullshard.ShardingStrategy.NO_SHARD)
        if hook_name == "torch_allreduce":
            register_comm_hook(model, default_hooks.DefaultState(dist.group.WORLD), default_hooks.allreduce_hook)
        else:
            register_comm_hook(model, ReduceState(dist.group.WORLD), {"ours": reduce_scatter_hook,
                                                                      "bf16": bf16_compress_hook}[hook_name])

    tol = {"rtol": 2e-2, "atol": 2e-3} if hook_name == "bf16" else {}
    run_parity(rank, world_size, Transformer, shard, token_batch, lm_loss, steps=3, **tol)


@pytest.mark.parametrize("hook_name", ["torch_allreduce", "ours", "bf16"])
def test_comm_hooks_on_groups_that_shard_nothing(hook_name: str) -> None:
    """NO_SHARD: the hook averages the whole gradient in place (FSDP1's two-argument hooks), nothing else reduces."""
    run_ranks(2, _hooks_without_sharding, hook_name)


def _hook_sees_rank_major_gradients(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 5, bias=False)  # 5 rows over 2 ranks: chunks of 3, one row of padding
    fully_shard(model)
    seen: list[torch.Tensor] = []

    def spy(state: None, grad: torch.Tensor, output: torch.Tensor) -> None:
        seen.append(grad.clone())
        output.copy_(grad.view(world_size, -1)[rank])  # keep this rank's rows, no averaging

    register_comm_hook(model, None, spy)
    x = torch.ones(1, 3)
    model(x).sum().backward()
    assert seen[0].shape == (world_size * 3 * 3,)
    expected = torch.cat([torch.ones(5, 3), torch.zeros(1, 3)]).view(-1)  # d(sum)/dW = 1 for real rows, 0 padding
    torch.testing.assert_close(seen[0], expected)
    torch.testing.assert_close(model.weight.grad.full_tensor(), torch.ones(5, 3))


def test_hook_sees_rank_major_padded_gradients() -> None:
    run_ranks(2, _hook_sees_rank_major_gradients)
