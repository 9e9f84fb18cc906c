"""torch's elementwise optimizers on fullshard's parameters step the local shards: the same bits as through DTensor."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

import fullshard
from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import assert_parity, random_batches, token_batch, train

# (class, keyword arguments); every class torch's step hands to the local path, with the options
# that change which state it keeps or which kernels it runs.
CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "adam_amsgrad_maximize": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "maximize": True, "weight_decay": 0.01}),
    "adam_tensor_lr": (torch.optim.Adam, {"lr": torch.tensor(1e-2)}),
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd_foreach_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "foreach": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "rmsprop_centered": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
}


_METADATA = frozenset({"__get__", "__set__", "dim", "size", "stride", "numel", "is_contiguous", "is_floating_point",
                       "is_complex"})


class DTensorOps(TorchFunctionMode):
    """Counts tensor operations that get a DTensor argument (what runs through DTensor's dispatch), not metadata reads."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        dtensors = any(type(a) is DTensor or (isinstance(a, list) and any(type(t) is DTensor for t in a)) for a in args)
        if dtensors and getattr(func, "__name__", "") not in _METADATA:
            self.count += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def dtensor_path() -> Iterator[None]:
    """torch's optimizers step through DTensor inside (local steps off)."""
    fullshard.optim.local_steps(False)
    try:
        yield
    finally:
        fullshard.optim.local_steps(True)


def _model(torch_fsdp: bool = False, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer()
    shard = torch_fully_shard if torch_fsdp else fully_shard
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups: matrices, and vectors without weight decay at another learning rate."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": matrices}, {"params": vectors, "weight_decay": 0.0, "lr": 3e-3}]


def _state_items(opt: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    names = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return sorted((f"{names[p]}/{key}", value) for p, s in opt.state.items() for key, value in s.items())


def _assert_same_bits(a: nn.Module, opt_a: torch.optim.Optimizer, b: nn.Module, opt_b: torch.optim.Optimizer, what: str) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert type(pa) is DTensor and pa._spec == pb._spec, f"{what}: {name}"
        assert torch.equal(pa._local_tensor, pb._local_tensor), f"{what}: parameter {name} differs"
    items_a, items_b = _state_items(opt_a), _state_items(opt_b)
    assert [k for k, _ in items_a] == [k for k, _ in items_b], what
    for (key, va), (_, vb) in zip(items_a, items_b):
        assert type(va) is type(vb), f"{what}: state {key} is {type(va).__name__}, not {type(vb).__name__}"
        if isinstance(va, DTensor):
            assert va._spec == vb._spec, f"{what}: state {key} is sharded as {va._spec}, not {vb._spec}"
            va, vb = va._local_tensor, vb._local_tensor
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.device == vb.device, f"{what}: state {key}"
            assert torch.equal(va, vb), f"{what}: state {key} differs"
        else:
            assert va == vb, f"{what}: state {key}: {va} != {vb}"


def _steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[list[Any]], rank: int,
           loss_fn: Any = lm_loss) -> int:
    """Train over ``batches``; return how many operations inside ``step()`` got a DTensor."""
    counted = 0
    for step_batches in batches:
        loss_fn(model, step_batches[rank]).backward()
        with DTensorOps() as ops:
            opt.step()
        counted += ops.count
        opt.zero_grad()
    return counted


def _same_bits_as_dtensor_path(rank: int, world_size: int, configs: list[str], layout: str = "") -> None:
    batches = random_batches(3, world_size, token_batch)
    shard_kwargs = _layout(layout, world_size)
    for config in configs:
        cls, kwargs = CONFIGS[config]
        local, through = _model(**shard_kwargs), _model(**shard_kwargs)
        opt_local = cls(_groups(local), **kwargs)
        opt_through = cls(_groups(through), **kwargs)
        assert _steps(local, opt_local, batches, rank) == 0, f"{config}: the step went through DTensor"
        with dtensor_path():
            assert _steps(through, opt_through, batches, rank) > 0
        _assert_same_bits(local, opt_local, through, opt_through, config)
        # The optimizer's own view is untouched: DTensor parameters, no gradient left on a local tensor.
        for p in (p for g in opt_local.param_groups for p in g["params"]):
            assert type(p) is DTensor and p._local_tensor.grad is None
        # State saved by one path continues in the other, bit for bit.
        set_optimizer_state_dict(local, opt_local, copy.deepcopy(get_optimizer_state_dict(through, opt_through)))
        more = random_batches(2, world_size, token_batch, seed=7)
        assert _steps(local, opt_local, more, rank) == 0, f"{config}: after a state-dict load"
        with dtensor_path():
            _steps(through, opt_through, more, rank)
        _assert_same_bits(local, opt_local, through, opt_through, f"{config} after a load")


@pytest.mark.parametrize("configs", [list(CONFIGS)[:8], list(CONFIGS)[8:]], ids=["adam_sgd", "others"])
def test_local_step_gives_the_dtensor_path_bits(configs: list[str]) -> None:
    run_ranks(2, _same_bits_as_dtensor_path, configs)


def _layout(layout: str, world_size: int) -> dict[str, Any]:
    """``fully_shard`` arguments of a layout: placements, offload, mixed precision, HSDP."""
    if layout == "shard_dim_1":
        return {"shard_placement_fn": lambda p: Shard(1) if p.dim() == 2 else None}
    if layout == "offload":
        return {"offload_policy": CPUOffloadPolicy()}
    if layout == "bf16":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if layout == "hsdp":
        return {"mesh": init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))}
    return {}  # uneven: the default at 4 ranks, where the vocabulary's 37 rows split 10/10/10/7


@pytest.mark.parametrize("layout,world_size", [("shard_dim_1", 2), ("offload", 2), ("bf16", 2), ("hsdp", 4),
                                               ("uneven", 4)])
def test_local_step_bits_across_layouts(layout: str, world_size: int) -> None:
    run_ranks(world_size, _same_bits_as_dtensor_path, ["adamw", "sgd_nesterov"], layout)


# Rprop masks its gradient in place (``grad[sign == etaminus] = 0``), which DTensor cannot do on a sharded
# gradient: on FSDP2's parameters its step raises, as do the fused SGD and Adagrad. The local step runs them.
PARITY: dict[str, tuple[type, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}),  # eps: see tests/fuzz.py
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    # fused SGD and Adagrad: DTensor has no sharding rule for their kernels (FSDP2's parameters raise)
    "sgd_fused": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}),
    "adagrad_fused": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-3, "fused": True}),  # eps: see tests/fuzz.py
}


def _parity(rank: int | None, world_size: int, config: str) -> Any:
    batches = random_batches(4, world_size, token_batch)
    cls, kwargs = PARITY[config]
    make = functools.partial(cls, **kwargs)
    torch.manual_seed(0)
    if rank is None:
        return train(Transformer(), batches, lm_loss, rank=None, make_optim=make)
    return train(_model(), batches, lm_loss, rank=rank, make_optim=make)


def _parity_rank(rank: int, world_size: int, config: str) -> None:
    assert_parity(_parity(None, world_size, config), _parity(rank, world_size, config), rank, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", list(PARITY))
def test_local_step_parity_with_unsharded_model(config: str) -> None:
    run_ranks(2, _parity_rank, config)


class _AdamWSubclass(torch.optim.AdamW):
    pass


def _paths(rank: int, world_size: int) -> None:
    batches = random_batches(2, world_size, token_batch)
    # What keeps DTensor's path: a subclass, a closure, FSDP2's parameters, the switch.
    model = _model()
    assert _steps(model, _AdamWSubclass(model.parameters(), lr=1e-2), batches, rank) > 0
    model = _model(torch_fsdp=True)
    assert _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches, rank) > 0
    model, reference = _model(), _model()
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step_batches in batches:
        def closure(m: nn.Module = model) -> torch.Tensor:
            m.zero_grad()
            loss = lm_loss(m, step_batches[rank])
            loss.backward()
            return loss

        with DTensorOps() as ops:
            opt.step(closure)
        assert ops.count > 0, "a closure recomputes gradients during the step: DTensor's path"
    _steps(reference, opt_ref, batches, rank)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)

    # A pre-hook of the optimizer's own that changes the learning rate is seen by the local step.
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda o, args, kwargs: o.param_groups[0].__setitem__("lr", 0.01))
    _steps(model, opt, batches[:1], rank)
    _steps(reference, torch.optim.SGD(reference.parameters(), lr=0.01), batches[:1], rank)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)

    # Gradients replaced by a pre-hook of the optimizer's own (after fullshard's) are the ones stepped.
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def freeze_matrices(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in o.param_groups[0]["params"]:
            if p.dim() > 1:
                p.grad = None

    opt.register_step_pre_hook(freeze_matrices)
    assert _steps(model, opt, batches[:1], rank) == 0
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt_ref.register_step_pre_hook(freeze_matrices)
    with dtensor_path():
        _steps(reference, opt_ref, batches[:1], rank)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor)

    # What the step sets on the optimizer stays on it (fused SGD checks devices on its first step only).
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    assert _steps(model, opt, batches[:1], rank) == 0
    assert opt._need_device_dtype_check_for_fused is False

    # An optimizer over plain tensors only is not touched, even with fullshard in use.
    plain = nn.Linear(3, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    seen: list[bool] = []
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(args[0] is o))
    plain(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert seen == [True]

    # Initialised on the meta device and materialised with to_empty() (torch swaps the parameters' contents).
    with torch.device("meta"):
        model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.load_state_dict(_model().state_dict())
    assert _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches, rank) == 0

    # A step that fails half-way leaves the optimizer as it was: DTensor parameters and state.
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _steps(model, opt, batches[:1], rank)
    opt.param_groups[0]["betas"] = (0.9,)
    lm_loss(model, batches[1][rank]).backward()
    with pytest.raises(ValueError):
        opt.step()
    assert all(type(p) is DTensor for p in opt.param_groups[0]["params"])
    assert all(type(v) is DTensor for s in opt.state.values() for v in s.values() if v.dim())
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    with DTensorOps() as ops:
        opt.step()
    assert ops.count == 0


def test_what_keeps_the_dtensor_path() -> None:
    run_ranks(2, _paths)


def _freed_at_zero_grad(rank: int, world_size: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = random_batches(1, world_size, token_batch)[0][rank]
    lm_loss(model, batch).backward()
    opt.step()
    opt.zero_grad()
    gc.collect()
    gc.disable()  # what only the garbage collector would free stays alive
    try:
        lm_loss(model, batch).backward()
        grads = [weakref.ref(p.grad._local_tensor) for p in model.parameters()]
        stepped: list[Any] = []  # (the stand-in, not the optimizer, ran the step; a weak reference to it)
        hook = opt.register_step_post_hook(lambda o, args, kwargs: stepped.append((args[0] is not o, weakref.ref(args[0]))))
        opt.step()
        hook.remove()
        opt.zero_grad()
        local, stand_in = stepped[0]
        assert local, "the step did not run locally"
        assert stand_in() is None, "the stand-in outlived its step"
        assert all(g() is None for g in grads), "gradients stepped locally outlived zero_grad()"
    finally:
        gc.enable()


def test_local_step_frees_what_it_served_without_the_garbage_collector() -> None:
    """Nothing of a local step waits for the garbage collector: the gradients go with ``zero_grad()`` (when
    a reference cycle kept them, a process's memory grew by a gradient set per step until a collection)."""
    run_ranks(2, _freed_at_zero_grad)


def test_local_steps_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="local_steps"):
        fullshard.optim.local_steps("yes")  # type: ignore[arg-type]
