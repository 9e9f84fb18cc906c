"""MixedPrecisionPolicy: compute and all-gather in param_dtype, reduce in reduce_dtype, shards stay fp32."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from fullshard import FSDPModule, MixedPrecisionPolicy, fully_shard
from fullshard.runtime import state_of
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import regression_batch, run_parity, token_batch

BF16 = torch.bfloat16
TOL = {"rtol": 2e-2, "atol": 2e-2}


def reference_casts(loss_fn, param_dtype: torch.dtype, output_dtype: torch.dtype | None):  # type: ignore[no-untyped-def]
    """The sharded model's loss as is; the reference's with the same casts done by hand."""

    def loss(model: nn.Module, batch):  # type: ignore[no-untyped-def]
        if isinstance(model, FSDPModule):
            return loss_fn(model, batch)
        # Complex and integer parameters keep their dtype, as under FSDP2's policy
        cast_params = {n: p.to(param_dtype) if p.is_floating_point() else p for n, p in model.named_parameters()}

        class Cast(nn.Module):
            def forward(self, x):  # type: ignore[no-untyped-def]
                x = x.to(param_dtype) if x.is_floating_point() else x
                out = functional_call(model, cast_params, (x,))
                return out.to(output_dtype) if output_dtype is not None else out

        return loss_fn(Cast(), batch)

    return loss


def shard_with(policy: MixedPrecisionPolicy, children: str, model: nn.Module, **kwargs: Any) -> None:
    """Children compute in param_dtype end to end; only the root casts its output. ``kwargs`` go to every call."""
    for child in getattr(model, children):
        fully_shard(child, mp_policy=dataclasses.replace(policy, output_dtype=None), **kwargs)
    fully_shard(model, mp_policy=policy, **kwargs)


def _mp(rank: int, world_size: int, reduce_dtype: torch.dtype | None, model_kind: str) -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype, output_dtype=torch.float32)
    if model_kind == "mlp":
        build, children, batch, loss_fn = MLP, "layers", regression_batch, mse_loss
    else:
        build, children, batch, loss_fn = Transformer, "blocks", token_batch, lm_loss
    trace, model = run_parity(
        rank, world_size, build, functools.partial(shard_with, policy, children), batch,
        reference_casts(loss_fn, BF16, torch.float32), steps=3, **TOL,
    )
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is None, name  # sharded parameters stay in the original dtype
    group = state_of(getattr(model, children)[0]).group
    assert group.unsharded_buffer.dtype == BF16 and group.flat_shard.dtype == torch.float32
    assert group.reduce_dtype == (reduce_dtype or BF16)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_fp32", "reduce_bf16"])
@pytest.mark.parametrize("model_kind", ["mlp", "transformer"])
def test_bf16_parity(reduce_dtype: torch.dtype | None, model_kind: str) -> None:
    run_ranks(2, _mp, reduce_dtype, model_kind)


def _dtypes_seen(rank: int, world_size: int) -> None:
    model = MLP()
    seen: dict[str, torch.dtype] = {}
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(inp=args[0].dtype, w=m.weight.dtype))
    policy = MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float16)
    shard_with(policy, "layers", model)
    out = model(torch.randn(2, 7))
    assert seen == {"inp": BF16, "w": BF16}
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    no_cast = MLP()
    fully_shard(no_cast, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False))
    with pytest.raises(RuntimeError, match="dtype"):
        no_cast(torch.randn(2, 7))


def test_casts_inputs_outputs_and_grads() -> None:
    run_ranks(2, _dtypes_seen)


@dataclasses.dataclass
class Hidden:
    """A block's input and output: a plain dataclass (no pytree node)."""

    h: torch.Tensor
    extras: dict[str, torch.Tensor]
    seen: torch.dtype | None = None


@dataclasses.dataclass
class HiddenWithNorm(Hidden):
    """With a field the constructor does not take (FSDP2's cast raises ``ValueError`` on it)."""

    norm: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.norm = self.h.detach().norm()


class DataclassBlock(nn.Module):
    def __init__(self, dim: int, kind: type[Hidden]) -> None:
        super().__init__()
        self.lin, self.kind = nn.Linear(dim, dim), kind

    def forward(self, x: Hidden) -> Hidden:
        h = torch.tanh(self.lin(x.h)) + x.extras["skip"]
        return self.kind(h, {"skip": h * 0.5}, seen=x.h.dtype)


class DataclassNet(nn.Module):
    def __init__(self, kind: type[Hidden], dim: int = 6) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(DataclassBlock(dim, kind) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.dtype | None]]:
        hidden, seen = self.kind(x, {"skip": x}), []
        for block in self.blocks:
            hidden = block(hidden)
            seen.append(hidden.seen)
            assert hidden.h.dtype == hidden.extras["skip"].dtype == torch.float32
            assert not isinstance(hidden, HiddenWithNorm) or hidden.norm.dtype == torch.float32
        return hidden.h, seen


def _train_dataclass_net(rank: int, shard: Any, policy: Any, kind: type[Hidden]) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = DataclassNet(kind)
    for block in model.blocks:
        shard(block, mp_policy=policy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    shard(model)
    gen = torch.Generator().manual_seed(rank)
    losses, seen = [], []
    for _ in range(2):
        out, seen = model(torch.randn(3, 6, generator=gen))
        loss = out.square().mean()
        loss.backward()
        losses.append(loss.detach())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad()
    return losses, seen, {n: p.full_tensor() for n, p in model.named_parameters()}


def _dataclass_casts(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    runs = [_train_dataclass_net(rank, fully_shard, MixedPrecisionPolicy, Hidden),
            _train_dataclass_net(rank, torch_fully_shard, TorchPolicy, Hidden),
            _train_dataclass_net(rank, fully_shard, MixedPrecisionPolicy, HiddenWithNorm)]
    for losses, seen, params in runs[1:]:
        assert seen == runs[0][1] == [BF16, BF16]  # each block's input cast to the compute dtype
        assert all(torch.equal(a, b) for a, b in zip(losses, runs[0][0]))
        for name, value in params.items():
            assert torch.equal(runs[0][2][name], value), name
    with pytest.raises(ValueError, match="init=False"):  # FSDP2 cannot rebuild it
        _train_dataclass_net(rank, torch_fully_shard, TorchPolicy, HiddenWithNorm)


def test_dataclass_inputs_and_outputs_are_cast_as_fsdp2_casts_them() -> None:
    """A plain dataclass in and out of a block under a mixed-precision policy: its floating-point fields cast to
    the compute dtype on the way in and to ``output_dtype`` on the way out, as FSDP2 does (fullshard passed it
    through uncast: a dtype error in the block, or bf16 where fp32 was asked for); also with an ``init=False``
    field, where FSDP2's cast raises."""
    run_ranks(2, _dataclass_casts)


def test_a_dataclass_is_rebuilt_only_when_a_cast_changes_it() -> None:
    from fullshard.runtime import cast_floats

    x = HiddenWithNorm(torch.randn(2, 3), {"skip": torch.arange(3)})
    same = cast_floats([x], torch.float32)
    assert same[0] is x  # nothing to cast: the caller's object, no __post_init__ run again
    cast = cast_floats({"hidden": x}, BF16)["hidden"]
    assert type(cast) is HiddenWithNorm and cast is not x
    assert cast.h.dtype == cast.norm.dtype == BF16 and cast.extras["skip"].dtype == torch.int64
    assert x.h.dtype == x.norm.dtype == torch.float32  # the input left alone


def _all_gather_in_place(rank: int, world_size: int) -> None:
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = dist.all_gather_single

    def spy(output: torch.Tensor, inp: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
        if inp.dtype == BF16:  # the groups' all-gathers (the divergence checks gather int64 rows)
            calls.append((output, inp))
        return original(output, inp, **kwargs)

    model = MLP()
    shard_with(MixedPrecisionPolicy(param_dtype=BF16), "layers", model)
    dist.all_gather_single = spy  # type: ignore[assignment]
    try:
        model(torch.randn(2, 7)).float().sum().backward()
    finally:
        dist.all_gather_single = original  # type: ignore[assignment]
    assert len(calls) == 2 * len(model.layers)  # every layer in forward and again in backward (the root has none left)
    for output, inp in calls:
        # The cast shard is written into this rank's slot of the output, which is sent as the input.
        assert inp.dtype == output.dtype == BF16 and output.numel() == world_size * inp.numel()
        assert inp.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
        assert inp.data_ptr() == output.data_ptr() + rank * inp.numel() * inp.element_size()


def test_mixed_precision_all_gather_is_in_place() -> None:
    run_ranks(2, _all_gather_in_place)


class _Dict(dict):  # type: ignore[type-arg]
    pass


class _List(list):  # type: ignore[type-arg]
    pass


class _Tuple(tuple):  # type: ignore[type-arg]
    __slots__ = ()


class _Ordered(collections.OrderedDict):  # type: ignore[type-arg]
    pass


@dataclasses.dataclass
class _Output(collections.OrderedDict):  # type: ignore[type-arg]
    """Like Hugging Face's ModelOutput where it is no pytree node: a dataclass first (rebuilt by replace)."""

    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self["logits"] = self.logits

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("not through update")


def _containers(t: torch.Tensor) -> list[Any]:
    return [_Dict(a=t, n=3), _List([t, None]), _Tuple((t, 1.5)), {t}, _Ordered(a=t), [_List([t])], _Output(t)]


def test_containers_are_cast_as_fsdp2_casts_them() -> None:
    """Sets and subclasses of lists, tuples and dicts (which pytree does not know) are cast like FSDP2's casts and
    rebuilt as they rebuild them (a dict subclass as a plain dict); fullshard passed them through uncast, so a block
    got fp32 inputs for bf16 weights where FSDP2 trains. Containers without a floating-point tensor stay as they are."""
    from torch.distributed.utils import _apply_to_tensors

    from fullshard.runtime import cast_floats, tensors_in

    def types(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return tree.dtype
        if isinstance(tree, dict):
            return type(tree), {k: types(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple | set | frozenset):
            return type(tree), sorted((types(v) for v in tree), key=repr)
        return tree

    t = torch.randn(2)
    for x in _containers(t):
        ours = cast_floats(x, BF16)
        fsdp2 = _apply_to_tensors(lambda u: u.to(BF16), x)
        assert types(ours) == types(fsdp2), (x, types(ours), types(fsdp2))
        assert [u.dtype for u in tensors_in(ours)] == [BF16]
        if type(x) is not list:  # (pytree rebuilds its own containers)
            assert cast_floats(x, torch.float32) is x  # nothing cast: the caller's object
    ints = _List([torch.arange(3)])
    assert cast_floats(ints, BF16) is ints


class _ListBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, xs: _List) -> _List:
        return _List([self.lin(xs[0]), xs[1]])


class _ListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _ListBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(_List([x, x.detach()]))
        return self.head(out[0].float() + out[1])


def _list_subclass_training(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    results = []
    for shard, policy in ((fully_shard, MixedPrecisionPolicy), (torch_fully_shard, TorchPolicy)):
        torch.manual_seed(0)
        model = _ListNet()
        shard(model.block, mp_policy=policy(param_dtype=BF16))
        shard(model)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        loss = model(x).square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    (loss, grads), (torch_loss, torch_grads) = results
    assert torch.equal(loss, torch_loss)
    assert grads.keys() == torch_grads.keys() and all(torch.equal(grads[n], torch_grads[n]) for n in grads)


def test_a_list_subclass_input_trains_as_on_fsdp2() -> None:
    run_ranks(2, _list_subclass_training)
