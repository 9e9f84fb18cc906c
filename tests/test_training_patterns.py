"""Parity for the ways real models use their parameters: tied, frozen, buffers, reuse, partial backward,
inference forwards, activation checkpointing, several forwards per backward, zero_grad modes."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fullshard import CPUOffloadPolicy, FSDPModule, fully_shard, summon_full_params
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import (
    assert_parity,
    full_params,
    random_batches,
    regression_batch,
    run_parity,
    sgd_momentum,
    token_batch,
    train,
)
from tests.test_parity import shard_mlp, shard_transformer


def assert_all_sharded(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is registered unsharded ({type(p).__name__}) but should be sharded"


# ---- shared (tied) parameters inside one child group -------------------------------------------


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 7)
        self.b = nn.Linear(7, 7)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = TiedPair()
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.pair(x))


def shard_tied(model: nn.Module) -> None:
    fully_shard(model.pair)
    fully_shard(model)


def _tied(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, TiedModel, shard_tied, regression_batch, mse_loss)
    assert model.pair.a.weight is model.pair.b.weight
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in TiedModel().named_parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_parameters(world_size: int) -> None:
    run_ranks(world_size, _tied)


# ---- frozen parameters mixed with trainable ones ------------------------------------------------


def frozen_mlp() -> nn.Module:
    model = MLP()
    model.layers[0].bias.requires_grad_(False)
    model.layers[1].weight.requires_grad_(False)
    return model


def _frozen(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    initial = frozen_mlp()
    trace, model = run_parity(rank, world_size, frozen_mlp, shard_mlp, regression_batch, mse_loss)
    for grads in trace.grads:
        assert grads["layers.0.bias"] is None and grads["layers.1.weight"] is None
    torch.testing.assert_close(trace.params["layers.1.weight"], initial.layers[1].weight.detach(), rtol=0, atol=0)
    assert not model.layers[1].weight.requires_grad


@pytest.mark.parametrize("world_size", [2, 4])
def test_frozen_parameters(world_size: int) -> None:
    run_ranks(world_size, _frozen)


def _toggled_between_forward_and_backward(rank: int, world_size: int, freeze: bool, reshard: bool, micro: int,
                                          before_forward: bool) -> None:
    """``requires_grad_`` on parameters while the modules hold the unsharded ones (after the last micro-batch's
    forward, before its backward): the root's, and a block's kept unsharded (``reshard=False``) or gathered again
    for backward. With ``micro`` > 1 the earlier micro-batches accumulate without sync: what a frozen parameter
    accumulated before stays its gradient for that step, as on a plain module."""
    names = ("layers.0.weight", "layers.1.weight", "layers.2.bias")

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = MLP()
        for name in names:
            model.get_parameter(name).requires_grad_(freeze)
        return model

    def step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: list[list[Any]], i: int) -> list[float]:
        losses = []
        for m, batches in enumerate(micro_batches):
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(m == len(micro_batches) - 1)
            toggles = i == 1 and m == len(micro_batches) - 1
            if toggles and before_forward:
                for name in names:
                    model.get_parameter(name).requires_grad_(not freeze)
            micro_losses = [mse_loss(model, b) for b in batches]
            if toggles and not before_forward:
                for name in names:
                    model.get_parameter(name).requires_grad_(not freeze)
            (sum(micro_losses) / len(micro_losses) / len(micro_batches)).backward()
            losses += [loss.item() for loss in micro_losses]
        opt.step()
        opt.zero_grad()
        return losses

    steps = [random_batches(micro, world_size, regression_batch, seed=i) for i in range(4)]  # [step][micro][rank]
    ref = make()
    ref_opt = sgd_momentum(ref.parameters())
    ref_losses = [step(ref, ref_opt, micro_batches, i) for i, micro_batches in enumerate(steps)]
    model = make()
    fully_shard(model.layers[1], reshard_after_forward=reshard)
    fully_shard(model.layers[2])
    fully_shard(model)
    opt = sgd_momentum(model.parameters())  # holds every parameter, frozen or not: they may be unfrozen
    for i, micro_batches in enumerate(steps):
        losses = step(model, opt, [[bs[rank]] for bs in micro_batches], i)
        torch.testing.assert_close(losses, ref_losses[i][rank::world_size], msg=lambda m: f"step {i}: {m}")
    for name, p in model.named_parameters():
        assert p.requires_grad == ref.get_parameter(name).requires_grad, name
    torch.testing.assert_close(full_params(model), {n: p.detach() for n, p in ref.named_parameters()})


@pytest.mark.parametrize(("micro", "before_forward"), [(1, False), (2, False), (2, True)],
                         ids=["step", "accumulated", "between-micro-batches"])
@pytest.mark.parametrize("freeze", [True, False], ids=["freeze", "unfreeze"])
@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept"])
def test_requires_grad_changed_between_forward_and_backward(freeze: bool, reshard: bool, micro: int,
                                                             before_forward: bool) -> None:
    """As on a plain module, the change holds from then on (FSDP2 drops it where the module holds the unsharded
    parameter: the root's and ``reshard_after_forward=False`` groups' parameters train on frozen), and a parameter
    frozen after micro-batches without sync keeps what it accumulated as its gradient (as on FSDP2)."""
    run_ranks(2, _toggled_between_forward_and_backward, freeze, reshard, micro, before_forward)


def _submodule_before_root(rank: int, world_size: int) -> None:
    """A sharded submodule trained on its own before the root's first forward (pretraining the first layer), and
    again between the whole model's steps: each step as on the unsharded model (FSDP2 raises ``RuntimeError`` at
    the root's first forward: "FSDP requires running forward through the root module first")."""
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    shard_mlp(model)
    opt, ref_opt = sgd_momentum(model.parameters()), sgd_momentum(ref.parameters())
    batches = random_batches(5, world_size, regression_batch)
    first = lambda m, b: m.layers[0](b[0]).square().mean()  # noqa: E731
    for i, step_batches in enumerate(batches):
        loss_fn = first if i in (0, 3) else mse_loss
        loss = loss_fn(model, step_batches[rank])
        loss.backward()
        (sum(loss_fn(ref, b) for b in step_batches) / world_size).backward()
        torch.testing.assert_close(loss, loss_fn(ref, step_batches[rank]), msg=lambda m: f"step {i}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    torch.testing.assert_close(full_params(model), {n: p.detach() for n, p in ref.named_parameters()})


def test_submodule_trained_before_the_root() -> None:
    run_ranks(2, _submodule_before_root)


# ---- buffers stay replicated --------------------------------------------------------------------


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def shard_buffer_model(model: nn.Module) -> None:
    fully_shard(model.lin)
    fully_shard(model)


def _buffers(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, WithBuffer, shard_buffer_model, regression_batch, mse_loss)
    assert type(model.scale) is torch.Tensor and model.scale.shape == (3,)
    torch.testing.assert_close(model.scale, torch.linspace(0.5, 1.5, 3))


def test_buffers_stay_replicated() -> None:
    run_ranks(2, _buffers)


# ---- a module called twice in one forward -------------------------------------------------------


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.block = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.out(h)


def shard_reused(model: nn.Module) -> None:
    fully_shard(model.block)
    fully_shard(model)


def _reused(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Reused, shard_reused, regression_batch, mse_loss)
    assert_all_sharded(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_module_called_twice(world_size: int) -> None:
    run_ranks(world_size, _reused)


# ---- a module that does not take part in backward ----------------------------------------------


class WithUnusedBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(7, 3)
        self.aux = nn.Linear(7, 4)
        self.probe = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux(x)  # computed, never used by the loss
        with torch.no_grad():
            self.probe(x)
        return self.main(x)


def shard_unused(model: nn.Module) -> None:
    for child in (model.main, model.aux, model.probe):
        fully_shard(child, reshard_after_forward=child is not model.aux)
    fully_shard(model)


def _unused(rank: int, world_size: int) -> None:
    trace, model = run_parity(rank, world_size, WithUnusedBranch, shard_unused, regression_batch, mse_loss)
    assert trace.grads[-1]["aux.weight"] is None and trace.grads[-1]["probe.weight"] is None
    assert_all_sharded(model)


def test_module_not_in_backward() -> None:
    run_ranks(2, _unused)


# ---- inference forwards leave every group sharded ----------------------------------------------


def loss_after_inference(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, _ = batch
    with torch.no_grad():
        expected = model(x)
    if isinstance(model, FSDPModule):
        assert_all_sharded(model)
    with torch.inference_mode():  # its all-gathered tensors are inference tensors; training goes on after it
        inferred = model(x)
    if isinstance(model, FSDPModule):
        assert_all_sharded(model)
    torch.testing.assert_close(inferred, expected, rtol=0, atol=0)
    model.eval()
    evaluated = model(x)
    model.train()
    if isinstance(model, FSDPModule):
        assert_all_sharded(model)
    torch.testing.assert_close(evaluated.detach(), expected)
    return mse_loss(model, batch)


def _inference(rank: int, world_size: int) -> None:
    for settings in ({}, {"reshard_after_forward": False}, {"offload_policy": CPUOffloadPolicy()}):
        def shard(model: nn.Module) -> None:
            for layer in model.layers:
                fully_shard(layer, **settings)
            fully_shard(model, **settings)

        run_parity(rank, world_size, MLP, shard, regression_batch, loss_after_inference, steps=3)


def test_no_grad_inference_mode_and_eval_forward_leave_sharded() -> None:
    """Also the FSDP2 failure this avoids: after a forward under torch.inference_mode(), its next training step
    raises "Inplace update to inference tensor outside InferenceMode"."""
    run_ranks(2, _inference)


# ---- activation checkpointing -------------------------------------------------------------------


class CheckpointedBlocks(Transformer):
    """Checkpoints each sharded block from outside, so its forward hooks run again in backward."""

    reentrant = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.norm(x))


class ReentrantCheckpointedBlocks(CheckpointedBlocks):
    """Reentrant checkpoints (Hugging Face's gradient checkpointing default): each block's first forward runs
    without grad, and its gradients come from a backward nested in the outer one."""

    reentrant = True


def _checkpoint_inside(rank: int, world_size: int) -> None:
    build = functools.partial(Transformer, checkpoint_mlp=True)
    run_parity(rank, world_size, build, shard_transformer, token_batch, lm_loss)


def _checkpoint_around(rank: int, world_size: int, build: type[CheckpointedBlocks] = CheckpointedBlocks) -> None:
    _, model = run_parity(rank, world_size, build, shard_transformer, token_batch, lm_loss)
    assert_all_sharded(model)


def _checkpoint_around_reentrant(rank: int, world_size: int) -> None:
    _checkpoint_around(rank, world_size, ReentrantCheckpointedBlocks)


class ReusedReentrant(Reused):
    """One sharded block applied twice, each call under a reentrant checkpoint (a layer shared across depth, as
    ALBERT's, with Hugging Face's gradient checkpointing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = torch.tanh(checkpoint(self.block, h, use_reentrant=True))
        return self.out(h)


def _checkpoint_reused_reentrant(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, ReusedReentrant, shard_reused, regression_batch, mse_loss)
    assert_all_sharded(model)


def checkpointed_mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = checkpoint(model, x.clone().requires_grad_(True), use_reentrant=True)
    return torch.nn.functional.mse_loss(out, y)


def _checkpoint_whole_model_reentrant(rank: int, world_size: int) -> None:
    # The root's own forward runs without grad: no backward hook anywhere until the recomputation.
    _, model = run_parity(rank, world_size, MLP, shard_mlp, regression_batch, checkpointed_mse)
    assert_all_sharded(model)


def _checkpoint_mixed_precision(rank: int, world_size: int) -> None:
    """The recomputation runs a group's hooks again and must cast as the forward did: each MLP a group of its
    own inside its checkpoint, bf16 parameters and inputs, fp32 outputs."""
    from fullshard import MixedPrecisionPolicy

    batches = random_batches(3, world_size, token_batch)
    traces = []
    for checkpoint_mlp in (False, True):
        torch.manual_seed(0)
        model = Transformer(checkpoint_mlp=checkpoint_mlp)
        for block in model.blocks:
            fully_shard(block.mlp, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
            fully_shard(block)
        fully_shard(model)
        traces.append(train(model, batches, lm_loss, rank=rank))
    plain, checkpointed = traces
    torch.testing.assert_close(checkpointed.losses, plain.losses, rtol=0, atol=0)
    torch.testing.assert_close(checkpointed.params, plain.params, rtol=0, atol=0)


@pytest.mark.parametrize(
    "body",
    [_checkpoint_inside, _checkpoint_around, _checkpoint_around_reentrant, _checkpoint_whole_model_reentrant,
     _checkpoint_reused_reentrant, _checkpoint_mixed_precision],
    ids=["inside_block", "around_block", "around_block_reentrant", "whole_model_reentrant", "reused_block_reentrant",
         "mixed_precision"],
)
def test_activation_checkpointing(body) -> None:  # type: ignore[no-untyped-def]
    run_ranks(2, body)


# ---- several forwards before one backward -------------------------------------------------------


def two_forward_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model, tokens[:1]) + 0.5 * lm_loss(model, tokens[1:])


def _two_forwards(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, Transformer, shard_transformer, token_batch, two_forward_loss)


@pytest.mark.parametrize("world_size", [2, 4])
def test_several_forwards_one_backward(world_size: int) -> None:
    run_ranks(world_size, _two_forwards)


# ---- the root's parameters used after forward ---------------------------------------------------


def penalized_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A penalty on the (tied) embedding, taken after forward: the root keeps its parameters unsharded until
    backward, as FSDP2's root does, so its gradient is the forward's plus the penalty's."""
    loss = lm_loss(model, tokens)
    weight = model.tok.weight
    assert not isinstance(weight, DTensor), "the root resharded after forward"
    return loss + 1e-2 * weight.pow(2).sum()


def _root_params_after_forward(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, Transformer, shard_transformer, token_batch, penalized_lm_loss)


@pytest.mark.parametrize("world_size", [2, 4])
def test_root_parameters_used_after_forward(world_size: int) -> None:
    run_ranks(world_size, _root_params_after_forward)


# ---- zero_grad(set_to_none=False) ---------------------------------------------------------------


def _zero_grad_keep(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, Transformer, shard_transformer, token_batch, lm_loss, set_to_none=False)


def test_zero_grad_set_to_none_false() -> None:
    run_ranks(2, _zero_grad_keep)


# ---- ignored parameters ----------------------------------------------------------------------------


def _ignored(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    model = MLP()
    ignored = model.layers[0].bias
    for layer in model.layers:
        fully_shard(layer, ignored_params={ignored})
    fully_shard(model, ignored_params={ignored})
    assert model.layers[0].bias is ignored and type(ignored) is nn.Parameter  # not sharded
    assert isinstance(model.layers[0].weight, DTensor)
    x, y = regression_batch(torch.Generator().manual_seed(rank))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*registered after fully_shard")  # ignored on purpose
        mse_loss(model, (x, y)).backward()
    mse_loss(ref, (x, y)).backward()
    # Not reduced: the ignored parameter keeps this rank's own gradient.
    torch.testing.assert_close(ignored.grad, ref.layers[0].bias.grad)

    torch.manual_seed(0)
    wrapped = MLP()
    from fullshard import ModuleWrapPolicy, shard_model

    shard_model(wrapped, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), ignored_modules=[wrapped.layers[1]])
    assert all(type(p) is nn.Parameter for p in wrapped.layers[1].parameters())
    assert all(isinstance(p, DTensor) for p in wrapped.layers[0].parameters())


def test_ignored_params_and_modules() -> None:
    run_ranks(2, _ignored)


def _registered_after_fully_shard(rank: int, world_size: int) -> None:
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.layers[0].extra = nn.Parameter(torch.zeros(3))  # neither sharded nor reduced
    model.layers[1].frozen = nn.Parameter(torch.zeros(3), requires_grad=False)  # no gradient to reduce
    with pytest.warns(UserWarning, match=r"registered after fully_shard .* own copy: layers\.0\.extra; register") as seen:
        mse_loss(model, regression_batch(torch.Generator().manual_seed(rank)))
    assert len(seen) == 1


def test_parameter_registered_after_fully_shard_warns() -> None:
    run_ranks(2, _registered_after_fully_shard)


def _changed_in_place(rank: int, world_size: int, reshard_after_forward: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 3))
    fully_shard(model[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    before = model[0].weight.full_tensor()
    tokens = torch.tensor([[rank, 2 * rank + 3]])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(tokens).sum().backward()  # the lookup renormalises rows in place
        model(tokens).sum().backward()  # once per group
    changed = [str(w.message) for w in seen if "changed in place" in str(w.message)]
    assert len(changed) == 1 and changed[0].startswith("fully_shard: 0.weight changed in place while unsharded"), changed
    assert torch.equal(model[0].weight.full_tensor(), before)  # dropped, as in FSDP2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.unshard()
        with torch.no_grad():
            model[1].weight.mul_(2)
        model.reshard()
        bias = model[1].bias.full_tensor()
        with summon_full_params(model, writeback=True), torch.no_grad():
            model[1].bias.add_(1)  # written back: nothing to warn about
    assert [str(w.message).split(" changed")[0] for w in seen] == ["fully_shard: 1.weight"]
    assert torch.equal(model[1].bias.full_tensor(), bias + 1)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_parameter_changed_in_place_while_unsharded_warns(reshard_after_forward: bool) -> None:
    """nn.Embedding(max_norm=...) changes its weight in forward: resharding drops that, as FSDP2 does, and says so;
    so does a change between unshard() and reshard(); summon_full_params(writeback=True) keeps its changes."""
    run_ranks(2, _changed_in_place, reshard_after_forward)


# ---- parameters used without calling their module ----------------------------------------------


def _encoder() -> nn.Module:
    return nn.Sequential(*(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)))


def _shard_linears(model: nn.Module, attention_too: bool) -> None:
    """Every nn.Linear a group of its own (as an auto-wrap policy picking nn.Linear does), out_proj included,
    which nn.MultiheadAttention never calls; then the attention modules, the layers and the root."""
    for module in list(model.modules()):
        if isinstance(module, nn.Linear):
            fully_shard(module)
    if attention_too:
        for module in list(model.modules()):
            if isinstance(module, nn.MultiheadAttention):
                fully_shard(module)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)


def _attention_batch(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=gen)


def _attention_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x)[..., :3] * x[..., :3]).mean()


def _attention_out_proj(rank: int, world_size: int, attention_too: bool) -> None:
    _, model = run_parity(rank, world_size, _encoder, functools.partial(_shard_linears, attention_too=attention_too),
                          _attention_batch, _attention_loss, steps=3)
    assert_all_sharded(model)
    x = _attention_batch(torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        model(x)
    assert_all_sharded(model)


@pytest.mark.parametrize("attention_too", [False, True])
def test_attention_out_proj_sharded_on_its_own(attention_too: bool) -> None:
    """nn.MultiheadAttention reads out_proj's parameters without calling it; FSDP2 fails there ("got mixed
    torch.Tensor and DTensor") unless the attention and out_proj share a group."""
    run_ranks(2, _attention_out_proj, attention_too)


class SameInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 7)
        self.same: list[bool] = []

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.same.append(a is b)
        return self.lin(a) * b


def _same_tensor_twice(rank: int, world_size: int) -> None:
    model = SameInputs()
    fully_shard(model)
    x = torch.randn(3, 7, requires_grad=True)
    model(x, x).sum().backward()
    model(x, b=x).sum().backward()  # through pytree
    assert model.same == [True, True]


def test_same_input_tensor_twice_stays_one_tensor() -> None:
    """A module given one tensor twice sees one tensor, as unwrapped (FSDP2 hands it two)."""
    run_ranks(2, _same_tensor_twice)


# ---- forward-mode AD through the sharded model (torch.func.jvp) --------------------------------------------


def jvp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], tangent_only: bool = False) -> torch.Tensor:
    """A consistency-model-style loss: the output and its derivative along the input direction ``v``."""
    x, y = batch
    out, tangent = torch.func.jvp(model, (x,), (torch.ones_like(x) / 4,))
    if tangent_only:
        return tangent.pow(2).mean()
    return torch.nn.functional.mse_loss(out, y) + tangent.pow(2).mean()


def _jvp(rank: int, world_size: int, reshard_after_forward: bool, tangent_only: bool) -> None:
    def shard(model: nn.Module) -> None:
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)

    _, model = run_parity(rank, world_size, MLP, shard, regression_batch,
                          functools.partial(jvp_loss, tangent_only=tangent_only), steps=3)
    assert_all_sharded(model)


@pytest.mark.parametrize("reshard_after_forward,tangent_only", [(True, False), (False, False), (True, True)])
def test_jvp_through_the_sharded_model(reshard_after_forward: bool, tangent_only: bool) -> None:
    """torch.func.jvp from the first forward on: the groups all-gather again for backward on the primal's and
    the tangent's paths ([Note: torch.func transforms]); parity with the unsharded model."""
    run_ranks(2, _jvp, reshard_after_forward, tangent_only)


def _func_transforms(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    model = MLP()
    shard_mlp(model)
    optims = [sgd_momentum(ref.parameters()), sgd_momentum(model.parameters())]  # before any forward
    x = torch.randn(5, 4, 7)
    for _ in range(2):  # from the first forward on, and again once initialised
        torch.testing.assert_close(torch.func.vmap(model)(x), torch.func.vmap(ref)(x))
        for inp in x[:2]:
            torch.testing.assert_close(torch.func.grad(lambda t: model(t).sum())(inp),
                                       torch.func.grad(lambda t: ref(t).sum())(inp))
        assert all(p.grad is None for p in model.parameters())  # torch.func.grad leaves .grad alone
    batches = random_batches(2, world_size, regression_batch)
    assert_parity(train(ref, batches, mse_loss, rank=None, optim=optims[0]),
                  train(model, batches, mse_loss, rank=rank, optim=optims[1]), rank)
    assert_all_sharded(model)


def test_vmap_and_grad_transforms_over_the_sharded_model() -> None:
    """torch.func.vmap (grad enabled) and torch.func.grad with respect to the input give the unsharded model's
    values, and training goes on from there ([Note: torch.func transforms])."""
    run_ranks(2, _func_transforms)
