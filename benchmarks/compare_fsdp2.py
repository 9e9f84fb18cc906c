"""fullshard against torch.distributed.fsdp.fully_shard on a 12-block GPT, step by step in one run.

Both models are built from the same seed, sharded the same way (each block,
then the root) and trained on the same batches with AdamW. Steps alternate
between the two (ABBA order, so neither always runs first), every step starts
after a barrier, and a step's time is the slowest rank's. Prints the median
step time of each, their ratio (fullshard / torch; below 1.0 is faster), the
per-rank parameter bytes, and the largest loss difference as a sanity check.

    python benchmarks/compare_fsdp2.py                       # 2 local ranks (gloo on CPU)
    torchrun --nproc-per-node 2 benchmarks/compare_fsdp2.py  # one rank per GPU (NCCL)
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
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fullshard
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.runtime import state_of


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="local ranks to start when not under torchrun")
    p.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    return p.parse_args()


def shard(model: GPT, shard_fn: Callable[..., Any]) -> GPT:
    for block in model.blocks:
        shard_fn(block)
    shard_fn(model)
    return model


def param_bytes(model: nn.Module, is_fullshard: bool) -> int:
    """Bytes of parameter storage on this rank (fullshard: the flat shard buffers, padding included)."""
    if is_fullshard:
        states = {state_of(m) for m in model.modules()} - {None}
        return sum(s.group.flat_shard.numel() * s.group.flat_shard.element_size() for s in states if s and s.group)
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(dim=args.dim, n_heads=args.heads, hidden=4 * args.dim, n_layers=args.layers, seq_len=args.seq)
    runs: dict[str, dict[str, Any]] = {}
    for name, shard_fn in (("fullshard", fullshard.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = shard(GPT(cfg).to(device), shard_fn)
        runs[name] = {
            "model": model,
            "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "times": [],
            "losses": [],
            "peak": 0,
            "bytes": param_bytes(model, name == "fullshard"),
        }
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
        order = ["fullshard", "torch"] if step % 4 in (0, 3) else ["torch", "fullshard"]
        for name in order:
            run = runs[name]
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            start = time.perf_counter()
            loss = lm_loss(run["model"], tokens)
            loss.backward()
            run["opt"].step()
            run["opt"].zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
                run["peak"] = max(run["peak"], torch.cuda.max_memory_allocated())
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            run["losses"].append(loss.item())
            if step >= args.warmup:
                run["times"].append(elapsed.item())
    if rank == 0:
        report(runs, world_size, device, cfg, args)


def report(
    runs: dict[str, dict[str, Any]], world_size: int, device: torch.device, cfg: GPTConfig, args: argparse.Namespace
) -> None:
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT {cfg.n_layers} blocks, dim {cfg.dim}, {n_params / 1e6:.2f}M parameters, batch {args.batch}x{cfg.seq_len}, "
          f"world size {world_size}, {device.type}, {args.steps} timed steps each")
    print(f"{'':10s} {'median step ms':>15s} {'param bytes/rank':>17s} {'peak mem MiB':>13s}")
    medians = {}
    for name, run in runs.items():
        medians[name] = statistics.median(run["times"])
        peak = f"{run['peak'] / 2**20:.1f}" if run["peak"] else "n/a"
        print(f"{name:10s} {medians[name] * 1e3:15.1f} {run['bytes']:17d} {peak:>13s}")
    diff = max(abs(a - b) for a, b in zip(runs["fullshard"]["losses"], runs["torch"]["losses"]))
    print(f"step-time ratio fullshard/torch: {medians['fullshard'] / medians['torch']:.3f}")
    print(f"largest loss difference between the two: {diff:.2e}")


def main() -> None:
    args = parse_args()
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
