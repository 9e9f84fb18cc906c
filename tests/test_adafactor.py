"""torch's Adafactor on fullshard's parameters ([Note: Sharded Adafactor] in adafactor.py): the unsharded model's
numbers and state, where FSDP2's parameters raise."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate

import fullshard
import fullshard.optim
from fullshard import fully_shard
from tests import test_tensor_parallel as tp
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss, mse_loss
from tests.parity import assert_parity, full, random_batches, token_batch, train
from tests.test_local_step import _layout  # dim 0 (the default), shard_dim_1, offload, bf16, hsdp

OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "decay_maximize_tensor_lr": {"lr": torch.tensor(5e-3), "weight_decay": 0.1, "maximize": True, "d": 2.0,
                                 "eps": (1e-4, 1e-3), "beta2_decay": -0.5},
}


def _sharded(layout: str, world_size: int, shard: Any = fully_shard) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer()
    for block in model.blocks:
        shard(block, **_layout(layout, world_size))
    shard(model, **_layout(layout, world_size))
    return model


def _state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{name}/{key}": full(value) for name, p in model.named_parameters() for key, value in opt.state[p].items()}


def _parity(rank: int, world_size: int, layout: str, options: str) -> None:
    batches = random_batches(4, world_size, token_batch)
    make = functools.partial(torch.optim.Adafactor, **OPTIONS[options])
    torch.manual_seed(0)
    ref_model = Transformer()
    ref = train(ref_model, batches, lm_loss, rank=None, make_optim=make)
    model = _sharded(layout, world_size)
    trace = train(model, batches, lm_loss, rank=rank, make_optim=make)
    tol = {"rtol": 2e-2, "atol": 2e-3} if layout == "bf16" else {"rtol": 1e-5, "atol": 1e-6}
    assert_parity(ref, trace, rank, **tol, check_dtype=layout != "bf16")  # bf16: the loss is bf16
    # The state is the unsharded optimizer's, placed like the parameters, the factors whole along their reduced dim.
    assert ref.optim is not None and trace.optim is not None
    ours, theirs = _state_by_name(model, trace.optim), _state_by_name(ref_model, ref.optim)
    assert ours.keys() == theirs.keys(), ours.keys() ^ theirs.keys()
    for key, value in ours.items():
        assert value.shape == theirs[key].shape and value.dtype == theirs[key].dtype, key
        torch.testing.assert_close(value, theirs[key], msg=lambda m: f"state {key}: {m}", **tol)
    for p in model.parameters():
        state = trace.optim.state[p]
        if p.dim() != 2:
            assert state["variance"]._spec == p._spec
            continue
        assert state["row_var"].placements == tuple(Replicate() if pl.is_shard(1) else pl for pl in p.placements)
        assert state["col_var"].placements == tuple(Replicate() if pl.is_shard(0) else pl for pl in p.placements)
        assert state["row_var"]._local_tensor.shape == (*p._local_tensor.shape[:1], 1)
        assert state["col_var"]._local_tensor.shape == (1, *p._local_tensor.shape[1:])


@pytest.mark.parametrize("layout,world_size,options", [
    ("dim0", 2, "default"), ("dim0", 4, "decay_maximize_tensor_lr"), ("shard_dim_1", 2, "default"),
    ("hsdp", 4, "default"), ("offload", 2, "decay_maximize_tensor_lr"), ("bf16", 2, "default"),
])
def test_adafactor_parity_with_unsharded_model(layout: str, world_size: int, options: str) -> None:
    run_ranks(world_size, _parity, layout, options)


class Experts(nn.Module):
    """A 3-D parameter (experts, in, out: dim 0 split, its factors per expert), a 0-dim one, a vector and a
    matrix (a full state dict places its column factor by rows, which the step re-places)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(3, 5, 4) * 0.3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.bias = nn.Parameter(torch.randn(4) * 0.1)
        self.out = nn.Parameter(torch.randn(3, 4) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.einsum("bi,eio->bo", x, self.experts) * self.scale + self.bias) @ self.out.T


def _experts_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _regression(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)


def _shapes_and_resume(rank: int, world_size: int) -> None:
    batches = random_batches(5, world_size, _regression)
    make = functools.partial(torch.optim.Adafactor, lr=0.02)
    torch.manual_seed(0)
    ref_model = Experts()
    ref = train(ref_model, batches, _experts_loss, rank=None, make_optim=make)
    torch.manual_seed(0)
    model = fully_shard(Experts())
    assert_parity(ref, train(model, batches, _experts_loss, rank=rank, make_optim=make), rank, rtol=1e-5, atol=1e-6)

    # Resumed from a sharded state dict, and from the unsharded optimizer's full one: the same next steps.
    torch.manual_seed(0)
    head_model = Experts()
    head = train(head_model, batches[:3], _experts_loss, rank=None, make_optim=make)
    assert head.optim is not None
    full_osd = copy.deepcopy(get_optimizer_state_dict(head_model, head.optim))  # the state trains on in place
    tail_ref = train(head_model, batches[3:], _experts_loss, rank=None, optim=head.optim)
    for source in ("sharded", "full", "consolidated"):
        torch.manual_seed(0)
        first = fully_shard(Experts())
        first_trace = train(first, batches[:3], _experts_loss, rank=rank, make_optim=make)
        assert first_trace.optim is not None
        torch.manual_seed(1)  # other initial values: everything must come from the loaded state
        resumed = fully_shard(Experts())
        opt = make(resumed.parameters())
        resumed.load_state_dict(first.state_dict())
        if source == "sharded":
            set_optimizer_state_dict(resumed, opt, copy.deepcopy(get_optimizer_state_dict(first, first_trace.optim)))
        elif source == "consolidated":  # FSDP1's full optimizer state dict: factors as plain full tensors
            fullshard.load_full_optim_state_dict(resumed, opt, fullshard.full_optim_state_dict(
                first, first_trace.optim, rank0_only=False))
        else:
            set_optimizer_state_dict(resumed, opt, full_osd,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        tail = train(resumed, batches[3:], _experts_loss, rank=rank, optim=opt)
        assert_parity(tail_ref, tail, rank, rtol=1e-5, atol=1e-6)


def test_adafactor_three_dim_and_scalar_parameters_and_resume() -> None:
    run_ranks(2, _shapes_and_resume)


def _tensor_parallel(rank: int, world_size: int) -> None:
    # FSDP over "dp" on top of tensor parallel: column-parallel weights split by rows on both axes (the dp one a
    # _StridedShard, which is no Shard), row-parallel ones by rows on dp and by columns on tp.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = tp.Net()
    model = tp.parallelize(tp.Net(), mesh["dp"], mesh["tp"])
    model.load_state_dict(ref.state_dict())
    batches = random_batches(4, 2, tp.batch)
    make = functools.partial(torch.optim.Adafactor, lr=0.01, weight_decay=0.05)
    ref_trace = train(ref, batches, mse_loss, rank=None, make_optim=make)
    trace = train(model, batches, mse_loss, rank=dp_rank, make_optim=make)
    assert_parity(ref_trace, trace, dp_rank, rtol=1e-5, atol=1e-6)
    assert ref_trace.optim is not None and trace.optim is not None
    ours, theirs = _state_by_name(model, trace.optim), _state_by_name(ref, ref_trace.optim)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], msg=lambda m: f"state {key}: {m}", rtol=1e-5, atol=1e-6)


def test_adafactor_with_tensor_parallel() -> None:
    run_ranks(4, _tensor_parallel)


def _closure_and_errors(rank: int, world_size: int) -> None:
    batches = random_batches(2, world_size, token_batch)
    plain, with_closure = _sharded("dim0", world_size), _sharded("dim0", world_size)
    train(plain, batches, lm_loss, rank=rank, make_optim=torch.optim.Adafactor)
    opt = torch.optim.Adafactor(with_closure.parameters())
    for step_batches in batches:
        def closure(batch: Any = step_batches[rank]) -> torch.Tensor:
            opt.zero_grad()
            loss = lm_loss(with_closure, batch)
            loss.backward()
            return loss
        assert isinstance(opt.step(closure), torch.Tensor)
    for a, b in zip(plain.parameters(), with_closure.parameters(), strict=True):
        assert torch.equal(a._local_tensor, b._local_tensor)
    # Switching local steps of elementwise optimizers off does not send Adafactor back to DTensor's path.
    fullshard.optim.local_steps(False)
    try:
        lm_loss(plain, batches[0][rank]).backward()
        torch.optim.Adafactor(plain.parameters()).step()
    finally:
        fullshard.optim.local_steps(True)

    # torch's own refusals, unchanged.
    model = fully_shard(nn.Linear(4, 3).to(torch.complex64))
    opt = torch.optim.Adafactor(model.parameters())
    model(torch.randn(2, 4, dtype=torch.complex64)).abs().sum().backward()
    with pytest.raises(RuntimeError, match="Adafactor does not support complex parameters"):
        opt.step()

    # FSDP2's parameters: torch's step runs through DTensor and fails on the column means.
    theirs = _sharded("dim0", world_size, shard=torch_fully_shard)
    opt = torch.optim.Adafactor(theirs.parameters())
    lm_loss(theirs, batches[0][rank]).backward()
    with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
        opt.step()
    assert all(type(p) is DTensor for p in theirs.parameters())


def test_adafactor_closure_and_what_raises() -> None:
    run_ranks(2, _closure_and_errors)
