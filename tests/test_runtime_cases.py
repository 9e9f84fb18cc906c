"""What real models do to the runtime: outputs in dataclasses, list groups, changing control flow, hooks on
sharded parameters (optimizer in backward), zero-element parameters, HSDP partial sums, setter semantics."""

from __future__ import annotations

import functools
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import FSDPModule, clip_grad_norm_, fully_shard
from fullshard import optim as fs_optim
from fullshard.group import ShardedState
from fullshard.runtime import state_of, states_in
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import assert_parity, full_params, random_batches, regression_batch, run_parity, train
from tests.test_training_patterns import Reused, shard_reused

# ---- outputs in dataclasses, namedtuples and nested containers --------------------------------------


@dataclass
class BlockOut:
    hidden: torch.Tensor
    extras: dict[str, Any]


Pair = namedtuple("Pair", ["main", "side"])


class ContainerBlock(nn.Module):
    """Returns its tensors inside a plain dataclass (one of them nested in a dict and a list)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> BlockOut:
        return BlockOut(torch.tanh(self.lin(x)), {"gates": [torch.sigmoid(self.gate(x))]})


class PairBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(self.a(x), {"nested": (self.b(x), None)})


class ContainerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.blocks = nn.ModuleList([ContainerBlock(6), PairBlock(6), ContainerBlock(6)])
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            out = block(h)
            if isinstance(out, BlockOut):
                h = out.hidden * out.extras["gates"][0]
            else:
                h = out.main + out.side["nested"][0]
        return self.out(h)


def shard_blocks(model: nn.Module, reshard_after_forward: bool | None = None, also: tuple[str, ...] = ()) -> None:
    """One group per block (and per module named in ``also``), one for the root."""
    for block in [*model.blocks, *(getattr(model, name) for name in also)]:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)


def step_of(model: nn.Module) -> int:
    """The training step of this loss call: the unsharded reference runs every rank's batch in a step."""
    calls = getattr(model, "loss_calls", 0)
    model.loss_calls = calls + 1
    return calls // (1 if isinstance(model, FSDPModule) else dist.get_world_size())


def _container_outputs(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, ContainerModel, shard_blocks, regression_batch, mse_loss)


@pytest.mark.parametrize("world_size", [2, 4])
def test_outputs_in_dataclasses_and_namedtuples(world_size: int) -> None:
    run_ranks(world_size, _container_outputs)


# ---- outputs that are views, modified in place by the caller ---------------------------------------------


class ViewBlock(nn.Module):
    """Returns a view of its result (a reshape, a slice or a transpose), which the caller changes in place."""

    def __init__(self, dim: int, view: str) -> None:
        super().__init__()
        self.view = view
        self.lin = nn.Linear(dim, 2 * dim if view == "slice" else dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.view == "slice":
            return y[:, 1::2]
        if self.view == "transpose":
            return y.t()
        return y.view(-1, 3).view(x.shape)


class ViewModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.blocks = nn.ModuleList([ViewBlock(6, v) for v in ("reshape", "slice", "reshape")])
        self.side = ViewBlock(6, "transpose")  # applied across the batch of 6 rows
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            h += 0.5  # the block's output view changes in place: its history is rebased onto the base's
            if i == 1:
                h.mul_(torch.sigmoid(h.detach()))
        t = self.side(h.t())
        t.add_(h)
        out = self.out(t)
        out += 1.0
        return out


def _view_outputs(rank: int, world_size: int, reshard: bool) -> None:
    shard = functools.partial(shard_blocks, reshard_after_forward=reshard, also=("side",))
    run_parity(rank, world_size, ViewModel, shard, regression_batch, mse_loss)


@pytest.mark.parametrize("reshard", [True, False])
def test_outputs_that_are_views_changed_in_place(reshard: bool) -> None:
    # FSDP2's backward hook is lost with the view's history: its backward fails on a freed parameter.
    run_ranks(2, _view_outputs, reshard)


class InPlaceInputModel(nn.Module):
    """Sharded blocks that change their inputs in place: ``nn.ReLU(inplace=True)`` first, an in-place scale."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.blocks = nn.ModuleList([nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6)) for _ in range(2)])
        self.scale = ScaleInPlace(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.scale(h))


class ScaleInPlace(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(self.weight)
        return x


def _in_place_inputs(rank: int, world_size: int) -> None:
    shard = functools.partial(shard_blocks, also=("scale",))
    run_parity(rank, world_size, InPlaceInputModel, shard, regression_batch, mse_loss)
    # Changing an input that an earlier operation saved for its backward is caught, as without sharding.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Sigmoid(), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6)))
    fully_shard(model[2])
    fully_shard(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(4, 6)).sum().backward()


def test_modules_that_change_their_inputs_in_place() -> None:
    # FSDP2's backward hook returns the inputs as views of a custom Function: changing them in place raises.
    run_ranks(2, _in_place_inputs)


# ---- double backward: a gradient penalty through torch.autograd.grad(create_graph=True) ---------------


class TanhStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def penalty_every_second_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An input-gradient penalty (as WGAN-GP and R1 have it) on even steps, a plain loss on odd ones; a forward
    runs between the penalty's create_graph backward and the final backward."""
    x, y = batch
    if step_of(model) % 2:
        return (model(x) - y).square().mean()
    x = x.clone().requires_grad_(True)
    pred = model(x)
    (grad_x,) = torch.autograd.grad(pred.square().sum(), x, create_graph=True)
    other = model(x.detach().flip(0))
    return (pred - y).square().mean() + 0.1 * grad_x.square().sum() + 0.5 * other.square().mean()


def _double_backward(rank: int, world_size: int, reshard: bool) -> None:
    shard = functools.partial(shard_blocks, reshard_after_forward=reshard)
    _, model = run_parity(rank, world_size, TanhStack, shard, regression_batch, penalty_every_second_step, steps=4)
    assert all(s.group is None or s.group.state is ShardedState.SHARDED for s in states_in(model))


@pytest.mark.parametrize("reshard", [True, False])
def test_gradient_penalty_through_a_double_backward(reshard: bool) -> None:
    # FSDP2 frees the parameters that the create_graph backward's graph saved: the final backward fails.
    run_ranks(2, _double_backward, reshard)


# ---- the sharded parameters change while groups hold unsharded values ------------------------------


def _between_backward_and_step(model: nn.Module, params: list[torch.Tensor], case: str, xs: list[torch.Tensor],
                                loss: torch.Tensor) -> None:
    """What runs after the forward in ``case``: its backward, then what leaves groups unsharded before the step."""
    if case == "create_graph":  # the step's last backward builds a graph (Hessian-based methods do)
        loss.backward(create_graph=True)
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad.detach()
        return
    loss.backward(retain_graph=case == "logged_input_grad")
    if case == "logged_input_grad":  # a gradient norm logged, never back-propagated
        torch.autograd.grad(loss, xs, create_graph=True)
    elif case in ("metric", "metric_and_edit"):  # a metric computed with grad enabled
        model(xs[0].detach()).square().mean()
    if case == "metric_and_edit":  # in-place writes to the optimizer's (sharded) parameters, as a rescaling
        with torch.no_grad():
            for p in params:
                p.mul_(0.9)


def _changed_while_unsharded(rank: int, world_size: int, case: str, optimizer: str) -> None:
    make_optim = {"sgd": functools.partial(torch.optim.SGD, lr=0.1),
                  "flat_adamw": functools.partial(fs_optim.AdamW, lr=0.01, foreach=True)}[optimizer]
    batches = random_batches(3, world_size, regression_batch)
    traces = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = TanhStack()
        if sharded:
            # A metric forward leaves every group unsharded, the others only the root.
            shard_blocks(model, reshard_after_forward=case not in ("metric", "metric_and_edit"))
            if case == "no_reshard_after_backward":
                model.set_reshard_after_backward(False)
        opt, losses, norms = make_optim(model.parameters()), [], []
        for step in batches:
            xs = [b[0].clone().requires_grad_(True) for b in (step[rank:rank + 1] if sharded else step)]
            per_rank = [(model(x) - b[1]).square().mean() for x, b in zip(xs, step[rank:rank + 1] if sharded else step)]
            loss = sum(per_rank) / len(per_rank)
            params = opt.param_groups[0]["params"]
            _between_backward_and_step(model, params, case, xs, loss)
            if case in ("create_graph", "logged_input_grad"):  # the sharded parameters are registered again
                assert [id(p) for p in model.parameters()] == [id(p) for p in params]
            norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
            # fullshard's clipping of the model finds the sharded parameters also where the modules hold unsharded ones
            norms.append(torch.stack([norm.full_tensor(), clip_grad_norm_(model, 1e9)]) if sharded else norm.repeat(2))
            opt.step()
            if sharded:  # the step registered the sharded parameters on the groups left unsharded
                assert [id(p) for p in model.parameters()] == [id(p) for p in params]
            opt.zero_grad()
            losses.append(per_rank[0].detach() if sharded else per_rank[rank].detach())
        traces.append((losses, norms, full_params(model)))
    (ref_losses, ref_norms, ref_params), (losses, norms, params) = traces
    torch.testing.assert_close(losses, ref_losses)
    torch.testing.assert_close(norms, ref_norms)
    torch.testing.assert_close(params, ref_params)


@pytest.mark.parametrize("case,optimizer", [
    ("create_graph", "sgd"), ("logged_input_grad", "sgd"), ("metric", "sgd"), ("metric", "flat_adamw"),
    ("metric_and_edit", "sgd"), ("no_reshard_after_backward", "sgd"), ("no_reshard_after_backward", "flat_adamw"),
])
def test_sharded_parameters_changed_while_unsharded(case: str, optimizer: str) -> None:
    """An optimizer step (or an in-place edit) while groups still hold unsharded values from before it: the next
    forward uses the new values, as the unsharded model does ([Note: Sharded parameters changed while unsharded]).
    FSDP2 trains on with the old values in every case but the two create_graph ones. After a create_graph
    backward the sharded parameters are registered again, as after any backward (clipping ``model.parameters()``
    sees their gradients), and after every step."""
    run_ranks(2, _changed_while_unsharded, case, optimizer)


class TiedHead(nn.Module):
    """An embedding-like root layer whose weight the loss uses again after forward (a tied output head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6, bias=False)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(x))


def _other_step_before_backward(rank: int, world_size: int) -> None:
    traces = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model, other = TiedHead(), nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 3))
        if sharded:
            fully_shard(model.body)
            fully_shard(model)
            fully_shard(other)
        opt, other_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            xs = torch.randn(world_size, 4, generator=torch.Generator().manual_seed(step))
            h = model(xs[rank:rank + 1] if sharded else xs)
            per_row = (h @ model.emb.weight).square().mean(-1)  # the root's weight, saved outside its hooks
            other(torch.randn(2, 3, generator=torch.Generator().manual_seed(9))).sum().backward()
            other(torch.randn(2, 3)).sum()  # other's root stays unsharded: its own step reshards it
            other_opt.step()  # another optimizer: the model's forward still waits for its backward
            other_opt.zero_grad()
            if sharded:
                assert all(not isinstance(p, DTensor) for p in model.emb.parameters())  # not resharded by it
                assert all(isinstance(p, DTensor) for p in other.parameters())
            per_row.mean().backward()
            opt.step()
            opt.zero_grad()
            losses.append(per_row[0 if sharded else rank].detach())
        traces.append((losses, full_params(model), full_params(other)))
    (ref_losses, ref_params, ref_other), (losses, params, other_params) = traces
    torch.testing.assert_close(losses, ref_losses)
    torch.testing.assert_close(params, ref_params)
    torch.testing.assert_close(other_params, ref_other)


def test_another_optimizer_steps_between_forward_and_backward() -> None:
    """The step pre-hook reshards only the groups whose parameters the stepping optimizer holds: a model whose
    forward waits for its backward keeps the unsharded parameters its graph saved outside the groups' hooks."""
    run_ranks(2, _other_step_before_backward)


def alternating_subsets(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A GAN-style schedule by ``requires_grad``: even steps train the first block only, odd steps the rest."""
    step = step_of(model)
    first = {id(p) for p in model.blocks[0].parameters()}
    for p in model.parameters():
        p.requires_grad_((id(p) in first) == (step % 2 == 0))
    x, y = batch
    return (model(x) - y).square().mean()


def _alternating_subsets(rank: int, world_size: int) -> None:
    run_parity(rank, world_size, TanhStack, shard_blocks, regression_batch, alternating_subsets, steps=4)


def test_requires_grad_toggled_between_steps() -> None:
    run_ranks(2, _alternating_subsets)


# ---- a list of modules is one group: one all-gather and one reduce-scatter per pass -----------------


class Towers(nn.Module):
    """Two towers used one after the other, sharded together as one list group."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(7, 6)
        self.left = nn.Linear(6, 6)
        self.right = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(torch.tanh(self.right(torch.tanh(self.left(h)))))


def shard_towers(model: nn.Module) -> None:
    fully_shard(model.stem)
    fully_shard([model.left, model.right])
    fully_shard(model)


def _list_group(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Towers, shard_towers, regression_batch, mse_loss)
    rec = CommRecorder(model)
    for step_batches in random_batches(2, world_size, regression_batch):
        mse_loss(model, step_batches[rank]).backward()
        events = rec.take()
        towers = [e for e in events if e[0] == "ag" and e[1] not in ("root", "stem")]
        # forward and backward: one all-gather each for the pair (reshard_after_forward), never one per module
        assert len(towers) == 2, events
        assert sum(e[0] == "rs" for e in events) == 3, events  # stem, towers, root
        assert state_of(model.left).group.state is ShardedState.SHARDED
    rec.close()


def test_list_group_collectives_once_per_pass() -> None:
    run_ranks(2, _list_group)


def _called_twice_reduces_once(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Reused()
    shard_reused(model)
    rec = CommRecorder(model)
    mse_loss(model, random_batches(1, world_size, regression_batch)[0][rank]).backward()
    # Backward keeps the block unsharded from its second call's backward to its first's (one all-gather),
    # then one reduce-scatter reduces the gradients of both calls.
    backward = rec.events[rec.events.index(("fwd", "block"), 4) + 1 :]
    # Reduce-scatter sizes: the gradients (36 and 72 elements) and one flag column per parameter and rank.
    assert backward == [("ag", "block"), ("rs", str(36 + 2 * 2)), ("rs", str(72 + 2 * 4))], rec.events
    rec.close()


def test_module_called_twice_reduces_once() -> None:
    run_ranks(2, _called_twice_reduces_once)


# ---- control flow that changes the order between iterations -----------------------------------------


class Skipping(MLP):
    """Runs layer 1 on odd steps only: the order of the groups changes every step."""

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:  # type: ignore[override]
        h = torch.relu(self.layers[0](x))
        if step % 2:
            h = torch.relu(self.layers[1](h))
        return self.layers[2](h)


def build_skipping() -> nn.Module:
    return Skipping((7, 13, 13, 3))


def shard_layers(model: nn.Module) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def skipping_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    x, y, step = batch
    return nn.functional.mse_loss(model(x, step), y)


def _changing_order(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = build_skipping()
    torch.manual_seed(0)
    model = build_skipping()
    shard_layers(model)
    root, layers = state_of(model), [state_of(layer) for layer in model.layers]

    def checked_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        step = batch[2]
        if step:  # the plan follows the previous step's order; the root prefetches the last layer in backward
            ran = layers if (step - 1) % 2 else [layers[0], layers[2]]
            assert root.ctx.forward_next[layers[0]] == [ran[1]], step
            assert root.ctx.backward_next[root] == [ran[-1]], step
        loss = skipping_loss(model, batch)
        held = [s.label for s in layers if s.group.state is not ShardedState.SHARDED]
        assert held == [], f"step {step}: a prefetch for a layer that did not run is still unsharded: {held}"
        return loss

    gen = torch.Generator().manual_seed(0)
    batches = [[(*regression_batch(gen), step) for _ in range(world_size)] for step in range(5)]
    trace = train(model, batches, checked_loss, rank=rank)
    assert_parity(train(ref, batches, skipping_loss, rank=None), trace, rank)


def test_control_flow_changes_the_order() -> None:
    run_ranks(2, _changing_order)


# ---- register_post_accumulate_grad_hook: optimizer in backward ---------------------------------------


def _optimizer_in_backward(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    model = MLP()
    shard_layers(model)
    fired: dict[str, int] = {}
    optims: dict[nn.Parameter, torch.optim.Optimizer] = {}
    names = {p: n for n, p in model.named_parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        assert param.grad is not None and param.grad.placements == param.placements  # the reduced sharded gradient
        fired[names[param]] = fired.get(names[param], 0) + 1
        optims[param].step()
        optims[param].zero_grad()

    for p in model.parameters():
        optims[p] = torch.optim.SGD([p], lr=0.05, momentum=0.9)
        p.register_post_accumulate_grad_hook(step_in_backward)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step, step_batches in enumerate(random_batches(3, world_size, regression_batch)):
        ref_losses = [mse_loss(ref, b) for b in step_batches]
        (sum(ref_losses) / world_size).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = mse_loss(model, step_batches[rank])
        torch.testing.assert_close(loss, ref_losses[rank].detach(), msg=f"step {step}")
        loss.backward()
        assert fired == dict.fromkeys(names.values(), step + 1), fired  # once per parameter per backward
        assert all(p.grad is None for p in model.parameters())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), msg=n)


def test_post_accumulate_grad_hooks_fire_once_per_backward() -> None:
    run_ranks(2, _optimizer_in_backward)


# ---- zero-element parameters --------------------------------------------------------------------------


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.empty_rows = nn.Parameter(torch.zeros(0, 5))
        self.empty_cols = nn.Parameter(torch.zeros(5, 0))
        self.b = nn.Linear(5, 3)
        self.nothing = nn.Linear(5, 0)  # a whole layer of zero elements, its own group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = h + (h @ self.empty_cols @ self.empty_rows) + self.nothing(h).sum()
        return self.b(h)


def shard_with_empty(model: nn.Module) -> None:
    fully_shard(model.nothing)
    fully_shard(model)


def _zero_element(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, WithEmpty, shard_with_empty, regression_batch, mse_loss)
    assert model.empty_rows.shape == (0, 5) and model.nothing.weight.shape == (0, 5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_element_parameters(world_size: int) -> None:
    run_ranks(world_size, _zero_element)


# ---- non-contiguous parameters (FSDP2: NotImplementedError) -----------------------------------------------


class Strided(nn.Module):
    """A channels_last convolution with 5 output channels (uneven on 2 and 4 ranks) and a weight that is a
    transpose (stride (1, 35))."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 5, (3, 1), padding=(1, 0)).to(memory_format=torch.channels_last)
        self.proj = nn.Parameter(torch.randn(3, 35).t() / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.view(-1, 2, 7, 1).contiguous(memory_format=torch.channels_last))
        return torch.tanh(h).flatten(1) @ self.proj


def shard_strided(when: str, model: Strided) -> None:
    assert not model.conv.weight.is_contiguous() and not model.proj.is_contiguous()
    fully_shard(model.conv)
    fully_shard(model)
    if when == "after":  # the sharded parameters converted; FSDP2 fails at the next all-gather
        model.to(memory_format=torch.channels_last)


def _non_contiguous(rank: int, world_size: int, when: str) -> None:
    _, model = run_parity(rank, world_size, Strided, functools.partial(shard_strided, when),
                          functools.partial(regression_batch, in_dim=14), mse_loss)
    assert model.proj.shape == (35, 3) and model.conv.weight.shape == (5, 2, 3, 1)


@pytest.mark.parametrize(("world_size", "when"), [(2, "before"), (4, "before"), (2, "after")])
def test_non_contiguous_parameters(world_size: int, when: str) -> None:
    run_ranks(world_size, _non_contiguous, when)


# ---- HSDP partial sums are never dropped --------------------------------------------------------------


class Gated(nn.Module):
    """``side`` (its own group) and ``main.bias2`` take part only when ``use_side``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(7, 3)
        self.extra = nn.Parameter(torch.zeros(3))
        self.side = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        out = self.main(x)
        return out + self.extra + self.side(x) if use_side else out


def _hsdp_partial_sums(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    ref = Gated()
    torch.manual_seed(0)
    model = Gated()
    fully_shard(model.side, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    rec = CommRecorder(model)
    for step, step_batches in enumerate(random_batches(3, world_size, regression_batch)):
        # Micro-batch 1 uses every parameter and keeps per-replica sums; micro-batch 2 uses neither `extra`
        # nor the `side` group, and all-reduces: their partial sums must still arrive. On step 1 neither
        # micro-batch uses them: they keep grad None (a zero gradient would move them by SGD's momentum).
        first_uses = step != 1
        ref_loss = sum(mse_loss_gated(ref, b, first_uses) + mse_loss_gated(ref, b, False) for b in step_batches)
        (ref_loss / world_size).backward()
        model.set_requires_all_reduce(False)
        mse_loss_gated(model, step_batches[rank], first_uses).backward()
        assert rec.count("ar") == 0, rec.events
        model.set_requires_all_reduce(True)
        model.set_requires_gradient_sync(True)  # does not undo the all-reduce setting either way
        mse_loss_gated(model, step_batches[rank], False).backward()
        events = rec.take()
        # The root group, and the side group where it ran (without partial sums it owes nothing).
        assert sum(e[0] == "ar" for e in events) == (2 if first_uses else 1), events
        params = dict(model.named_parameters())
        assert {n for n, p in params.items() if p.grad is not None} == {n for n, p in ref.named_parameters()
                                                                       if p.grad is not None}, step
        for n, p in ref.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(params[n].grad.full_tensor(), p.grad, msg=f"{step} {n}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n].full_tensor(), p, msg=f"{step} {n}")
    rec.close()


def mse_loss_gated(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], use_side: bool) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x, use_side), y)


@pytest.mark.parametrize("world_size", [2, 4])
def test_hsdp_partial_sums_never_dropped_nor_made_up(world_size: int) -> None:
    run_ranks(world_size, _hsdp_partial_sums)


# ---- setter semantics -----------------------------------------------------------------------------------


def _setters(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = MLP()
    shard_layers_on(model, mesh)
    model.set_requires_all_reduce(False)
    model.set_requires_gradient_sync(False)
    model.set_requires_gradient_sync(True)
    settings = [s.group.reducer.settings for s in states_in(model) if s.group is not None]
    assert all(s.requires_gradient_sync and not s.requires_all_reduce for s in settings)
    rec = CommRecorder(model)
    mse_loss(model, random_batches(1, world_size, regression_batch)[0][rank]).backward()
    assert rec.count("ar") == 0, rec.events  # sync on, all-reduce still off
    model.layers[0].set_requires_all_reduce(True, recurse=False)
    assert [s.requires_all_reduce for s in settings] == [True, False, False]
    rec.close()
    assert dist.get_world_size() == 2


def shard_layers_on(model: nn.Module, mesh: Any) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_setters_are_independent() -> None:
    run_ranks(2, _setters)


# ---- parameters used on some ranks only ---------------------------------------------------------------


class Experts(nn.Module):
    """A router-free mixture: each batch names the expert it uses; expert 2 is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(7, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.head(torch.relu(self.experts[expert](torch.relu(self.stem(x)))))


def expert_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    x, y = regression_batch(gen)
    return x, y, int(torch.randint(0, 2, (1,), generator=gen))


def expert_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    x, y, expert = batch
    return nn.functional.mse_loss(model(x, expert), y)


def _experts_parity(rank: int, world_size: int) -> None:
    batches = random_batches(6, world_size, expert_batch)
    assert any(len({b[2] for b in step}) > 1 for step in batches), "no step where the ranks chose different experts"

    def shard(model: nn.Module) -> None:  # the experts share one group with the stem and the head
        fully_shard(model)

    trace, _ = run_parity(rank, world_size, Experts, shard, expert_batch, expert_loss, steps=6)
    assert all(g["experts.2.weight"] is None for g in trace.grads), "an expert no rank used got a gradient"


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_used_on_some_ranks_get_the_average(world_size: int) -> None:
    run_ranks(world_size, _experts_parity)


class SideBlock(nn.Module):
    """A block whose own parameters are a side layer that only some calls use; its main layer is sharded inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(7, 8)
        self.side = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.relu(self.main(x))
        return h + self.side(h) if use_side else h


class WithSideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = SideBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        return self.head(self.block(x, use_side))


def _group_unused_on_some_ranks(rank: int, world_size: int) -> None:
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        x, y, batch_rank = batch
        return nn.functional.mse_loss(model(x, use_side=batch_rank == 0), y)

    batches = [[(*regression_batch(gen), r) for r in range(world_size)]
               for gen in [torch.Generator().manual_seed(s) for s in range(3)]]
    torch.manual_seed(0)
    ref = WithSideBlock()
    torch.manual_seed(0)
    model = WithSideBlock()
    fully_shard(model.block.main)
    fully_shard(model.block)  # its group is the side layer: on ranks other than 0 no parameter gets a gradient
    fully_shard(model)
    assert_parity(train(ref, batches, loss, rank=None), train(model, batches, loss, rank=rank), rank)


def test_group_whose_parameters_only_some_ranks_use() -> None:
    """A group none of whose parameters got a gradient on a rank still reduce-scatters there (zeros, flagged
    absent) when its module ran backward: the ranks issue the same collectives and the layer gets the average."""
    run_ranks(2, _group_unused_on_some_ranks)
