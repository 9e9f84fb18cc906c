"""What the always-on failure checks cost: step time of the 12-block GPT with and without them, same run.

The checks measured: recording each collective in the iteration's schedule (a CRC-32 update), the
divergence check at the end of each backward (one 16-byte all-gather on its own process group) and
the heartbeat thread. Steps alternate between "on" and "off" (the checks replaced by no-ops), so
both see the same machine load.

    python benchmarks/failure_checks.py [--world-size 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fullshard import failures, fully_shard
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig, lm_loss


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = (failures.issued, failures.check_schedule)
    off = (lambda kind, label, numel: 0, lambda group: None)
    times: dict[str, list[float]] = {"on": [], "off": []}
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.warmup + 2 * args.steps):
        mode = "on" if step % 2 == 0 else "off"
        failures.issued, failures.check_schedule = real if mode == "on" else off
        tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times[mode].append(elapsed.item())
    failures.issued, failures.check_schedule = real
    if rank == 0:
        on, off_ = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}, world size {world_size}, {device.type}, "
              f"{args.steps} steps each")
        print(f"step with checks {on * 1e3:.1f} ms, without {off_ * 1e3:.1f} ms: cost {on / off_ - 1:+.2%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    args = p.parse_args()
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
