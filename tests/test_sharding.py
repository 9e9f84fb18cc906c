"""What fully_shard does to a module: placements, flat-buffer views, collectives issued and their order."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fullshard import FSDPModule, UnshardHandle, fully_shard
from fullshard.group import ShardedState
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import full_params, random_batches, regression_batch, run_parity, token_batch
from tests.test_parity import shard_transformer


def _placements(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    original = full_params(Transformer())
    torch.manual_seed(0)
    model = Transformer()
    returned = fully_shard(model.blocks[0])
    assert returned is model.blocks[0]
    shard_transformer_rest(model)
    assert type(model).__name__ == "FSDPTransformer"
    assert isinstance(model, FSDPModule) and isinstance(model, Transformer)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        assert p.placements == (Shard(0),), name
        assert p.shape == original[name].shape, name
        chunks = original[name].chunk(world_size)
        expected = chunks[rank] if rank < len(chunks) else original[name][:0]
        torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0)
    # Every parameter of a group is its rows of that group's one flat shard buffer, in a storage of its own.
    for module in (model, *model.blocks):
        state = state_of(module)
        assert state is not None and state.group is not None
        group = state.group
        for p, chunk in zip(group.params, group.chunks(group.flat_shard)):
            local = p.sharded.to_local()
            assert local.numel() == 0 or local.data_ptr() == p.local_rows(chunk).data_ptr(), p.fqn
            assert local.storage_offset() == 0, p.fqn


def shard_transformer_rest(model: nn.Module) -> None:
    for block in model.blocks[1:]:
        fully_shard(block)
    fully_shard(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_placements_and_flat_buffer_views(world_size: int) -> None:
    run_ranks(world_size, _placements)


def test_sharded_grads_are_views_into_flat_gradient_buffer() -> None:
    run_ranks(2, _grad_views)


def _grad_views(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    for module in model.blocks:
        group = state_of(module).group
        storages = {p.sharded.grad.to_local().untyped_storage().data_ptr() for p in group.params}
        assert len(storages) == 1, f"{group.label}: gradients live in {len(storages)} buffers"
        for p in group.params:
            assert p.sharded.grad.placements == (Shard(0),)
            assert p.sharded.grad.to_local().shape == p.sharded.to_local().shape


# ---- shard_placement_fn --------------------------------------------------------------------------


def shard_dim1(model: nn.Module) -> None:
    place = lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else None  # noqa: E731
    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=place)
    fully_shard(model, shard_placement_fn=place)


def _dim1(rank: int, world_size: int) -> None:
    build = functools.partial(MLP, (8, 6, 4, 3))
    batch = functools.partial(regression_batch, in_dim=8)
    _, model = run_parity(rank, world_size, build, shard_dim1, batch, mse_loss)
    assert model.layers[1].weight.placements == (Shard(1),)
    assert model.layers[1].weight.to_local().shape == (4, 6 // world_size)
    assert model.layers[0].bias.placements == (Shard(0),)


def test_shard_placement_fn_dim1() -> None:
    run_ranks(2, _dim1)


# ---- collectives per step and prefetch order ------------------------------------------------------


def _comm_order(rank: int, world_size: int, blocks_reshard: bool) -> None:
    torch.manual_seed(0)
    model = Transformer()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=blocks_reshard)
    fully_shard(model)
    rec = CommRecorder(model)
    grad_numel = {  # reduce-scatter input numel of each group: padded parameters and a flag column per parameter
        (name or "root"): str(state_of(m).group.layout.unsharded_numel + world_size * len(state_of(m).group.params))
        for name, m in model.named_modules() if state_of(m) is not None
    }
    batches = random_batches(3, world_size, token_batch)
    for step, step_batches in enumerate(batches):
        lm_loss(model, step_batches[rank]).backward()
        events = rec.take()
        ag = [e for e in events if e[0] == "ag"]
        rs = [e for e in events if e[0] == "rs"]
        n_groups, n_blocks = 3, 2
        assert len(ag) == n_groups + (n_blocks if blocks_reshard else 0), (step, events)
        assert rs == [("rs", grad_numel["blocks.1"]), ("rs", grad_numel["blocks.0"]), ("rs", grad_numel["root"])]
        if step == 0:
            continue
        # From the second step on, each block's all-gather is issued before the previous module computes.
        expected_forward = [
            ("ag", "root"), ("ag", "blocks.0"), ("fwd", "root"), ("ag", "blocks.1"), ("fwd", "blocks.0"), ("fwd", "blocks.1"),
        ]
        assert events[: len(expected_forward)] == expected_forward, events
        backward = events[len(expected_forward):]
        if blocks_reshard:
            assert backward[:2] == [("ag", "blocks.1"), ("ag", "blocks.0")], backward
        assert all(state_of(m).group.state is ShardedState.SHARDED for m in (model, *model.blocks))


@pytest.mark.parametrize("blocks_reshard", [True, False], ids=["reshard", "keep"])
def test_collectives_and_prefetch_order(blocks_reshard: bool) -> None:
    run_ranks(2, _comm_order, blocks_reshard)


def _unsharded_count_bounded(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer(n_blocks=5)
    shard_transformer(model)
    peak = 0

    def count(*_: Any) -> None:
        nonlocal peak
        live = sum(state_of(b).group.state is not ShardedState.SHARDED for b in model.blocks)
        peak = max(peak, live)

    for block in model.blocks:
        block.register_forward_pre_hook(count)
        block.register_full_backward_pre_hook(count)
    for tokens in random_batches(3, world_size, token_batch):
        lm_loss(model, tokens[rank]).backward()
    assert peak == 2, f"{peak} blocks unsharded at once"


def test_at_most_two_blocks_unsharded() -> None:
    run_ranks(2, _unsharded_count_bounded)


def _explicit_prefetch(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer(n_blocks=3)
    shard_transformer(model)
    # any iterable of sharded modules, as FSDP2 takes: a ModuleList slice, a generator
    model.set_modules_to_forward_prefetch(model.blocks[:2])
    model.blocks[2].set_modules_to_backward_prefetch(model.blocks[i] for i in (1, 0))
    rec = CommRecorder(model)
    lm_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    events = rec.take()
    assert events[:4] == [("ag", "root"), ("ag", "blocks.0"), ("ag", "blocks.1"), ("fwd", "root")], events
    backward = [e for e in events[events.index(("fwd", "blocks.2")) + 1 :] if e[0] == "ag"]
    assert backward == [("ag", "blocks.2"), ("ag", "blocks.1"), ("ag", "blocks.0")], events


def test_explicit_prefetch() -> None:
    run_ranks(2, _explicit_prefetch)


# ---- several modules in one group ----------------------------------------------------------------


def shard_pairs(model: nn.Module) -> None:
    fully_shard([model.layers[0], model.layers[1]])
    fully_shard(model)


def _module_list_group(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, MLP, shard_pairs, regression_batch, mse_loss)
    assert state_of(model.layers[0]) is state_of(model.layers[1])
    assert [p.fqn for p in state_of(model.layers[0]).group.params] == [
        "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


def test_list_of_modules_is_one_group() -> None:
    run_ranks(2, _module_list_group)


# ---- manual unshard / reshard ---------------------------------------------------------------------


def _manual(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = MLP()
    expected = full_params(model)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    layer = model.layers[1]
    assert layer.unshard() is None
    for name, p in layer.named_parameters():
        assert type(p) is nn.Parameter
        torch.testing.assert_close(p.detach(), expected[f"layers.1.{name}"], rtol=0, atol=0)
    layer.reshard()
    assert all(isinstance(p, DTensor) for p in layer.parameters())
    handle = layer.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle) and isinstance(handle, torch.distributed.fsdp.UnshardHandle)
    handle.wait()
    assert all(type(p) is nn.Parameter for p in layer.parameters())
    x = torch.randn(2, 7)
    y = model(x)  # forward after a manual unshard uses the unsharded parameters
    y.sum().backward()
    assert all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
    handle.wait()  # again, once the group was used and resharded: nothing to do (as on FSDP2)
    # A handle waited on only after the forward and backward that used the group (a prefetch whose wait comes late)
    late = layer.unshard(async_op=True)
    model(x).sum().backward()
    late.wait()
    late.wait()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_manual_unshard_reshard() -> None:
    run_ranks(2, _manual)


# ---- reshard_after_forward as an int ---------------------------------------------------------------


def shard_to_pairs(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)


def _reshard_to_smaller_group(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, Transformer, shard_to_pairs, token_batch, lm_loss)
    tokens = random_batches(1, world_size, token_batch)[0][rank]
    rec = CommRecorder(model)
    loss = lm_loss(model, tokens)
    for block in model.blocks:
        assert state_of(block).group.state is ShardedState.SHARDED_POST_FORWARD
        assert all(isinstance(p, DTensor) for p in block.parameters())
    forward_sizes = list(rec.all_gather_sizes)
    loss.backward()
    rec.close()
    assert forward_sizes == [4, 4, 4], forward_sizes  # root, blocks.0, blocks.1 over all ranks
    assert rec.all_gather_sizes[3:] == [2, 2], rec.all_gather_sizes  # backward: within pairs
    assert all(state_of(m).group.state is ShardedState.SHARDED for m in (model, *model.blocks))


def test_reshard_after_forward_int() -> None:
    run_ranks(4, _reshard_to_smaller_group)


def _bad_int(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="should be a factor of 4, not 3"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=3)
    with pytest.raises(ValueError, match="should be a factor of 4, not 0"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=0)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("torch.distributed.fsdp.fully_shard").addHandler(handler)
    try:
        for _ in range(2):
            one = fully_shard(nn.Linear(4, 4), reshard_after_forward=1)
            assert state_of(one).reshard_after_forward is False
    finally:
        logging.getLogger("torch.distributed.fsdp.fully_shard").removeHandler(handler)
    # once, a warning on FSDP2's logger, as FSDP2 logs it
    assert [(r.levelno, "reshard_after_forward=1 (int)" in r.getMessage()) for r in records] == [(logging.WARNING, True)]


def test_reshard_after_forward_int_validation() -> None:
    run_ranks(4, _bad_int)
