"""fullshard.optim: the same steps and state as torch's optimizers on the DTensors, interchangeable state dicts."""

from __future__ import annotations

import copy
import functools
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

import fullshard
from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss, mse_loss
from tests.parity import assert_parity, full, random_batches, regression_batch, token_batch, train

CONFIGS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, fullshard.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_fused": (torch.optim.AdamW, fullshard.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    # A Tensor lr: torch's default then takes the per-tensor loop (foreach cannot take it without capturable).
    "adamw_tensor_lr": (torch.optim.AdamW, fullshard.optim.AdamW, {"lr": torch.tensor(1e-2), "weight_decay": 0.1}),
    "adam_amsgrad": (torch.optim.Adam, fullshard.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "sgd_nesterov": (torch.optim.SGD, fullshard.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                                            "weight_decay": 0.01}),
    "sgd_plain": (torch.optim.SGD, fullshard.optim.SGD, {"lr": 0.05}),
}


def shard(policy: str, model: torch.nn.Module) -> None:
    kwargs: dict[str, Any] = {}
    if policy == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif policy == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def state_tensors(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{fqn}/{key}": full(value) for fqn, s in osd["state"].items() for key, value in s.items()}


def _same_as_torch(rank: int, world_size: int, config: str, policy: str) -> None:
    torch_cls, ours_cls, kwargs = CONFIGS[config]
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Transformer()
        shard(policy, model)
        models.append(model)
    batches = random_batches(4, world_size, token_batch)
    theirs = train(models[0], batches, lm_loss, rank=rank, make_optim=functools.partial(torch_cls, **kwargs))
    ours = train(models[1], batches, lm_loss, rank=rank, make_optim=functools.partial(ours_cls, **kwargs))
    assert isinstance(ours.optim, torch_cls)
    for name in theirs.params:
        torch.testing.assert_close(ours.params[name], theirs.params[name], rtol=1e-6, atol=1e-6, msg=name)
    # Same state, same layout, sharded the same way.
    their_sd = get_optimizer_state_dict(models[0], theirs.optim)
    our_sd = get_optimizer_state_dict(models[1], ours.optim)
    assert their_sd["param_groups"] == our_sd["param_groups"]
    their_state, our_state = state_tensors(their_sd), state_tensors(our_sd)
    assert their_state.keys() == our_state.keys()
    for key in their_state:
        torch.testing.assert_close(our_state[key], their_state[key], rtol=1e-6, atol=1e-6, msg=key)
    for value in (v for s in our_sd["state"].values() for v in s.values() if v.dim()):
        assert isinstance(value, DTensor) and value.placements == models[1].tok.weight.placements
    # Interchangeable: torch's state continues in ours and the reverse, step for step.
    set_optimizer_state_dict(models[1], ours.optim, their_sd)
    set_optimizer_state_dict(models[0], theirs.optim, our_sd)
    more = random_batches(2, world_size, token_batch, seed=99)
    a = train(models[0], more, lm_loss, rank=rank, optim=theirs.optim)
    b = train(models[1], more, lm_loss, rank=rank, optim=ours.optim)
    for name in a.params:
        torch.testing.assert_close(b.params[name], a.params[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_same_steps_and_state_as_torch(config: str) -> None:
    run_ranks(2, _same_as_torch, config, "plain")


@pytest.mark.parametrize("policy", ["bf16", "offload"])
def test_adamw_with_mixed_precision_and_offload(policy: str) -> None:
    run_ranks(4, _same_as_torch, "adamw", policy)


@pytest.mark.parametrize("foreach", [None, False])
def test_unsharded_parameters(foreach: bool | None) -> None:
    batches = random_batches(3, 1, token_batch)
    trained = []
    for cls in (fullshard.optim.AdamW, torch.optim.AdamW):
        torch.manual_seed(0)
        trained.append(train(Transformer(), batches, lm_loss, rank=0,
                             make_optim=lambda p, cls=cls: cls(p, lr=1e-2, foreach=foreach)).params)
    torch.testing.assert_close(trained[0], trained[1], rtol=1e-6, atol=1e-6)


def flat_state(opt: torch.optim.Optimizer, group: list[torch.Tensor], key: str) -> bool:
    """Whether ``opt``'s ``key`` state of one fullshard group's parameters sits in one flat buffer laid out as
    the group's flat shard (each entry reaches it through a storage of its own: [Note: Own-storage views])."""
    def offsets(tensors: list[torch.Tensor]) -> list[int]:
        return [t.data_ptr() - tensors[0].data_ptr() for t in tensors]
    return offsets([opt.state[p][key].to_local() for p in group]) == offsets([p.to_local() for p in group])


def _flat_steps(rank: int, world_size: int) -> None:
    """foreach AdamW steps each group's flat buffer as one tensor; its state stays per-parameter DTensor views."""
    torch.manual_seed(0)
    model = Transformer()
    shard("plain", model)
    opt = fullshard.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, random_batches(2, world_size, token_batch), lm_loss, rank=rank, optim=opt)
    block = list(model.blocks[0].parameters())
    assert flat_state(opt, block, "exp_avg")
    assert all(isinstance(opt.state[p]["exp_avg"], DTensor) for p in block)
    assert len({float(opt.state[p]["step"]) for p in model.parameters()}) == 1
    # A loaded state dict (new tensors) is taken into fresh flat buffers at the next step.
    opt.load_state_dict(opt.state_dict())
    train(model, random_batches(1, world_size, token_batch, seed=5), lm_loss, rank=rank, optim=opt)
    assert flat_state(opt, block, "exp_avg_sq")
    assert {float(opt.state[p]["step"]) for p in model.parameters()} == {3.0}


def test_foreach_adamw_steps_flat_buffers() -> None:
    run_ranks(2, _flat_steps)


def _flat_runs_follow_gradients(rank: int, world_size: int) -> None:
    """Which gradients step flat: the reduce-scatter's (also accumulated), views placed in the flat layout by
    hand; not a group with a replaced gradient. Each case steps exactly as torch's AdamW on the DTensors."""
    from fullshard.optim import flat_runs
    from fullshard.param import FLAT_GRAD, FlatGrad

    def backward(model: torch.nn.Module, seed: int) -> None:
        lm_loss(model, random_batches(1, world_size, token_batch, seed=seed)[0][rank]).backward()

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Transformer()
        shard("plain", model)
        models.append(model)
    ours, theirs = models
    opts = (fullshard.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=True))
    n_groups = len(ours.blocks) + 1
    for step, edit in enumerate(["none", "accumulate", "replace", "views"]):
        for model in models:
            backward(model, step)
            if edit == "accumulate":
                backward(model, step + 10)
        block = list(ours.blocks[0].parameters())
        if edit == "replace":  # a new tensor: this group steps per parameter
            block[0].grad = block[0].grad.clone()
        elif edit == "views":  # new DTensors over the same local views: found by their placement in one buffer
            for p in block:
                p.grad = DTensor.from_local(p.grad.to_local(), p.device_mesh, p.placements, shape=p.shape,
                                            stride=p.stride(), run_check=False)
        if edit == "none":  # marked gradients save, load (weights_only) and copy; the copies are not marked
            # (torch.save refuses DTensors whose local tensor starts past its storage's start: the first only)
            buffer = io.BytesIO()
            torch.save(block[0].grad, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=True)
            torch.testing.assert_close(loaded.to_local(), block[0].grad.to_local(), rtol=0, atol=0)
            mark = getattr(block[0].grad, FLAT_GRAD)
            assert isinstance(mark, FlatGrad) and copy.deepcopy(mark) == set() and copy.copy(mark) == set()
            assert not isinstance(getattr(loaded, FLAT_GRAD, None), FlatGrad)
            assert flat_runs(block)[1] == [] and len(flat_runs(block)[0]) == 1
        runs, rest = flat_runs([p for p in ours.parameters() if p.grad is not None])
        flat_groups = n_groups - 1 if edit == "replace" else n_groups
        assert len(runs) == flat_groups, (edit, len(runs))
        assert {id(p) for p in rest} == ({id(p) for p in block} if edit == "replace" else set())
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(full(a), full(b), rtol=1e-6, atol=1e-6, msg=lambda m: f"{edit} {name}: {m}")


def test_flat_runs_follow_gradients() -> None:
    run_ranks(2, _flat_runs_follow_gradients)


def _parity_with_unsharded(rank: int, world_size: int, config: str) -> None:
    torch_cls, ours_cls, kwargs = CONFIGS[config]
    batches = random_batches(3, world_size, token_batch)
    torch.manual_seed(0)
    ref = train(Transformer(), batches, lm_loss, rank=None, make_optim=functools.partial(torch_cls, **kwargs))
    torch.manual_seed(0)
    model = Transformer()
    shard("plain", model)
    sharded = train(model, batches, lm_loss, rank=rank, make_optim=functools.partial(ours_cls, **kwargs))
    assert_parity(ref, sharded, rank, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("config", ["adamw", "adam_amsgrad", "sgd_nesterov"])
def test_parity_with_unsharded_torch_optimizer(config: str, world_size: int) -> None:
    """Sharded with fullshard.optim against torch's optimizer on the unsharded model in one process."""
    run_ranks(world_size, _parity_with_unsharded, config)


def _dcp_save(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer()
    shard("plain", model)
    opt = fullshard.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # flat state buffers
    train(model, random_batches(2, world_size, token_batch), lm_loss, rank=rank, optim=opt)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return state_tensors(get_optimizer_state_dict(model, opt))


def _dcp_load(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = Transformer()
    shard("plain", model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, random_batches(1, world_size, token_batch, seed=7), lm_loss, rank=rank, optim=opt)  # some state
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    return state_tensors(get_optimizer_state_dict(model, opt))


def test_dcp_checkpoint_from_flat_state_loads_into_torch_adamw_at_another_world_size(tmp_path: Path) -> None:
    saved = run_ranks(4, _dcp_save, str(tmp_path))[0]
    loaded = run_ranks(2, _dcp_load, str(tmp_path))[0]
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


class Gated(nn.Module):
    """Two hidden layers and a head in one group; the layers listed in ``skip`` sit out the forward (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
        self.head = nn.Linear(7, 3)
        self.skip: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.relu(layer(x))
        return self.head(x)


# Which layers sit out each step: afterwards the steps are layer 0: 2, layer 1: 2, head: 3, so the flat buffer
# holds two step counts (one parameter skipped in the middle, one at the front of the group).
SKIPS = [frozenset(), frozenset({1}), frozenset({0})]


def gated_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(gen, in_dim=7, out_dim=3)


def gated_pair() -> tuple[Gated, Gated]:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Gated()
        fully_shard(model)  # one group: every parameter in one flat shard buffer
        models.append(model)
    return models[0], models[1]


def step_gated(models: tuple[nn.Module, ...], opts: tuple[torch.optim.Optimizer, ...], skips: list[frozenset[int]],
               world_size: int, rank: int, seed: int) -> None:
    """Train every model with its optimizer, ``skips[i]`` sitting out step ``i``; equal parameters and per-parameter
    steps after every step."""
    batches = random_batches(len(skips), world_size, gated_batch, seed=seed)
    for step, (skip, step_batches) in enumerate(zip(skips, batches, strict=True)):
        for model, opt in zip(models, opts, strict=True):
            model.skip = skip
            train(model, [step_batches], mse_loss, rank=rank, optim=opt)
        reference, *others = models
        for model in others:
            for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(full(a), full(b), rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"seed {seed} step {step} {name}: {m}")
        steps = [{i: float(s["step"]) for i, s in opt.state_dict()["state"].items()} for opt in opts]
        assert all(s == steps[0] for s in steps), f"seed {seed} step {step}: per-parameter steps differ: {steps}"


def _steps_when_a_parameter_gets_no_gradient(rank: int, world_size: int, config: str) -> None:
    torch_cls, ours_cls, kwargs = CONFIGS[config]
    models = gated_pair()
    opts = (torch_cls(models[0].parameters(), **kwargs), ours_cls(models[1].parameters(), **kwargs))
    step_gated(models, opts, SKIPS + [frozenset()] * 2 + [frozenset({1}), frozenset()], world_size, rank, seed=3)
    assert [float(s["step"]) for s in opts[1].state_dict()["state"].values()] == [6.0] * 2 + [5.0] * 2 + [7.0] * 2


@pytest.mark.parametrize("config", ["adamw", "adam_amsgrad"])
def test_flat_step_keeps_each_parameters_step_when_one_gets_no_gradient(config: str) -> None:
    """A parameter without a gradient in some steps keeps its own step count (the flat step took the group's first)."""
    run_ranks(2, _steps_when_a_parameter_gets_no_gradient, config)


def _steps_loaded_from_torch(rank: int, world_size: int, config: str, how: str) -> None:
    torch_cls, ours_cls, kwargs = CONFIGS[config]
    models = gated_pair()
    trained = torch_cls(models[0].parameters(), **kwargs)
    step_gated(models[:1], (trained,), SKIPS, world_size, rank, seed=5)  # steps 2, 2, 3 in torch's state
    models[1].load_state_dict(models[0].state_dict())
    opts = (torch_cls(models[0].parameters(), **kwargs), ours_cls(models[1].parameters(), **kwargs))
    for model, opt in zip(models, opts):  # copies: a loaded step tensor is taken as is, not copied
        if how == "set_optimizer_state_dict":
            set_optimizer_state_dict(model, opt, copy.deepcopy(get_optimizer_state_dict(models[0], trained)))
        else:
            opt.load_state_dict(copy.deepcopy(trained.state_dict()))
    step_gated(models, opts, [frozenset()] * 3, world_size, rank, seed=6)
    # Still flat: the spans of equal steps are slices of the group's flat state buffers.
    assert flat_state(opts[1], list(models[1].parameters()), "exp_avg")
    assert [float(s["step"]) for s in opts[1].state_dict()["state"].values()] == [5.0] * 4 + [6.0] * 2


@pytest.mark.parametrize("how", ["set_optimizer_state_dict", "load_state_dict"])
@pytest.mark.parametrize("config", ["adamw", "adam_amsgrad"])
def test_flat_step_after_loading_differing_steps_from_torch(config: str, how: str) -> None:
    """torch's state with several step counts in one group steps on each parameter's own count."""
    run_ranks(2, _steps_loaded_from_torch, config, how)


def test_equal_step_spans() -> None:
    from fullshard.optim import equal_step_spans

    assert equal_step_spans([4.0]) == [(0, 1)]
    assert equal_step_spans([3.0] * 6) == [(0, 6)]
    assert equal_step_spans([2.0, 2.0, 2.0, 2.0, 3.0, 3.0]) == [(0, 4), (4, 6)]
    assert equal_step_spans([3.0, 3.0, 2.0, 2.0, 3.0]) == [(0, 2), (2, 4), (4, 5)]
    assert equal_step_spans([1.0, 2.0, 1.0]) == [(0, 1), (1, 2), (2, 3)]
