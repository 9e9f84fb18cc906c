"""Code written for torch's FSDP2 keeps working: its exception types and messages, and what it tolerates.

Where FSDP2 raises a type other than this package's documented one, fullshard
raises a class that is both; where user code matches FSDP2's message, ours
contains it. A failed ``fully_shard`` leaves the module as it was.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fullshard
import fullshard.optim
from fullshard import EMA, FSDPModule, fully_shard
from fullshard.fsdp1 import summon_full_params
from fullshard.group import ShardedState
from fullshard.runtime import state_of, states_in
from tests.comm import CommRecorder
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

    with torch.device("meta"):
        never = MLP()
    fully_shard(never)
    # FSDP2 raises RuntimeError here; code that catches it keeps working.
    fsdp2_sentence = ("FSDP parameters should be materialized from meta device before training, but the following "
                      r"were still on meta device: \['layers.0.weight'")
    with pytest.raises(RuntimeError, match=fsdp2_sentence):
        never(torch.zeros(2, 7))


def test_fsdp2_exception_types_and_messages() -> None:
    run_ranks(2, _fsdp2_exceptions)


def _torch_policies(rank: int, world_size: int) -> None:
    batches = random_batches(3, world_size, regression_batch)
    traces, computed_in = [], []
    for policies in (fullshard, torch_fsdp):
        torch.manual_seed(0)
        model = MLP()
        kw = {"mp_policy": policies.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "offload_policy": policies.CPUOffloadPolicy(pin_memory=False)}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.layers[0].register_forward_pre_hook(lambda mod, args: computed_in.append(mod.weight.dtype))
        traces.append(train(model, batches, mse_loss, rank=rank))
    assert computed_in == [torch.bfloat16] * 6
    ours, theirs = traces
    torch.testing.assert_close(torch.stack(theirs.losses), torch.stack(ours.losses), rtol=0, atol=0)
    for step, (our_grads, their_grads) in enumerate(zip(ours.grads, theirs.grads, strict=True)):
        torch.testing.assert_close(their_grads, our_grads, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(theirs.params, ours.params, rtol=0, atol=0)


def _deepcopy_submodule(rank: int, world_size: int) -> None:
    batches = random_batches(2, world_size, regression_batch)
    outcomes = []
    for policies in (fullshard, torch_fsdp):
        torch.manual_seed(0)
        model = MLP()  # layers.2: 3 rows, so an empty shard at 4 ranks
        policies.fully_shard(model.layers[0])
        policies.fully_shard(model)
        seen: list[Any] = []
        copies = [copy.deepcopy(model.layers[2])]  # before the first forward (EMA or teacher copies)
        train(model, batches, mse_loss, rank=rank)  # ends with zero_grad(): no gradients to copy
        copies.append(copy.deepcopy(model.layers[2]))
        copies.append(copy.deepcopy(model.layers[0].weight))  # a parameter of a group of its own
        for c in copies[:2]:
            assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in c.parameters())
            seen.append({n: p.full_tensor() for n, p in c.named_parameters()})
        seen.append(copies[2].full_tensor())
        with torch.no_grad():  # a moving average of the copy: its own memory
            for mine, live in zip(copies[0].parameters(), model.layers[2].parameters()):
                mine.lerp_(live, 0.5)
        seen.append({n: p.full_tensor() for n, p in copies[0].named_parameters()})
        live = {n: p.full_tensor() for n, p in model.named_parameters()}
        # The copy loads and changes alone: the hooks it took along act for the live modules only.
        copies[1].load_state_dict({k: torch.full_like(v, 3.0) for k, v in copies[1].state_dict().items()})
        with torch.no_grad():
            copies[1].weight.mul_(2.0)
        seen.append({n: p.full_tensor() for n, p in copies[1].named_parameters()})
        torch.testing.assert_close({n: p.full_tensor() for n, p in model.named_parameters()}, live, rtol=0, atol=0)
        seen.append(live)
        model(batches[0][rank][0]).sum().backward()
        with pytest.raises(RuntimeError) as with_grads:  # a gradient views the reduce-scatter output, as FSDP2's
            copy.deepcopy(model.layers[2])
        seen.append(type(with_grads.value))
        outcomes.append(seen)
    ours, theirs = outcomes
    averaged, loaded, live = ours[3], ours[4], ours[5]
    assert not torch.equal(averaged["weight"], live["layers.2.weight"])  # half way from the first copy's values
    torch.testing.assert_close(loaded, {"weight": torch.full((3, 5), 6.0), "bias": torch.full((3,), 3.0)})
    for mine, their in zip(ours, theirs, strict=True):
        if isinstance(mine, type):
            assert mine is their
        else:
            torch.testing.assert_close(mine, their, rtol=0, atol=0)


def test_deepcopy_of_a_plain_submodule() -> None:
    """``copy.deepcopy`` of a module or parameter inside a sharded model gives DTensor copies, as on FSDP2 (the
    sharded parameters' local tensors start storages of their own: [Note: Own-storage views])."""
    run_ranks(4, _deepcopy_submodule)


def _list_group_without_root(rank: int, world_size: int) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 3))

    _, model = run_parity(rank, world_size, build, lambda m: fully_shard([m[0], m[2]]), regression_batch, mse_loss,
                          steps=3)
    assert not isinstance(model, FSDPModule) and isinstance(model[0], FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_list_group_without_a_sharded_root() -> None:
    """FSDP2 raises "FSDP requires a single root module"; the listed modules' group trains as unsharded."""
    run_ranks(2, _list_group_without_root)


def test_torch_policy_objects_are_accepted() -> None:
    """``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` imported from ``torch.distributed.fsdp`` work as this
    package's own: the same training, bit for bit."""
    run_ranks(2, _torch_policies)


# ---- a parameter tied across groups stays tied (see [Note: Tied parameters across groups]) -------------


def shard_tied(layout: str, model: nn.Module) -> None:
    """``model.head.weight is model.tok.weight``; the tie's modules sharded in separate calls."""
    if layout == "tied_after_all":  # untied while every fully_shard call runs, tied before the first forward
        model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    fully_shard(model.tok)
    if layout in ("siblings", "tied_after_all"):
        fully_shard(model.head)
    elif layout == "tied_after":
        model.head.weight = model.tok.weight  # the tok group's sharded parameter
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if layout == "tied_after_all":
        model.head.weight = model.tok.weight


def _tie_across_groups(rank: int, world_size: int, layout: str) -> None:
    _, model = run_parity(rank, world_size, Transformer, functools.partial(shard_tied, layout), token_batch, lm_loss)
    assert model.tok.weight is model.head.weight  # still one parameter, trained once
    root = state_of(model).group
    tied = [p for p in root.params if p.sharded is model.tok.weight]
    assert len(tied) == 1 and {site.module for site in tied[0].sites} == {model.tok, model.head}
    assert state_of(model.tok).group is None  # its only parameter moved to the root's group
    if layout in ("siblings", "tied_after_all"):
        assert state_of(model.head).group is None
    # One all-gather of the root serves both users; none for tok (or head).
    rec = CommRecorder(model)
    lm_loss(model, token_batch(torch.Generator().manual_seed(5)))
    assert [e for e in rec.events if e[0] == "ag"] == [("ag", "root"), ("ag", "blocks.0"), ("ag", "blocks.1")], rec.events
    rec.close()
    sd = model.state_dict()
    assert sd["tok.weight"].placements == (Shard(0),) and torch.equal(sd["tok.weight"].to_local(), sd["head.weight"].to_local())


@pytest.mark.parametrize("layout", ["siblings", "nested", "tied_after", "tied_after_all"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_tie_across_groups_trains_tied(layout: str, world_size: int) -> None:
    run_ranks(world_size, _tie_across_groups, layout)


class Pair(nn.Module):
    """Two same-shaped layers and nothing of its own: its fully_shard call forms no group until they are tied."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 5, bias=False)
        self.b = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _tie_after_every_call_under_a_bare_root(rank: int, world_size: int) -> None:
    def build() -> Pair:
        pair = Pair()
        pair.b.weight = pair.a.weight
        return pair

    def shard(pair: Pair) -> None:
        pair.b.weight = nn.Parameter(pair.a.weight.detach().clone())  # untied while sharding
        fully_shard(pair.a)
        fully_shard(pair.b)
        fully_shard(pair)
        tied = pair.a.weight
        pair.b.weight = tied  # tied after every call: the root, which had no group, takes it over
        assert state_of(pair).group is None

    _, model = run_parity(rank, world_size, build, shard, lambda g: regression_batch(g, 5, 5), mse_loss)
    assert model.a.weight is model.b.weight
    assert state_of(model).group is not None and state_of(model.a).group is None


def _late_tie_survives_a_load(rank: int, world_size: int) -> None:
    """A checkpoint loaded between the tie and the first forward (a resumed job) keeps the tie."""
    def build() -> Pair:
        pair = Pair()
        pair.b.weight = pair.a.weight
        return pair

    def shard(pair: Pair) -> None:
        pair.b.weight = nn.Parameter(pair.a.weight.detach().clone())
        fully_shard(pair.a)
        fully_shard(pair.b)
        fully_shard(pair)
        pair.b.weight = pair.a.weight
        pair.load_state_dict(pair.state_dict())  # its hooks must not take the tied parameter for b's own

    _, model = run_parity(rank, world_size, build, shard, lambda g: regression_batch(g, 5, 5), mse_loss)
    assert model.a.weight is model.b.weight


def test_tie_after_every_call_trains_tied() -> None:
    run_ranks(2, _tie_after_every_call_under_a_bare_root)
    run_ranks(2, _late_tie_survives_a_load)


def _tie_without_common_ancestor(rank: int, world_size: int) -> None:
    model = Transformer()
    fully_shard(model.tok)
    fully_shard(model.head)  # and nothing enclosing both: each group would train its own copy
    tokens = token_batch(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"Parameter 'weight' is shared with 'weight', a parameter already managed by"):
        lm_loss(model, tokens)
    # The same tie made after both calls.
    model = Transformer()
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    fully_shard(model.tok)
    fully_shard(model.head)
    model.head.weight = model.tok.weight
    with pytest.raises(ValueError, match=r"'weight' was tied after fully_shard to 'weight', a parameter already managed"):
        lm_loss(model, tokens)


def _tie_sharded_differently(rank: int, world_size: int) -> None:
    model = Transformer()
    fully_shard(model.tok, shard_placement_fn=lambda p: Shard(1))
    before = model.tok.weight
    with pytest.raises(ValueError, match=r"'head.weight' is tied to 'weight' of the fully_shard group of 'Embedding', which "
                                         r"shards it on another mesh or dim"):
        fully_shard(model)
    assert state_of(model.tok).group.params[0].sharded is before and not isinstance(model, FSDPModule)


def test_tie_errors() -> None:
    run_ranks(2, _tie_without_common_ancestor)
    run_ranks(2, _tie_sharded_differently)


class SharedBlocks(nn.Module):
    """Two blocks that both use one module (a block shared by two layers, as in Zamba's hybrid layers)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(5, 5)
        self.a = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), shared)
        self.b = nn.Sequential(shared, nn.Tanh(), nn.Linear(5, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _module_shared_by_two_calls(rank: int, world_size: int, layout: str) -> None:
    def shard(model: SharedBlocks) -> None:
        if layout == "list":
            fully_shard([model.a, model.b])
        else:
            fully_shard(model.a)
            fully_shard(model.b)  # leaves the shared module's parameters to a call enclosing both
        fully_shard(model, reshard_after_forward=layout == "root_resharded")

    _, model = run_parity(rank, world_size, SharedBlocks, shard, lambda g: regression_batch(g, 5, 3), mse_loss)
    assert model.a[2] is model.b[0] and isinstance(model.a[2].weight, DTensor)
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert {"a.2.weight", "b.0.weight"} <= own
    if layout == "list":  # the list call encloses both paths: its group holds the shared module
        assert {p.fqn for p in state_of(model.a).group.params} >= {"a.2.weight", "a.2.bias"}
    else:  # the root's call takes it, and only one group all-gathers it
        assert {p.fqn for p in state_of(model).group.params} == {"head.weight", "head.bias", "a.2.weight", "a.2.bias"}
        assert {p.fqn for p in state_of(model.b).group.params} == {"b.2.weight", "b.2.bias"}
        assert {p.fqn for p in state_of(model.a).group.params} == {"a.0.weight", "a.0.bias"}


def _module_shared_without_common_call(rank: int, world_size: int) -> None:
    model = SharedBlocks()
    bf16 = fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model.a, mp_policy=bf16)
    fully_shard(model.b, mp_policy=bf16)
    with pytest.raises(ValueError, match=r"parameter '2.weight' belongs to a module shared by fully_shard calls .* "
                                         r"gathered in torch.float32, while the call on 'Sequential' computes it in "
                                         r"torch.bfloat16: pass the same mp_policy"):
        fully_shard(model)  # (its forward would meet fp32 weights among bf16 activations)
    model = SharedBlocks()
    fully_shard(model.a)
    fully_shard(model.b)
    opt = torch.optim.SGD(model.a.parameters(), lr=0.1)  # holds a's sharded shared weight, which the next call replaces
    fully_shard(model)
    mse_loss(model, regression_batch(torch.Generator().manual_seed(rank), 5, 3)).backward()
    with pytest.raises(ValueError, match=r"holds the original parameter 'a.2.weight', which fully_shard replaced .* an "
                                         r"enclosing call replaced when it took it over"):
        opt.step()  # (it stepped nothing, silently)
    model = SharedBlocks()
    fully_shard(model.a, reshard_after_forward=True)
    fully_shard(model.b, reshard_after_forward=True)  # nothing encloses both: a's group alone shards the module
    with pytest.raises((ValueError, TypeError), match=r"parameter '0.weight' is sharded by a fully_shard call outside "
                       r"this root's module tree .*call fully_shard on a common ancestor"):
        model(torch.randn(2, 5))


@pytest.mark.parametrize("layout", ["siblings", "root_resharded", "list"])
def test_module_shared_by_two_calls_trains_as_unsharded(layout: str) -> None:
    """torch's FSDP2 raises for a module under two fully_shard calls ("Invariant encountered"); here the nearest
    call enclosing both takes its parameters, as for a tie across groups."""
    run_ranks(2, _module_shared_by_two_calls, layout)
    if layout == "siblings":
        run_ranks(4, _module_shared_by_two_calls, layout)
        run_ranks(2, _module_shared_without_common_call)


class MixedBlock(nn.Module):
    """Layers of two dtypes: its group all-gathers through codecs ([Note: Mixed dtypes] in group.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin32 = nn.Linear(4, 4)
        self.lin64 = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin64(torch.tanh(self.lin32(x)).double())).float()


class TiedMixed(nn.Module):
    """A mixed-dtype block whose first weight the head uses too."""

    def __init__(self) -> None:
        super().__init__()
        self.first = MixedBlock()
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.first.lin32.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x))


def _tie_leaves_a_group_with_codecs(rank: int, world_size: int) -> None:
    def shard(model: TiedMixed) -> None:
        fully_shard(model.first)
        fully_shard(model)  # takes the tied weight out of first's group, which keeps its other three

    _, model = run_parity(rank, world_size, TiedMixed, shard, lambda g: regression_batch(g, 4, 4), mse_loss)
    assert [p.fqn for p in state_of(model.first).group.params] == ["first.lin32.bias", "first.lin64.weight",
                                                                  "first.lin64.bias"]


def test_a_tie_taken_from_a_group_with_codecs() -> None:
    run_ranks(2, _tie_leaves_a_group_with_codecs)


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


def _reassigned_after_fully_shard(rank: int, world_size: int, init: str, then: str) -> None:
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
    dtype = torch.float64 if then == "convert" else torch.float32
    if then == "convert":
        # A weight in a group with other parameters too, then a conversion before the first forward:
        # what is converted is the assigned value, not the sharded parameter it replaced.
        with torch.no_grad():
            model.layer1.weight = nn.Parameter(model.layer1.weight * 0.5)
            ref.layer1.weight.mul_(0.5)
        model.to(dtype)
        ref.to(dtype)
    if then in ("load", "load_assign"):  # as a resumed run does before its first forward: into the assigned object
        with torch.no_grad():
            ref.scale.mul_(0.5)
        model.load_state_dict(copy.deepcopy(ref.state_dict()), assign=then == "load_assign")
        assert model.scale is scale_param
    batches = random_batches(3, world_size, regression_batch)
    loss_fn = lambda m, b: (m(b[0].to(dtype)) - b[1][:, :1].to(dtype)).square().mean()  # noqa: E731
    trace = train(model, batches, loss_fn, rank=rank)
    assert_parity(train(ref, batches, loss_fn, rank=None), trace, rank)
    # The assigned object stays the parameter (the optimizer was built before the first forward).
    assert model.scale is scale_param and model.scale.placements == (Shard(0),)
    assert {p.to_local().dtype for p in model.parameters()} == {dtype}


@pytest.mark.parametrize("then", ["train", "convert", "load", "load_assign"])
@pytest.mark.parametrize("init", ["meta", "dtensor", "replicated"])
def test_parameter_assigned_after_fully_shard(init: str, then: str) -> None:
    run_ranks(2, _reassigned_after_fully_shard, init, then)


class TokHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(x)))


def _tok_head_pair(per_layer: bool = True, mesh: DeviceMesh | None = None) -> tuple[TokHead, TokHead]:
    """The reference and a copy with one group per layer and the root (or the root's group only)."""
    torch.manual_seed(0)
    model = TokHead()
    ref = copy.deepcopy(model)
    if per_layer:
        fully_shard(model.tok, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return ref, model


def _assigned_and_tied(rank: int, world_size: int, steps: str) -> None:
    ref, model = _tok_head_pair()
    dtype = torch.float32
    for step in steps.split("-"):  # the same on the sharded model and the reference, as plain PyTorch means it
        if step == "assign":
            with torch.no_grad():
                model.tok.weight = nn.Parameter(model.tok.weight * 2)
                ref.tok.weight = nn.Parameter(ref.tok.weight * 2)
        elif step == "tie":
            model.head.weight = model.tok.weight
            ref.head.weight = ref.tok.weight
        elif step == "convert":
            dtype = torch.float64
            model.to(dtype)
            ref.to(dtype)
        elif step == "load":
            model.load_state_dict(copy.deepcopy(ref.state_dict()))
    batches = random_batches(3, world_size, functools.partial(regression_batch, in_dim=4, out_dim=4))
    loss_fn = lambda m, b: (m(b[0].to(dtype)) - b[1].to(dtype)).square().mean()  # noqa: E731
    trace = train(model, batches, loss_fn, rank=rank)
    assert_parity(train(ref, batches, loss_fn, rank=None), trace, rank)
    assert (model.head.weight is model.tok.weight) == (ref.head.weight is ref.tok.weight)
    assert len(list(model.parameters())) == len(list(ref.parameters()))


@pytest.mark.parametrize("steps", ["assign-tie", "assign-convert-tie", "assign-load-tie", "tie-assign",
                                   "tie-assign-convert", "tie-assign-load"])
def test_parameter_assigned_and_tied_after_fully_shard(steps: str) -> None:
    """An assigned DTensor tied to another group's module (one parameter, trained once), or a tie whose source
    is then replaced (two parameters), with a conversion or a load before the first forward."""
    run_ranks(2, _assigned_and_tied, steps)


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


def _change(model: TokHead, change: str, replicated: bool) -> list[nn.Parameter]:
    """Change ``model`` as plain PyTorch code does between two steps; the new parameters, for the optimizer."""
    if change == "assign":  # a re-initialised weight, computed from the sharded one (a DTensor)
        with torch.no_grad():
            value = model.tok.weight * 2 + 1
            if isinstance(model, FSDPModule) and not isinstance(value, DTensor):  # from the unsharded weight
                value = distribute_tensor(value, model.head.weight.device_mesh, [Replicate()])
            elif replicated and isinstance(value, DTensor):
                value = value.redistribute(placements=[Replicate()])
            model.tok.weight = nn.Parameter(value)
        return [model.tok.weight]
    if change == "tie":
        model.head.weight = model.tok.weight
        return []
    if change == "untie":  # the head gets a copy of its own again
        with torch.no_grad():
            model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
        return [model.head.weight]
    if change == "swap":  # the two layers exchange their weights
        model.tok.weight, model.head.weight = model.head.weight, model.tok.weight
        return []
    torch.manual_seed(1)  # a new head, sharded before it is put in place
    model.head = nn.Linear(4, 4, bias=False)
    if isinstance(model, FSDPModule):
        fully_shard(model.head)
    return list(model.head.parameters())


def _changed_between_steps(rank: int, world_size: int, change: str, then: str) -> None:
    """What plain PyTorch code does to a model between two steps, done to the sharded model after its first
    steps: the rest of training matches the unsharded model changed alike. ``then``: what runs between the
    change and the next forward; with ``forward_only``, ``float``, ``async_unshard`` and ``state_dict`` a
    forward without backward before the change leaves tok.weight's group unsharded; ``mid_step``: the change
    comes between a step's forward and its backward."""
    ref, model = _tok_head_pair(per_layer=then != "flat_adamw")  # flat: one group loses or gains a parameter
    if change == "untie":
        model.head.weight = model.tok.weight
        ref.head.weight = ref.tok.weight
    unsharded_first = then in ("forward_only", "float", "async_unshard", "state_dict")
    if unsharded_first:
        model.tok.set_reshard_after_forward(False)
    if then == "flat_adamw":  # steps each group's flat shard, with flat state buffers cut for its parameters
        opt, ref_opt = fullshard.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    else:
        opt, ref_opt = sgd_momentum(model.parameters()), sgd_momentum(ref.parameters())
    old_head = model.head
    ema, ref_ema = (EMA(model, 0.5), EMA(ref, 0.5)) if then == "ema" else (None, None)
    batches = random_batches(4, world_size, functools.partial(regression_batch, in_dim=4, out_dim=4))
    loss_fn = lambda m, b: (m(b[0]) - b[1]).square().mean()  # noqa: E731
    assert_parity(train(ref, batches[:2], loss_fn, rank=None, optim=ref_opt),
                  train(model, batches[:2], loss_fn, rank=rank, optim=opt), rank)
    if unsharded_first:  # a metric computed with grad enabled: tok.weight's group stays unsharded
        loss_fn(model, batches[2][rank])
        assert any(s.group.state is ShardedState.UNSHARDED for s in states_in(model) if s.group is not None)
    handle = model.tok.unshard(async_op=True) if then == "async_unshard" else None
    if then == "mid_step":  # the backward reaches the parameters the forward used, as on the reference
        loss, ref_loss = loss_fn(model, batches[2][rank]), sum(loss_fn(ref, b) for b in batches[2]) / world_size
    for m, o in ((model, opt), (ref, ref_opt)):
        new = _change(m, change, replicated=then != "none")
        if new:
            o.add_param_group({"params": new})
    if then == "mid_step":
        for o, finish in ((opt, loss), (ref_opt, ref_loss)):
            finish.backward()
            o.step()
            o.zero_grad()
        batches = batches[:2] + batches[3:]
    elif handle is not None:
        handle.wait()
    elif then == "float":
        model.float()
    elif then == "state_dict":
        model.load_state_dict(model.state_dict())
    elif then == "unshard":
        for module in [model, model.tok, model.head]:
            module.unshard()
            module.reshard()
    elif then == "summon":
        with summon_full_params(model, offload_to_cpu=True):
            assert all(p.shape == (4, 4) and not isinstance(p, DTensor) for p in model.parameters())
            assert all(isinstance(v, DTensor) for v in model.state_dict().values())  # not the CPU copies
    elif ema is not None and ref_ema is not None:
        ema.update()
        ref_ema.update()
    trace = train(model, batches[2:], loss_fn, rank=rank, optim=opt)
    assert_parity(train(ref, batches[2:], loss_fn, rank=None, optim=ref_opt), trace, rank)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    assert (model.head.weight is model.tok.weight) == (ref.head.weight is ref.tok.weight)
    if old_head is not model.head and state_of(old_head).group is not None:  # left the tree, not all-gathered since
        old_group = state_of(old_head).group
        assert old_group.state is ShardedState.SHARDED and old_group.unsharded_buffer.untyped_storage().nbytes() == 0
    if ema is not None and ref_ema is not None:
        ema.update()
        ref_ema.update()
        torch.testing.assert_close(ema.full_state_dict(rank0_only=False), ref_ema.full_state_dict(rank0_only=False))


@pytest.mark.parametrize("change,then", [
    ("assign", "none"), ("tie", "none"), ("replace", "none"), ("untie", "none"),
    ("assign", "forward_only"), ("tie", "forward_only"), ("replace", "forward_only"),
    ("assign", "unshard"), ("tie", "summon"), ("assign", "ema"), ("tie", "flat_adamw"), ("untie", "flat_adamw"),
    ("swap", "none"), ("swap", "flat_adamw"), ("assign", "mid_step"), ("tie", "mid_step"), ("tie", "float"),
    ("assign", "async_unshard"), ("tie", "state_dict"),
])
def test_model_changed_after_the_first_steps(change: str, then: str) -> None:
    """FSDP2 trains on with the parameters it sharded (an assignment or a tie is silently ignored)."""
    run_ranks(2, _changed_between_steps, change, then)


def _changed_between_micro_batches(rank: int, world_size: int, change: str, mode: str) -> None:
    """A change between two micro-batches of one step: the gradients the others accumulated stay (``no_sync``:
    unreduced until the last micro-batch; ``no_all_reduce``: HSDP partial sums), as on the unsharded model."""
    hsdp = mode == "no_all_reduce"
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    ref, model = _tok_head_pair(mesh=mesh)
    opt, ref_opt = sgd_momentum(model.parameters()), sgd_momentum(ref.parameters())
    loss_fn = lambda m, b: (m(b[0]) - b[1]).square().mean()  # noqa: E731
    for i, step_batches in enumerate(random_batches(2, world_size, functools.partial(regression_batch, in_dim=4, out_dim=4))):
        if i == 1:
            for m, o in ((model, opt), (ref, ref_opt)):
                new = _change(m, change, replicated=False)
                if new:
                    o.add_param_group({"params": new})
        if mode == "no_sync":
            model.set_requires_gradient_sync(i == 1)
        elif hsdp:
            model.set_requires_all_reduce(i == 1)
        (loss_fn(model, step_batches[rank]) / 2).backward()
        (sum(loss_fn(ref, b) for b in step_batches) / len(step_batches) / 2).backward()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(full_params(model), full_params(ref))


@pytest.mark.parametrize("mode", ["sync", "no_sync", "no_all_reduce"])
@pytest.mark.parametrize("change", ["assign", "tie"])
def test_model_changed_between_micro_batches(change: str, mode: str) -> None:
    run_ranks(4 if mode == "no_all_reduce" else 2, _changed_between_micro_batches, change, mode)


def _unmanaged_after_the_first_steps(rank: int, world_size: int, change: str) -> None:
    model = TokHead()
    fully_shard(model.head)
    fully_shard(model)
    batch = (torch.randn(2, 4), torch.randn(2, 4))
    mse_loss(model, batch).backward()
    if change == "plain":
        model.head.weight = nn.Parameter(torch.ones(4, 4))
        with pytest.raises(ValueError, match=r"'head\.weight' was re-assigned after fully_shard with a plain tensor"):
            mse_loss(model, batch)
        assert torch.equal(model.state_dict()["head.weight"], torch.ones(4, 4))  # what is registered, as FSDP2
    else:
        model.head = nn.Linear(4, 4)
        with pytest.warns(UserWarning, match=r"registered after fully_shard .* own copy: head\.weight, head\.bias; "):
            mse_loss(model, batch)


@pytest.mark.parametrize("change", ["plain", "replace"])
def test_model_changed_after_the_first_steps_unmanaged(change: str) -> None:
    """A plain tensor assigned in place of a sharded parameter raises at the next forward (FSDP2 trains on with
    the parameter it sharded); a module put in place unsharded warns that each rank trains its own copy."""
    run_ranks(2, _unmanaged_after_the_first_steps, change)


def _assigned_inside_summon(rank: int, world_size: int) -> None:
    _, model = _tok_head_pair()
    with pytest.warns(UserWarning, match=r"assigned inside summon_full_params are not kept: head\.weight get the "):
        with summon_full_params(model, writeback=True):
            model.head.weight = model.tok.weight
    assert model.head.weight is not model.tok.weight and isinstance(model.head.weight, DTensor)
    torch.testing.assert_close(model.head.weight.full_tensor(), model.tok.weight.full_tensor())  # written back


def test_parameters_assigned_inside_summon_full_params_warn() -> None:
    """As FSDP1 documents, the context does not take assignments over; fullshard says so instead of dropping
    them silently."""
    run_ranks(2, _assigned_inside_summon)
