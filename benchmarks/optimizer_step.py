"""Optimizer step + gradient clipping, CPU time: fullshard.optim.AdamW against torch.optim.AdamW on FSDP2's DTensors.

Both models are sharded the same way (one group per block); fullshard's gradients are
the flat-buffer views its reduce-scatter delivers (one backward, then filled with the
same random values), FSDP2's are assigned. fullshard's steps
``fullshard.optim.AdamW`` with ``fullshard.clip_grad_norm_``, torch FSDP2's steps
``torch.optim.AdamW`` with ``torch.nn.utils.clip_grad_norm_(foreach=True)`` on its
DTensor parameters; with foreach kernels and with ``fused=True`` each. Gradients are filled with random values once; each
timed iteration clips and steps. The four alternate in rounds (the order rotating), in one process,
under torch's fake process group (``--ranks`` ranks; collectives return at once,
so this is the CPU work of one rank).

    python benchmarks/optimizer_step.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.gpt import GPT, GPTConfig


def bench_gpt() -> nn.Module:
    return GPT(GPTConfig(dim=256, n_heads=4, hidden=1024, n_layers=12, seq_len=128))


class Linears(nn.Module):
    """100 linear layers: 200 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def prepare(build: Callable[[], nn.Module], fully_shard: Callable[..., Any], optim_cls: type, mesh: Any,
            **optim_kwargs: Any) -> Any:
    torch.manual_seed(0)
    model = build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    if fully_shard is fullshard.fully_shard:
        # The gradients a backward delivers: views of each group's flat gradient buffer (the fake process group's
        # reduce-scatter leaves them unwritten); the values are filled in below.
        model(example_input(model)).float().sum().backward()
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        grad = torch.randn(local.shape, generator=gen) * 1e-2
        if p.grad is not None:
            p.grad.to_local().copy_(grad)
        else:
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    return model, optim_cls(model.parameters(), lr=1e-4, weight_decay=0.1, **optim_kwargs)


def example_input(model: nn.Module) -> torch.Tensor:
    if isinstance(model, GPT):
        return torch.randint(0, model.cfg.vocab_size, (1, 8))
    return torch.randn(2, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="iterations per implementation per round")
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,))
    print(f"fake process group, {args.ranks} ranks, rank 0's shards; median of {args.rounds} rounds x {args.steps} steps")
    print("| model | parameters | fullshard | FSDP2 | fullshard step+clip ms | FSDP2 step+clip ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for label, build in (("bench GPT (12 blocks, 9.58M)", bench_gpt), ("100 linear layers", Linears)):
        runs = {
            ("fullshard", kernels): (*prepare(build, fullshard.fully_shard, fullshard.optim.AdamW, mesh, **kwargs),
                                     fullshard.clip_grad_norm_)
            for kernels, kwargs in (("foreach", {}), ("fused", {"fused": True}))
        } | {
            ("torch-fsdp2", kernels): (*prepare(build, torch_fully_shard, torch.optim.AdamW, mesh, **kwargs),
                                       lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n, foreach=True))
            for kernels, kwargs in (("foreach", {"foreach": True}), ("fused", {"fused": True}))
        }
        times: dict[tuple[str, str], list[float]] = {name: [] for name in runs}
        for r in range(args.rounds + 1):
            order = list(runs.items())
            for name, (model, opt, clip) in order[r % len(order):] + order[:r % len(order)]:  # rotate the order
                start = time.perf_counter()
                for _ in range(args.steps):
                    clip(model, 1.0)
                    opt.step()
                if r:  # round 0 warms up (state creation)
                    times[name].append((time.perf_counter() - start) / args.steps)
        median = {name: statistics.median(t) for name, t in times.items()}
        n_params = len(list(runs["fullshard", "foreach"][0].parameters()))
        # Like for like, and the baseline (torch's AdamW with foreach kernels) against fullshard's fused.
        for ours, theirs in (("foreach", "foreach"), ("fused", "fused"), ("fused", "foreach")):
            a, b = median["fullshard", ours], median["torch-fsdp2", theirs]
            print(f"| {label} | {n_params} | {ours} | {theirs} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
