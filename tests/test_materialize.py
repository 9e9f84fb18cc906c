"""Every way a sharded model is materialised or moved: meta init and ``to_empty()`` / ``init_weights()`` /
``reset_parameters()``, ``load_state_dict(assign=True)`` into a meta model, ``set_model_state_dict`` with a
broadcast from rank 0, list groups whose members convert one after another, conversions after training.

Each path trains against the unsharded model (parity), and where torch's FSDP2 takes the same path the
two are compared bit for bit (the frameworks that start this way: torchtitan, torchtune, Accelerate).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.gpt import Block, GPTConfig, lm_loss
from tests.harness import run_ranks
from tests.parity import assert_parity, full_params, random_batches, token_batch, train

CFG = GPTConfig(vocab_size=37, dim=12, n_heads=3, hidden=30, n_layers=2, seq_len=9)


class Llama(nn.Module):
    """torchtitan's shape: embedding, blocks, a final norm and an output head (tied to the embedding or not)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(CFG.vocab_size, CFG.dim)
        self.layers = nn.ModuleList(Block(CFG) for _ in range(CFG.n_layers))
        self.norm = nn.LayerNorm(CFG.dim)
        self.head = nn.Linear(CFG.dim, CFG.vocab_size, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random init, as torchtitan's: on sharded DTensors it draws through DTensor's random ops."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A deterministic init whose full values do not depend on the sharding (for parity)."""
        for i, (_, p) in enumerate(self.named_parameters()):
            full = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + i).view(p.shape) * 0.3
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)


def shard_llama(model: Llama, shard: Callable[..., Any] = fully_shard, tail: str = "norm,head") -> Llama:
    """Blocks one group each, ``[norm, head]`` as one list group (in the order ``tail`` names), the root."""
    for layer in model.layers:
        shard(layer)
    shard([getattr(model, name) for name in tail.split(",")])
    shard(model)
    return model


def _parity(rank: int, world_size: int, ref: nn.Module, model: nn.Module, steps: int = 3) -> None:
    batches = random_batches(steps, world_size, token_batch)
    assert_parity(train(ref, batches, lm_loss, rank=None), train(model, batches, lm_loss, rank=rank), rank)


def _reference(tied: bool = False) -> Llama:
    ref = Llama(tied)
    ref.reset_parameters()
    return ref


def _meta_then_to_empty(rank: int, world_size: int) -> None:
    for tail in ("norm,head", "head,norm"):  # both member orders of the list group
        with torch.device("meta"):
            model = shard_llama(Llama(), tail=tail)
        params_before = list(model.parameters())
        model.to_empty(device="cpu")
        model.reset_parameters()
        assert list(model.parameters()) == params_before  # optimizers built before to_empty stay valid
        _parity(rank, world_size, _reference(), model)

    # The list group's members materialised one at a time, under a root that is not sharded.
    with torch.device("meta"):
        model = Llama()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.norm, model.head])
    fully_shard(model.tok)
    for module in (model.head, model.tok, *model.layers, model.norm):
        module.to_empty(device="cpu")
    model.reset_parameters()
    _parity(rank, world_size, _reference(), model)

    # A member left on meta is named at the first forward.
    with torch.device("meta"):
        model = shard_llama(Llama())
    for module in (model.tok, *model.layers, model.norm):
        module.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=r"still on meta device: \['head.weight'\]"):
        model(torch.zeros(2, CFG.seq_len, dtype=torch.long))


def _same_as_fsdp2(rank: int, world_size: int) -> None:
    """torchtitan's start-up (meta init, list group, to_empty, random init_weights) and three steps of AdamW:
    bit for bit torch's FSDP2."""
    traces = []
    for shard in (torch_fully_shard, fully_shard):
        with torch.device("meta"):
            model = shard_llama(Llama(), shard)
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        model.init_weights()
        batches = random_batches(3, world_size, token_batch)
        traces.append(train(model, batches, lm_loss, rank=rank, make_optim=lambda p: torch.optim.AdamW(p, lr=1e-2)))
    torch_trace, trace = traces
    assert torch.equal(torch.stack(trace.losses), torch.stack(torch_trace.losses))
    for name, value in torch_trace.params.items():
        assert torch.equal(trace.params[name], value), name


def _assign_into_meta(rank: int, world_size: int) -> None:
    for tied in (False, True):
        ref = _reference(tied)
        full_sd = ref.state_dict()
        for kind in ("full", "dtensor"):
            with torch.device("meta"):
                model = shard_llama(Llama(tied))
            params_before = list(model.parameters())
            if kind == "full":
                sd = full_sd
            else:  # torchtune's and Accelerate's way: each full tensor distributed like the meta parameter
                meta_sd = model.state_dict()
                sd = {k: distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements) for k, v in full_sd.items()}
            model.load_state_dict(sd, assign=True)
            assert list(model.parameters()) == params_before
            assert all(p.to_local().device.type == "cpu" for p in model.parameters())
            if tied:
                assert model.head.weight is model.tok.weight
            torch.testing.assert_close(full_params(model), full_params(ref), rtol=0, atol=0)
            _parity(rank, world_size, _reference(tied), model)

    # A full state dict on rank 0 only, broadcast into a meta model (no to_empty first).
    ref = _reference()
    with torch.device("meta"):
        model = shard_llama(Llama())
    full_sd = ref.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    torch.testing.assert_close(full_params(model), full_params(ref), rtol=0, atol=0)
    _parity(rank, world_size, _reference(), model)


def _converted_after_training(rank: int, world_size: int) -> None:
    """Training, then the whole model converted (dtype and fresh storage), then training again."""
    ref = _reference()
    torch.manual_seed(0)
    model = shard_llama(Llama())
    model.reset_parameters()
    _parity(rank, world_size, ref, model, steps=2)
    ref.double()
    model.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    batches = random_batches(2, world_size, lambda g: token_batch(g))
    assert_parity(train(ref, batches, lm_loss, rank=None), train(model, batches, lm_loss, rank=rank), rank)
    # Fresh storage (as a move to another device gives) keeps the values that are loaded into it.
    saved = {k: v.clone() for k, v in ref.state_dict().items()}
    model.to_empty(device="cpu")
    model.load_state_dict(saved)
    torch.testing.assert_close(full_params(model), full_params(ref), rtol=0, atol=0)
    _parity(rank, world_size, ref, model, steps=2)


def _partly_on_meta(rank: int, world_size: int) -> None:
    """A group some of whose parameters are on meta (a submodule moved there before ``fully_shard``): the others
    keep their values until the group is materialised; a forward before names the meta ones; ``to_empty`` (then
    init), ``load_state_dict(assign=True)`` and a broadcast from rank 0 each make it train as the unsharded model
    (FSDP2 takes ``to_empty``, bit for bit, and raises ``AttributeError`` on the assign)."""
    def partly_meta(shard: Callable[..., Any] = fully_shard, **kwargs: Any) -> Llama:
        model = Llama()
        model.reset_parameters()
        model.layers[0].mlp.to("meta")
        return shard_llama(model, functools.partial(shard, **kwargs))

    model = partly_meta()
    ref = _reference()
    sd = model.state_dict()
    for name, value in sd.items():
        assert value.device.type == ("meta" if name.startswith("layers.0.mlp.") else "cpu"), name
        if not name.startswith("layers.0.mlp."):
            torch.testing.assert_close(value.full_tensor(), ref.state_dict()[name], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"still on meta device: \['layers.0.mlp.0.weight', 'layers.0.mlp.0.bias', "
                       r"'layers.0.mlp.2.weight', 'layers.0.mlp.2.bias'\]"):
        model(torch.zeros(2, CFG.seq_len, dtype=torch.long))

    for kwargs in ({}, {"offload_policy": CPUOffloadPolicy(pin_memory=False)}):
        model = partly_meta(**kwargs)
        model.to_empty(device="cpu")
        model.reset_parameters()
        _parity(rank, world_size, _reference(), model)

    model = partly_meta()
    model.load_state_dict(_reference().state_dict(), assign=True)
    _parity(rank, world_size, _reference(), model)

    model = partly_meta()
    full_sd = _reference().state_dict() if rank == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _parity(rank, world_size, _reference(), model)

    traces = []
    for shard in (torch_fully_shard, fully_shard):
        model = partly_meta(shard)
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        model.init_weights()
        batches = random_batches(2, world_size, token_batch)
        traces.append(train(model, batches, lm_loss, rank=rank, make_optim=lambda p: torch.optim.AdamW(p, lr=1e-2)))
    assert torch.equal(torch.stack(traces[0].losses), torch.stack(traces[1].losses))
    for name, value in traces[0].params.items():
        assert torch.equal(traces[1].params[name], value), name


def test_group_partly_on_meta() -> None:
    run_ranks(2, _partly_on_meta)


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_init_then_to_empty_in_any_member_order(world_size: int) -> None:
    run_ranks(world_size, _meta_then_to_empty)


def test_meta_init_and_random_init_weights_equal_fsdp2() -> None:
    run_ranks(2, _same_as_fsdp2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_load_state_dict_assign_into_meta_model(world_size: int) -> None:
    run_ranks(world_size, _assign_into_meta)


def test_conversions_after_training_started() -> None:
    run_ranks(2, _converted_after_training)
