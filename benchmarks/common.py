"""What the multi-process bench-GPT benchmarks share: arguments, launch, the sharded model, a timed step.

Imported by the scripts next to it (``python benchmarks/<script>.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard import fully_shard
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig


def parser(doc: str | None, *, world_size: int = 2, steps: int | None = None, warmup: int | None = None,
           batch_size: int | None = None) -> argparse.ArgumentParser:
    """``--world-size --layers --dim`` and, where given a default, ``--steps --warmup --batch-size``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=world_size)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    for flag, default in (("--steps", steps), ("--warmup", warmup), ("--batch-size", batch_size)):
        if default is not None:
            p.add_argument(flag, type=int, default=default)
    return p


def launch_workers(worker: Callable[[int, int, argparse.Namespace], None], args: argparse.Namespace) -> None:
    """``worker(rank, world_size, args)`` on ``args.world_size`` local ranks (NCCL when CUDA is there)."""
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim)


def sharded_gpt(cfg: GPTConfig, dev: torch.device, shard_block: Callable[[nn.Module], Any] | None = None,
                **kwargs: Any) -> GPT:
    """The GPT (seed 0) on ``dev``, one group per block and one for the rest; ``shard_block`` runs after each block's."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    for block in model.blocks:
        fully_shard(block, **kwargs)
        if shard_block is not None:
            shard_block(block)
    fully_shard(model, **kwargs)
    return model


def tokens(cfg: GPTConfig, batch_size: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen).to(dev)


def timed(fn: Callable[[], Any], dev: torch.device, *, after_barrier: bool = False) -> float:
    """Seconds ``fn()`` takes on this rank, started together on every rank (device work included)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if after_barrier:
        dist.barrier()
    return time.perf_counter() - start


def slowest(seconds: float, dev: torch.device) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor(seconds, device=dev)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()
