"""fullshard.EMA: a shard-wise moving average equal to the unsharded model's, swap, state dicts and checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from fullshard import EMA, checkpoint
from tests.harness import run_ranks
from tests.models import Transformer, lm_loss, mse_loss
from tests.parity import full_params, random_batches, token_batch, train
from tests.test_state_dict import build_pair

DECAY = 0.8


def _ema_parity(rank: int, world_size: int, ckpt_dir: str) -> None:
    ref, model = build_pair()
    ref_ema, ema = EMA(ref, DECAY), EMA(model, DECAY)
    batches = random_batches(4, world_size, token_batch)
    ref_optim = model_optim = None
    for step_batches in batches:  # one step at a time: the averages move after every optimizer step
        ref_optim = train(ref, [step_batches], lm_loss, rank=None, optim=ref_optim).optim
        model_optim = train(model, [step_batches], lm_loss, rank=rank, optim=model_optim).optim
        ref_ema.update()
        ema.update()
    expected = ref_ema.full_state_dict(rank0_only=False)
    got = ema.full_state_dict(rank0_only=False)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)
    # The averages are sharded like the parameters and use no more memory per rank.
    average = ema.state_dict()["blocks.0.mlp.0.weight"]
    assert isinstance(average, DTensor) and average.placements == (Shard(0),)
    assert average.to_local().shape == model.blocks[0].mlp[0].weight.to_local().shape

    trained = full_params(model)
    tokens = token_batch(torch.Generator().manual_seed(9))
    with ema.swap():
        torch.testing.assert_close(full_params(model), expected)
        with ref_ema.swap():
            torch.testing.assert_close(lm_loss(model, tokens), lm_loss(ref, tokens))  # evaluates the averages
    torch.testing.assert_close(full_params(model), trained, rtol=0, atol=0)  # trained values back, exactly

    # Checkpoint with the model, load into a fresh EMA; full tensors load too.
    checkpoint.save({"ema": ema.state_dict()}, Path(ckpt_dir) / "step")
    fresh = EMA(model, DECAY)
    state = {"ema": fresh.state_dict()}
    checkpoint.load(state, Path(ckpt_dir) / "step")
    fresh.load_state_dict(state["ema"])
    torch.testing.assert_close(fresh.full_state_dict(rank0_only=False), expected)
    other = EMA(model, DECAY)
    other.load_state_dict(expected)
    torch.testing.assert_close(other.full_state_dict(rank0_only=False), expected)
    with pytest.raises(ValueError, match=r"does not match the model: missing \['blocks.0.ln1.bias'"):
        other.load_state_dict({k: v for k, v in expected.items() if k != "blocks.0.ln1.bias"})
    assert ema.full_state_dict() == {} if rank else ema.full_state_dict().keys() == expected.keys()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ema_matches_unsharded(world_size: int, tmp_path: Path) -> None:
    run_ranks(world_size, _ema_parity, str(tmp_path))


def _ema_follows_assigned(rank: int, world_size: int) -> None:
    ref, model = build_pair()
    ema = EMA(model, DECAY)
    expected = {name: p.detach().clone() for name, p in ref.named_parameters()}
    batches = random_batches(3, world_size, token_batch)
    for step, step_batches in enumerate(batches):
        if step == 1:  # a weight re-initialised between steps: the average goes on with the new parameter
            for m in (ref, model):
                with torch.no_grad():
                    m.blocks[0].mlp[0].weight = torch.nn.Parameter(m.blocks[0].mlp[0].weight * 0.5)
        train(ref, [step_batches], lm_loss, rank=None)
        train(model, [step_batches], lm_loss, rank=rank)
        for name, p in ref.named_parameters():  # by name, each step
            expected[name].lerp_(p.detach(), 1 - DECAY)
        ema.update()
    torch.testing.assert_close(ema.full_state_dict(rank0_only=False), expected)


def test_ema_follows_a_parameter_assigned_between_steps() -> None:
    run_ranks(2, _ema_follows_assigned)


def test_ema_rejects_bad_decay() -> None:
    for bad in (1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="EMA decay must be a number in \\[0, 1\\]"):
            EMA(Transformer(), bad)  # type: ignore[arg-type]


def _ema_tp_full_tensors(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_tensor_parallel import Net, batch, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(Net(), mesh["dp"], mesh["tp"])  # in_proj: 15 rows, TP pieces of 8 and 7, dp chunks of 4/4, 4/3
    ema = EMA(model, DECAY)
    for step_batches in random_batches(2, 2, batch):
        train(model, [step_batches], mse_loss, rank=mesh["dp"].get_local_rank())
        ema.update()
    gen = torch.Generator().manual_seed(3)
    loaded = {name: torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}
    ema.load_state_dict(loaded)
    torch.testing.assert_close(ema.full_state_dict(rank0_only=False), loaded, rtol=0, atol=0)
    # Each rank holds the piece the model's own load_state_dict cuts from the same full tensors.
    model.load_state_dict(loaded)
    averages = ema.state_dict()
    for name, p in model.named_parameters():
        assert averages[name].placements == p.placements, name
        torch.testing.assert_close(averages[name].to_local(), p.to_local(), rtol=0, atol=0, msg=name)
    wrong = dict(loaded, **{"blocks.0.in_proj.weight": torch.zeros(14, 5)})
    with pytest.raises(ValueError, match=r"EMA state for 'blocks.0.in_proj.weight' has shape \(14, 5\), expected \(15, 5\)"):
        ema.load_state_dict(wrong)


def test_ema_loads_full_tensors_with_tensor_parallel_uneven_rows() -> None:
    """Full tensors load into an EMA of a dp x tp model whose rows do not divide (was a bare AssertionError)."""
    run_ranks(4, _ema_tp_full_tensors)
