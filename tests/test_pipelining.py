"""torch.distributed.pipelining over fullshard: pipeline stages whose modules are sharded over a data-parallel mesh
([Note: Pipeline schedules] in runtime.py).

4 ranks: 2 pipeline ranks x 2 data-parallel ranks. Each schedule trains the same 8-layer model with fullshard (torch's
FSDP2 names swapped, as torchtitan runs under ``python -m fullshard.as_fsdp2``) and with torch's FSDP2 in the same
process: losses and parameters bit for bit equal, and equal to the unsharded model trained on every rank's
micro-batches within fp32 rounding; beside bf16 mixed precision, CPU offload and HSDP too. Without the swap, torch's
schedules treat fullshard's modules as plain ones (each micro-batch reduces on its own): still the unsharded
model's training.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

import fullshard
from tests.harness import run_ranks

TORCH_FULLY_SHARD = torch_fsdp.fully_shard
WIDTH, LAYERS, MICRO_BATCHES, STEPS = 8, 8, 4, 2
# name -> (schedule class, stages per pipeline rank)
SCHEDULES: dict[str, tuple[Any, int]] = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2),
}


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(2 * MICRO_BATCHES, WIDTH, generator=g), torch.randn(2 * MICRO_BATCHES, WIDTH, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _reference(dp: int) -> tuple[list[float], torch.Tensor]:
    """The unsharded model, every rank's micro-batches in one process, the mean loss over them."""
    model = nn.Sequential(*_layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for dp_rank in range(dp):
            x, y = _batch(step, dp_rank)
            for xm, ym in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
                loss = _mse(model(xm), ym) / (MICRO_BATCHES * dp)
                loss.backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def _policies(variant: str) -> dict[str, Any]:
    """``fully_shard``'s policies for a variant, made with torch's classes (looked up at the call: swapped or not)."""
    if variant == "mixed":
        return {"mp_policy": torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if variant == "offload":
        return {"offload_policy": torch_fsdp.CPUOffloadPolicy(pin_memory=False)}
    return {}


def _train(schedule: str, shard: Any, *, reshard_after_forward: bool = True,
           variant: str = "plain") -> tuple[list[float], torch.Tensor]:
    """Train the pipelined model with ``shard`` (a ``fully_shard``); the mean loss per step and every parameter
    in order, the same on every rank. ``variant``: plain, mixed (bf16), offload (CPU), hsdp (2 replicas of 1)."""
    if variant == "hsdp":
        full = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))
        pp_mesh, dp_mesh, dp_rank = full["pp"], full["rep", "shard"], full["rep"].get_local_rank()
    else:
        full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_mesh, dp_mesh, dp_rank = full["pp"], full["dp"], full["dp"].get_local_rank()
    pp_rank = pp_mesh.get_local_rank()
    cls, per_rank = SCHEDULES[schedule]
    n_stages = 2 * per_rank
    # Interleaved: stages pp_rank, pp_rank + 2; V-shaped (ZBV): pp_rank, 3 - pp_rank.
    ids = [pp_rank] if per_rank == 1 else [pp_rank, (3 - pp_rank) if "ZBV" in schedule else pp_rank + 2]
    layers, per_stage = _layers(), LAYERS // n_stages
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, **_policies(variant)}
    stages, parts = [], {}
    for i in ids:
        part = nn.Sequential(*layers[i * per_stage:(i + 1) * per_stage])
        for block in part:
            shard(block, **kwargs)
        shard(part, **kwargs)
        parts[i] = part
        stages.append(PipelineStage(part, i, n_stages, torch.device("cpu"), group=pp_mesh.get_group()))
    opt = torch.optim.AdamW([p for part in parts.values() for p in part.parameters()], lr=1e-2)
    pipeline = cls(stages if per_rank > 1 else stages[0], n_microbatches=MICRO_BATCHES, loss_fn=_mse)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, dp_rank)
        step_losses: list[torch.Tensor] = []
        if 0 in ids:
            pipeline.step(x, target=y, losses=step_losses)
        else:
            pipeline.step(target=y, losses=step_losses)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([sum(loss.item() for loss in step_losses) / (2 * MICRO_BATCHES)])
        dist.all_reduce(total)  # the loss lives on the last stage's ranks
        losses.append(total.item())
    mine = {(i, k): cast(DTensor, p).full_tensor().detach().flatten() for i, part in parts.items()
            for k, p in enumerate(part.parameters())}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {key: value for ranks in everyone for key, value in ranks.items()}
    return losses, torch.cat([merged[key] for key in sorted(merged)])


def _torch_fully_shard(module: nn.Module, **kwargs: Any) -> Any:
    return torch_fsdp.fully_shard(module, **kwargs)  # looked up at the call: swapped or torch's


def _schedules_match_fsdp2(rank: int, world_size: int, schedule: str, reshard_after_forward: bool,
                           variant: str) -> None:
    with fullshard.use_as_fsdp2(announce=False):
        ours = _train(schedule, _torch_fully_shard, reshard_after_forward=reshard_after_forward, variant=variant)
    theirs = _train(schedule, _torch_fully_shard, reshard_after_forward=reshard_after_forward, variant=variant)
    assert ours[0] == theirs[0], (ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1]), (ours[1] - theirs[1]).abs().max()
    if schedule == "GPipe" and variant == "plain":
        # torch's FSDP2 itself while the names are swapped: the schedules still treat its stages as FSDP2's
        with fullshard.use_as_fsdp2(announce=False):
            torch_while_swapped = _train(schedule, TORCH_FULLY_SHARD, reshard_after_forward=reshard_after_forward)
        assert torch_while_swapped[0] == theirs[0] and torch.equal(torch_while_swapped[1], theirs[1])
    ref_losses, ref_params = _reference(dp=2)
    tol = 2e-2 if variant == "mixed" else 1e-5
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref_losses), rtol=tol, atol=tol)
    torch.testing.assert_close(ours[1], ref_params, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "schedule, reshard_after_forward, variant",
    [("GPipe", True, "plain"), ("1F1B", True, "mixed"), ("1F1B", False, "offload"), ("GPipe", False, "hsdp"),
     ("Interleaved1F1B", True, "plain"), ("ZBVZeroBubble", False, "plain")],
)
def test_schedules_match_fsdp2(schedule: str, reshard_after_forward: bool, variant: str) -> None:
    run_ranks(4, _schedules_match_fsdp2, schedule, reshard_after_forward, variant)


def _without_swap(rank: int, world_size: int) -> None:
    # torch's pipelining does not know fullshard's FSDPModule: every micro-batch's backward reduces on its own.
    losses, params = _train("1F1B", fullshard.fully_shard)
    ref_losses, ref_params = _reference(dp=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params, ref_params, rtol=1e-5, atol=1e-5)
    stage = fullshard.fully_shard(nn.Linear(2, 2))
    state = fullshard.fully_shard.state(stage)  # type: ignore[attr-defined]
    assert state is not None and len(state._fsdp_param_groups) == 1 and state._state_ctx.all_states == []
    assert fullshard.fully_shard.state(nn.Linear(2, 2)) is None  # type: ignore[attr-defined]


def test_fullshard_modules_without_the_swap() -> None:
    run_ranks(4, _without_swap)
