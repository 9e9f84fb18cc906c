"""model.state_dict() / load_state_dict, full model and optimizer state, re-keying, meta-device init."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard import (
    OptimStateKeyType,
    full_optim_state_dict,
    full_state_dict,
    fully_shard,
    load_full_optim_state_dict,
    rekey_optim_state_dict,
)
from fullshard import optim as fs_optim
from fullshard.runtime import state_of
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss
from tests.parity import Trace, assert_parity, full_params, random_batches, token_batch, train
from tests.test_parity import shard_transformer


def assert_linked(model: nn.Module) -> None:
    """Every sharded parameter still reaches its rows of its group's flat shard buffer."""
    for module in model.modules():
        state = state_of(module)
        if state is None or state.group is None:
            continue
        group = state.group
        for p, chunk in zip(group.params, group.chunks(group.flat_shard)):
            local = p.sharded.to_local()
            assert local.numel() == 0 or local.data_ptr() == p.local_rows(chunk).data_ptr(), p.fqn
        for name, param in module.named_parameters(recurse=False):
            assert isinstance(param, DTensor), name


def build_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = Transformer()
    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    return ref, model


def _state_dict_roundtrips(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    batches = random_batches(4, world_size, token_batch)
    assert_parity(train(ref, batches[:2], lm_loss, rank=None), train(model, batches[:2], lm_loss, rank=rank), rank)
    model(batches[0][rank][:, :-1])  # the root stays unsharded after this forward
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(isinstance(v, DTensor) for v in sd.values())
    model.zero_grad()

    torch.manual_seed(1)
    other = Transformer()
    shard_transformer(other)
    other.load_state_dict(sd)  # sharded DTensors, same placements
    assert_linked(other)
    torch.testing.assert_close(full_params(other), full_params(ref))

    torch.manual_seed(2)
    from_full = Transformer()
    shard_transformer(from_full)
    from_full.load_state_dict(ref.state_dict())  # plain full tensors
    assert_linked(from_full)
    torch.testing.assert_close(full_params(from_full), full_params(ref))

    torch.manual_seed(3)
    assigned = Transformer()
    shard_transformer(assigned)
    params_before = list(assigned.parameters())
    assigned.load_state_dict(ref.state_dict(), assign=True)
    assert_linked(assigned)
    assert list(assigned.parameters()) == params_before  # the optimizer's objects stay the live ones
    torch.testing.assert_close(full_params(assigned), full_params(ref))
    assert_parity(train(ref, batches[2:], lm_loss, rank=None), train(assigned, batches[2:], lm_loss, rank=rank), rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_dict_and_load_state_dict(world_size: int) -> None:
    run_ranks(world_size, _state_dict_roundtrips)


def _saved_per_rank(rank: int, world_size: int, directory: str, make_optim: str) -> None:
    """Each rank's sharded state dicts through ``torch.save``/``torch.load`` (as many training scripts checkpoint),
    ``copy.deepcopy`` (a best-so-far snapshot) and DCP's ``async_save``, then resumed: every local tensor but a
    group's first reaches its flat shard buffer past the buffer's start ([Note: Own-storage views])."""
    optims: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
        "fullshard_adamw": lambda params: fs_optim.AdamW(params, lr=0.01),  # its state views flat buffers
    }
    ref, model = build_pair()
    batches = random_batches(4, world_size, token_batch)
    ref_trace = train(ref, batches, lm_loss, rank=None, make_optim=optims[make_optim])
    trace = train(model, batches[:2], lm_loss, rank=rank, make_optim=optims[make_optim])
    assert trace.optim is not None
    starts = {p.to_local().untyped_storage().data_ptr() - p.to_local().data_ptr() for p in model.parameters()}
    assert starts == {0}  # each local tensor starts its storage, though most lie inside their group's buffer
    # Each value starts a storage of its own, and the same one in every state dict (DCP's async stager caches
    # its host copies by storage).
    # torch.save and deepcopy copy whole storages: each holds exactly its value's elements.
    first, again = model.state_dict(), model.state_dict()
    for name, p in model.named_parameters():
        local = first[name].to_local()
        assert local.storage_offset() == 0 and local.data_ptr() == p.to_local().data_ptr(), name
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), name
        assert local.untyped_storage()._cdata == again[name].to_local().untyped_storage()._cdata, name
    for state in trace.optim.state.values():
        for value in state.values():
            if value.dim():
                assert value.to_local().untyped_storage().nbytes() == value.to_local().numel() * value.element_size()
    path = Path(directory) / f"rank{rank}.pt"
    torch.save({"model": model.state_dict(), "optim": trace.optim.state_dict()}, path)
    snapshot = copy.deepcopy({"model": model.state_dict(), "optim": trace.optim.state_dict()})
    staged = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, trace.optim)}
    dcp.async_save(staged, checkpoint_id=Path(directory) / "dcp", process_group=dist.new_group(backend="gloo")).result()
    lm_loss(model, batches[2][rank]).backward()  # training goes on; the copies keep the values saved
    trace.optim.step()
    trace.optim.zero_grad()

    loaded = torch.load(path, weights_only=True)
    for state in (loaded, snapshot, None):
        torch.manual_seed(1)
        resumed = Transformer()
        shard_transformer(resumed)
        optim = optims[make_optim](resumed.parameters())
        if state is None:
            state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, optim)}
            dcp.load(state, checkpoint_id=Path(directory) / "dcp")
        resumed.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        after = train(resumed, batches[2:], lm_loss, rank=rank, optim=optim)
        assert_parity(ref_trace, Trace(losses=trace.losses + after.losses, grads=trace.grads + after.grads,
                                       params=after.params), rank)


@pytest.mark.parametrize("make_optim", ["adamw", "fullshard_adamw"])
def test_torch_save_deepcopy_and_async_save_of_sharded_state_dicts(make_optim: str, tmp_path: Path) -> None:
    run_ranks(2, _saved_per_rank, str(tmp_path), make_optim)


def _assigned_before_lazy_init(rank: int, world_size: int) -> None:
    """A DTensor assigned after fully_shard is what state_dict() shows until lazy init takes it over; a state
    dict taken before a re-link does not keep the old flat buffer in later ones."""
    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    weight = model.blocks[0].mlp[0].weight
    value = torch.randn(weight.shape)
    model.blocks[0].mlp[0].weight = nn.Parameter(distribute_tensor(value, weight.device_mesh, weight.placements))
    torch.testing.assert_close(model.state_dict()["blocks.0.mlp.0.weight"].full_tensor(), value, rtol=0, atol=0)
    model(token_batch(torch.Generator().manual_seed(rank))[:, :-1])  # lazy init takes the assigned value over
    torch.testing.assert_close(model.state_dict()["blocks.0.mlp.0.weight"].full_tensor(), value, rtol=0, atol=0)
    before = model.state_dict()["blocks.1.attn.qkv.weight"].to_local()
    model.double()  # a re-link: new flat buffers
    after = model.state_dict()["blocks.1.attn.qkv.weight"].to_local()
    assert after.dtype == torch.float64 and after.data_ptr() == model.blocks[1].attn.qkv.weight.to_local().data_ptr()
    assert before.data_ptr() != after.data_ptr()


def test_state_dict_before_lazy_init_and_after_relink() -> None:
    run_ranks(2, _assigned_before_lazy_init)


def _to_dtype(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    ref.double()
    params_before = list(model.parameters())
    model.double()
    assert_linked(model)
    assert list(model.parameters()) == params_before
    assert all(p.dtype == torch.float64 for p in model.parameters())
    batches = random_batches(2, world_size, token_batch)
    assert_parity(train(ref, batches, lm_loss, rank=None), train(model, batches, lm_loss, rank=rank), rank)
    # Cast after training, for a bf16 evaluation (FSDP2's forward then raises "Expected out tensor to have
    # dtype c10::BFloat16").
    ref.to(torch.bfloat16).eval()
    model.to(torch.bfloat16).eval()
    assert_linked(model)
    tokens = batches[0][rank][:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=0, atol=0)


def test_module_to_keeps_flat_buffer_link() -> None:
    run_ranks(2, _to_dtype)


# ---- full optimizer state -------------------------------------------------------------------------


class CountingSGD(torch.optim.SGD):
    """SGD that also keeps a non-tensor state: how many steps each parameter took."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def two_groups(kind: str, model: nn.Module, reverse: bool = False) -> torch.optim.Optimizer:
    params = list(model.parameters())[::-1] if reverse else list(model.parameters())
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    # eps well above fp noise: the attention key bias has a mathematically zero gradient,
    # which Adam's normalisation would otherwise turn into noise-sized steps.
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01, eps=1e-4)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, eps=1e-4)
    return CountingSGD(groups, lr=0.05, momentum=0.9)


def frozen_transformer() -> nn.Module:
    model = Transformer()
    model.blocks[0].ln1.weight.requires_grad_(False)
    return model


def _full_optim_state(rank: int, world_size: int, kind: str) -> None:
    torch.manual_seed(0)
    ref = frozen_transformer()
    torch.manual_seed(0)
    model = frozen_transformer()
    shard_transformer(model)
    ref_opt, opt = two_groups(kind, ref), two_groups(kind, model)
    batches = random_batches(4, world_size, token_batch)
    assert_parity(train(ref, batches[:2], lm_loss, rank=None, optim=ref_opt),
                  train(model, batches[:2], lm_loss, rank=rank, optim=opt), rank)

    full = full_optim_state_dict(model, opt)
    expected = rekey_optim_state_dict(ref_opt.state_dict(), ref, OptimStateKeyType.PARAM_NAME, ref_opt)
    if rank != 0:
        assert full == {}
    else:
        assert "blocks.0.ln1.weight" not in full["state"]  # frozen: no state
        assert full["param_groups"] == expected["param_groups"]
        assert full["state"].keys() == expected["state"].keys()
        for name, states in expected["state"].items():
            assert full["state"][name].keys() == states.keys(), name
            for key, value in states.items():
                got = full["state"][name][key]
                if isinstance(value, torch.Tensor):
                    assert not isinstance(got, DTensor) and got.device.type == "cpu"
                    torch.testing.assert_close(got, value, msg=lambda m: f"{name}.{key}: {m}")
                else:
                    assert got == value, (name, key)
    assert full_optim_state_dict(model, opt, rank0_only=False)["param_groups"] == expected["param_groups"]

    # A fresh sharded model and optimizer, loaded from rank 0's full state, continue like the reference.
    torch.manual_seed(5)
    resumed = frozen_transformer()
    shard_transformer(resumed)
    resumed.load_state_dict(full_state_dict(model, rank0_only=False))
    resumed_opt = two_groups(kind, resumed, reverse=True)  # the state is keyed by name: any order loads
    load_full_optim_state_dict(resumed, resumed_opt, full if rank == 0 else None)
    swapped = copy.deepcopy(full_optim_state_dict(model, opt, rank0_only=False))
    swapped["param_groups"][0]["params"][-1], swapped["param_groups"][1]["params"][-1] = (
        swapped["param_groups"][1]["params"][-1], swapped["param_groups"][0]["params"][-1])
    with pytest.raises(ValueError, match="param group 0 holds .* in the state and .* in the optimizer"):
        load_full_optim_state_dict(resumed, two_groups(kind, resumed), swapped)
    with pytest.raises(ValueError, match="the state has 2 param groups, the optimizer 1"):
        load_full_optim_state_dict(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), swapped)
    assert_parity(train(ref, batches[2:], lm_loss, rank=None, optim=ref_opt),
                  train(resumed, batches[2:], lm_loss, rank=rank, optim=resumed_opt), rank)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "counting"])
def test_full_optim_state_dict(kind: str) -> None:
    run_ranks(2, _full_optim_state, kind)


def _plain_to_sharded_and_back(rank: int, world_size: int) -> None:
    """A checkpoint of a plain (unsharded) script loads into a sharded run, and the reverse."""
    ref, model = build_pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-4)
    batches = random_batches(4, world_size, token_batch)
    train(ref, batches[:2], lm_loss, rank=None, optim=ref_opt)
    plain_osd = ref_opt.state_dict()  # keyed by parameter ids, as torch.optim saves it
    by_name = rekey_optim_state_dict(plain_osd, ref, OptimStateKeyType.PARAM_NAME)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-4)
    load_full_optim_state_dict(model, opt, by_name)
    assert_parity(train(ref, batches[2:], lm_loss, rank=None, optim=ref_opt),
                  train(model, batches[2:], lm_loss, rank=rank, optim=opt), rank)

    back = rekey_optim_state_dict(full_optim_state_dict(model, opt, rank0_only=False), model, OptimStateKeyType.PARAM_ID)
    torch.manual_seed(0)
    plain = Transformer()
    plain.load_state_dict(full_state_dict(model, rank0_only=False))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, eps=1e-4)
    plain_opt.load_state_dict(back)
    torch.testing.assert_close(plain_opt.state_dict()["state"], ref_opt.state_dict()["state"])
    with pytest.raises(ValueError, match="is not a parameter id of this model"):
        rekey_optim_state_dict(by_name, ref, OptimStateKeyType.PARAM_NAME)


def test_rekey_between_plain_and_sharded() -> None:
    run_ranks(2, _plain_to_sharded_and_back)


def _full_state_dict(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    full = full_state_dict(model)
    if rank == 0:
        assert list(full) == list(ref.state_dict())
        for key, value in ref.state_dict().items():
            assert type(full[key]) is torch.Tensor and full[key].device.type == "cpu"
            torch.testing.assert_close(full[key], value, rtol=0, atol=0)
    else:
        assert full == {}
    everywhere = full_state_dict(model, rank0_only=False, cpu_offload=False)
    assert list(everywhere) == list(ref.state_dict())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_state_dict(world_size: int) -> None:
    run_ranks(world_size, _full_state_dict)


# ---- meta-device initialisation -------------------------------------------------------------------


class DeterministicInit(Transformer):
    """reset_parameters() fills every parameter from its name, so any sharding gives the same values."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for i, (name, p) in enumerate(self.named_parameters()):
                full = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * 0.37 + i).view(p.shape) * 0.3
                if isinstance(p, DTensor):
                    p.copy_(torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
                else:
                    p.copy_(full)


def _meta_init(rank: int, world_size: int) -> None:
    ref = DeterministicInit()
    ref.reset_parameters()
    with torch.device("meta"):
        model = DeterministicInit()
    shard_transformer(model)
    params_before = list(model.parameters())
    model.to_empty(device="cpu")
    model.reset_parameters()
    assert list(model.parameters()) == params_before
    assert_linked(model)
    batches = random_batches(3, world_size, token_batch)
    assert_parity(train(ref, batches, lm_loss, rank=None), train(model, batches, lm_loss, rank=rank), rank)

    with torch.device("meta"):
        never = Transformer()
    shard_transformer(never)
    with pytest.raises(ValueError, match=r"still on meta device: \['tok.weight', 'pos.weight', 'norm.weight'"):
        never(batches[0][rank][:, :-1])

    # A full state dict on rank 0 only, broadcast into a meta-initialised sharded model.
    with torch.device("meta"):
        target = Transformer()
    shard_transformer(target)
    target.to_empty(device="cpu")
    full = ref.state_dict() if rank == 0 else {}
    set_model_state_dict(target, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_linked(target)
    torch.testing.assert_close(full_params(target), full_params(ref))


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_device_init(world_size: int) -> None:
    run_ranks(world_size, _meta_init)




def _user_state_dict_hooks(rank: int, world_size: int) -> None:
    """Post-hooks registered on a sharded module before ``fully_shard`` see and change the sharded values, as on
    the unsharded model and FSDP2: a cast to bf16 stays, a renamed entry is a live DTensor after the backward frees
    the unsharded parameters; ``keep_vars=True`` gives the optimizer's parameters, also while unsharded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    seen: list[type] = []

    def to_bf16_renamed(module: nn.Module, sd: dict[str, Any], prefix: str, metadata: Any) -> None:
        seen.append(type(sd[prefix + "weight"]))
        sd[prefix + "w"] = sd.pop(prefix + "weight").to(torch.bfloat16)

    model[2].register_state_dict_post_hook(to_bf16_renamed)
    fully_shard(model[0])
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = full_params(model)["2.weight"].to(torch.bfloat16)
    loss = model(torch.randn(3, 8)).sum()  # the root's group stays unsharded until the backward
    sd = model.state_dict()
    held = model.state_dict(keep_vars=True)
    loss.backward()
    assert seen == [DTensor, DTensor]
    assert "2.weight" not in sd and sd["2.w"].dtype == torch.bfloat16 and isinstance(sd["2.w"], DTensor)
    torch.testing.assert_close(sd["2.w"].full_tensor(), expected)
    params = opt.param_groups[0]["params"]  # 0.weight, 0.bias, 2.weight, 2.bias
    assert all(a is b for a, b in zip([held["0.weight"], held["0.bias"], held["2.bias"]], [params[0], params[1], params[3]]))
    assert all(type(held[name]) is DTensor and isinstance(held[name], nn.Parameter) for name in ("0.bias", "2.bias"))


def test_user_state_dict_hooks_and_keep_vars() -> None:
    run_ranks(2, _user_state_dict_hooks)


def _state_dict_after_a_forward(rank: int, world_size: int, impl: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fully_shard if impl == "fullshard" else torch_fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))  # the LayerNorm in the root's group
    shard(model[0])
    shard(model[2])
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(3):
        loss = model(torch.randn(5, 4, generator=gen)).square().mean()  # the root keeps its parameters for backward
        msd, osd = get_state_dict(model, opt)  # pairs model.named_parameters() with the optimizer's by name
        assert set(osd["state"]) == set(msd)
        loss.backward()  # all-gathers the root's group again
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, full_params(model)


def test_get_state_dict_between_forward_and_backward() -> None:
    """A group left unsharded by a forward (the root, until its backward) registers its sharded parameters when a
    state dict is taken, as on FSDP2, so torch's get_state_dict pairs the model's parameters with the optimizer's (it
    raised KeyError), and the backward after it trains as FSDP2's does."""
    ours = run_ranks(2, _state_dict_after_a_forward, "fullshard")
    theirs = run_ranks(2, _state_dict_after_a_forward, "fsdp2")
    for (losses, params), (torch_losses, torch_params) in zip(ours, theirs):
        assert losses == torch_losses
        assert all(torch.equal(params[name], torch_params[name]) for name in torch_params)


def _load_from_another_mesh(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    flat = init_device_mesh("cpu", (world_size,))
    square = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    values = {k: v * 2 + 1 for k, v in nn.Linear(6, 5).state_dict().items()}
    for model_mesh, value_mesh, placements in ((flat, square, [Replicate(), Shard(0)]), (square, flat, [Shard(0)])):
        for assign in (False, True):
            model = nn.Linear(6, 5)
            fully_shard(model, mesh=model_mesh)
            params = list(model.parameters())
            sd = {k: distribute_tensor(v, value_mesh, placements) for k, v in values.items()}
            model.load_state_dict(sd, assign=assign)
            assert all(a is b for a, b in zip(model.parameters(), params))  # the optimizer's objects stay live
            for name, p in model.named_parameters():
                assert p.device_mesh == model_mesh and torch.equal(p.full_tensor(), values[name])


def test_load_state_dict_from_another_mesh() -> None:
    """DTensor values on another mesh over the same ranks (a 2-D mesh into a 1-D-sharded model, and back) load,
    with and without assign=True (FSDP2 raises: copy_ between meshes)."""
    run_ranks(4, _load_from_another_mesh)
