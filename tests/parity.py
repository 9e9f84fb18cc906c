"""The one training loop every parity test uses, and the comparison against the reference.

Parity: the same model, seed and data trained unsharded in one process (over
every rank's batch, losses averaged) and sharded across the ranks (each rank on
its own batch) give the same per-rank losses, the same full gradients before
every step and the same full parameters at the end. SGD with momentum is used
because, unlike Adam, it is not scale-invariant: a wrong gradient averaging
factor shows up at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.param import full_tensor

LossFn = Callable[[nn.Module, Any], torch.Tensor]


OptimFactory = Callable[[Any], torch.optim.Optimizer]


def sgd_momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@dataclass
class Trace:
    optim: torch.optim.Optimizer | None = None
    losses: list[Any] = field(default_factory=list)  # per step: 0-dim tensor (sharded) or list by rank (reference)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)  # full gradients before each step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full parameters after the last step


def full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor on CPU (also for CPU-offloaded shards of an accelerator mesh); float8 as float32, which holds
    every float8 value exactly and which assert_close compares with tolerances."""
    value = (full_tensor(t) if isinstance(t, DTensor) else t).cpu()
    return value.float() if value.is_floating_point() and value.element_size() == 1 else value


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full(p.grad).detach().clone() for n, p in model.named_parameters()}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def train(
    model: nn.Module,
    batches: list[list[Any]],
    loss_fn: LossFn,
    *,
    rank: int | None,
    set_to_none: bool = True,
    make_optim: OptimFactory = sgd_momentum,
    optim: torch.optim.Optimizer | None = None,
) -> Trace:
    """Train over ``batches[step][rank]`` (SGD with momentum unless ``make_optim`` / ``optim`` say otherwise).

    ``rank=None`` is the unsharded reference: each step it runs every rank's
    batch and back-propagates the mean of their losses.
    """
    opt = optim if optim is not None else make_optim(model.parameters())
    trace = Trace(optim=opt)
    for step_batches in batches:
        if rank is None:
            losses = [loss_fn(model, b) for b in step_batches]
            (sum(losses) / len(losses)).backward()
            trace.losses.append([loss.detach() for loss in losses])
        else:
            loss = loss_fn(model, step_batches[rank])
            loss.backward()
            trace.losses.append(loss.detach())
        trace.grads.append(full_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    trace.params = full_params(model)
    return trace


def assert_parity(ref: Trace, sharded: Trace, rank: int, **tol: float) -> None:
    for step, (ref_losses, loss) in enumerate(zip(ref.losses, sharded.losses, strict=True)):
        torch.testing.assert_close(loss, ref_losses[rank], msg=lambda m: f"rank {rank} step {step} loss: {m}", **tol)
        ref_grads, grads = ref.grads[step], sharded.grads[step]
        assert ref_grads.keys() == grads.keys(), f"step {step}: parameter names differ: {ref_grads.keys() ^ grads.keys()}"
        for name, ref_grad in ref_grads.items():
            grad = grads[name]
            assert (grad is None) == (ref_grad is None), f"step {step} {name}: grad is {grad} but reference has {ref_grad}"
            if grad is not None:
                torch.testing.assert_close(grad, ref_grad, msg=lambda m: f"step {step} grad {name}: {m}", **tol)
    for name, ref_param in ref.params.items():
        torch.testing.assert_close(sharded.params[name], ref_param, msg=lambda m: f"final param {name}: {m}", **tol)


def random_batches(steps: int, world_size: int, make: Callable[[torch.Generator], Any], seed: int = 1234) -> list[list[Any]]:
    """``batches[step][rank]``, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    return [[make(gen) for _ in range(world_size)] for _ in range(steps)]


def regression_batch(gen: torch.Generator, in_dim: int = 7, out_dim: int = 3, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, in_dim, generator=gen), torch.randn(rows, out_dim, generator=gen)


def token_batch(gen: torch.Generator, vocab: int = 37, seq: int = 9, rows: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq + 1), generator=gen)


def run_parity(
    rank: int,
    world_size: int,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    make_batch: Callable[[torch.Generator], Any],
    loss_fn: LossFn,
    steps: int = 5,
    set_to_none: bool = True,
    **tol: float,
) -> tuple[Trace, nn.Module]:
    """Build the model twice from one seed, shard one copy, train both and assert parity."""
    torch.manual_seed(0)
    ref = build()
    torch.manual_seed(0)
    model = build()
    shard(model)
    batches = random_batches(steps, world_size, make_batch)
    ref_trace = train(ref, batches, loss_fn, rank=None, set_to_none=set_to_none)
    trace = train(model, batches, loss_fn, rank=rank, set_to_none=set_to_none)
    assert_parity(ref_trace, trace, rank, **tol)
    return trace, model
