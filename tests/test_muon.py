"""fullshard.optim.Muon, and torch.optim.Muon on fullshard's parameters (fullshard runs its step): whole-matrix
Newton-Schulz on an owner rank, against torch.optim.Muon unsharded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard

import fullshard
from fullshard import fully_shard
from fullshard.muon import owners
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import full_params, random_batches, regression_batch

BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}  # Newton-Schulz runs in bf16


class Pair(torch.optim.Optimizer):
    """Muon for the 2-D weights, AdamW for the biases (torch's Muon takes matrices only)."""

    def __init__(self, model: nn.Module, muon: type[torch.optim.Optimizer]) -> None:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        self.muon = muon(matrices, lr=0.02, weight_decay=0.01, momentum=0.9)
        self.adamw = torch.optim.AdamW(others, lr=1e-2)
        super().__init__(model.parameters(), {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def _train(model: nn.Module, opt: Pair, batches: list[list[Any]], rank: int | None) -> list[float]:
    losses = []
    for step_batches in batches:
        if rank is None:
            step_losses = [mse_loss(model, b) for b in step_batches]
            (sum(step_losses) / len(step_losses)).backward()
            losses.append([float(x) for x in step_losses])
        else:
            loss = mse_loss(model, step_batches[rank])
            loss.backward()
            losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return losses


def shard(model: nn.Module, columns: bool = False) -> nn.Module:
    """``columns``: the weights sharded on dim 1 (``shard_placement_fn``), the biases on dim 0."""
    place = (lambda p: Shard(1) if p.ndim == 2 else None) if columns else None
    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=place)
    fully_shard(model, shard_placement_fn=place)
    return model


def _parity(rank: int, world_size: int, columns: bool, muon: str = "fullshard") -> dict[str, int]:
    # Rows: weights 13x7, 5x13, 3x5 (uneven rows, and ranks with no rows at 4). Columns: 8x8 (square), 12x8 (tall),
    # 4x12 (wide), 3x4, all dividing among 2 and 4 ranks.
    dims = (8, 8, 12, 4, 3) if columns else (7, 13, 5, 3)
    torch.manual_seed(0)
    ref = MLP(dims)
    torch.manual_seed(0)
    model = shard(MLP(dims), columns)
    batches = random_batches(5, world_size, lambda gen: regression_batch(gen, in_dim=dims[0]))
    ref_losses = _train(ref, Pair(ref, torch.optim.Muon), batches, None)
    calls = {"all_to_all": 0}
    orig = dist.all_to_all_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_to_all"] += 1
        return orig(*args, **kwargs)

    dist.all_to_all_single = counting  # type: ignore[assignment]
    try:
        opt = Pair(model, fullshard.optim.Muon if muon == "fullshard" else torch.optim.Muon)
        losses = _train(model, opt, batches, rank)
    finally:
        dist.all_to_all_single = orig  # type: ignore[assignment]
    for step, (loss, ref_step) in enumerate(zip(losses, ref_losses)):
        assert loss == pytest.approx(ref_step[rank], rel=1e-3), step
    params = full_params(model)
    for name, value in full_params(ref).items():
        torch.testing.assert_close(params[name], value, msg=lambda m: f"{name}: {m}", **BF16_TOL)
    buf = opt.muon.state[model.layers[0].weight]["momentum_buffer"]
    assert isinstance(buf, DTensor) and buf.placements == model.layers[0].weight.placements
    assert buf.placements[0] == (Shard(1) if columns else Shard(0))
    return calls


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("columns", [False, True], ids=["dim0", "dim1"])
def test_muon_matches_torch_muon_unsharded(world_size: int, columns: bool) -> None:
    for calls in run_ranks(world_size, _parity, columns):
        assert calls == {"all_to_all": 2 * 5}  # two all-to-alls per step: rows to the owners and back


def _torch_muon(rank: int, world_size: int) -> None:
    dims = (7, 13, 5, 3)
    batches = random_batches(4, world_size, lambda gen: regression_batch(gen, in_dim=dims[0]))
    models, opts = [], []
    for muon in (torch.optim.Muon, fullshard.optim.Muon):
        torch.manual_seed(0)
        models.append(shard(MLP(dims)))
        opts.append(Pair(models[-1], muon))
        _train(models[-1], opts[-1], batches, rank)
    # torch's class on fullshard's parameters takes fullshard's step: the same bits and state.
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a._local_tensor, b._local_tensor), name
        if a.ndim == 2:
            buffers = [opt.muon.state[p]["momentum_buffer"] for opt, p in zip(opts, (a, b), strict=True)]
            assert buffers[0]._spec == buffers[1]._spec and torch.equal(*(t._local_tensor for t in buffers)), name
    # torch's refusals, on every rank before any collective (Newton-Schulz runs on the owner alone).
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"ns_steps": 100}, "ns_steps must be less than 100"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients must be 3 values"),
        ({}, "must be a 2D matrix"),  # a vector from add_param_group, which does not check
    ]
    bias = models[0].layers[0].bias
    for change, message in refusals:
        opt = torch.optim.Muon([p for p in models[0].parameters() if p.ndim == 2])
        opt.param_groups[0].update(change)
        if not change:
            opt.add_param_group({"params": [bias]})
        mse_loss(models[0], batches[0][rank]).backward()
        with pytest.raises(ValueError, match=message):
            opt.step()
        opt.zero_grad()
    # torch's refusal of complex parameters stays.
    model = fully_shard(nn.Linear(4, 3, bias=False).to(torch.complex64))
    opt = torch.optim.Muon(model.parameters())
    model(torch.randn(2, 4, dtype=torch.complex64)).abs().sum().backward()
    with pytest.raises(RuntimeError, match="Muon does not support complex parameters"):
        opt.step()


def test_torch_muon_on_fullshard_parameters_steps_like_fullshard_muon() -> None:
    run_ranks(2, _torch_muon)


def _tensor_parallel(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_tensor_parallel import Net, batch, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    batches = random_batches(4, 2, batch)
    torch.manual_seed(0)
    ref = Net()
    # full values with autograd history (full_tensor() of the parameters), as a load_state_dict may get them
    start = {n: p * 1.0 for n, p in ref.named_parameters()}
    ref_losses = _train(ref, Pair(ref, torch.optim.Muon), batches, None)
    results = []
    for muon in (fullshard.optim.Muon, torch.optim.Muon):
        model = parallelize(Net(), mesh["dp"], mesh["tp"])
        model.load_state_dict(start)
        opt = Pair(model, muon)
        losses = _train(model, opt, batches, dp_rank)
        results.append((losses, full_params(model), opt))
    (losses, params, _), (_, torch_params, torch_opt) = results
    for step, (loss, ref_step) in enumerate(zip(losses, ref_losses)):
        assert loss == pytest.approx(ref_step[dp_rank], rel=1e-3), step
    for name, value in full_params(ref).items():
        torch.testing.assert_close(params[name], value, msg=lambda m: f"{name}: {m}", **BF16_TOL)
        # torch's class takes fullshard's step, not DTensor's sharded matrix products: the same bits
        assert torch.equal(torch_params[name], params[name]), name
    weight = model.blocks[0].in_proj.weight  # (_StridedShard(0), Shard(0)) on (dp, tp)
    assert len([pl for pl in weight.placements if not pl.is_replicate()]) == 2
    buf = torch_opt.muon.state[weight]["momentum_buffer"]
    assert isinstance(buf, DTensor) and buf.placements == weight.placements


def test_muon_under_tensor_parallel_orthogonalises_whole_matrices() -> None:
    """Weights split over (dp, tp): gathered whole on every rank and orthogonalised there."""
    run_ranks(4, _tensor_parallel)


def test_owners_balance_newton_schulz_cost() -> None:
    shapes = [torch.Size(s) for s in [(1024, 1024), (1024, 4096), (4096, 1024), (1024, 1024), (64, 64)]]
    owner = owners(shapes, 2)
    load = [0, 0]
    for shape, rank in zip(shapes, owner):
        load[rank] += shape[0] * shape[1] * min(shape)
    assert owner == owners(shapes, 2)  # deterministic: every rank computes the same
    assert max(load) <= 1.5 * min(load), (owner, load)


def _save(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = shard(MLP())
    opt = fullshard.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    batches = random_batches(2, world_size, regression_batch)
    for b in batches:
        mse_loss(model, b[rank]).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return {n: v.full_tensor() for n, v in _buffers(model, opt).items()}


def _buffers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters() if p in opt.state}


def _load(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = shard(MLP())
    opt = fullshard.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    return {n: v.full_tensor() for n, v in _buffers(model, opt).items()}


def test_muon_checkpoint_resumes_at_another_world_size(tmp_path: Path) -> None:
    saved = run_ranks(4, _save, str(tmp_path))[0]
    loaded = run_ranks(2, _load, str(tmp_path))[0]
    assert saved.keys() == loaded.keys() and len(saved) == 3
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
