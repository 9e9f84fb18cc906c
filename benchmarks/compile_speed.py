"""Step time of the bench GPT sharded by fullshard: eager, compiled blocks (block.compile()), compiled whole model.

Same process, same data; compilation happens in the warm-up steps and is reported apart.

    python benchmarks/compile_speed.py [--world-size 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig, lm_loss


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim)
    results = {}
    for mode in ("eager", "compiled blocks", "compiled model"):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        for block in model.blocks:
            fully_shard(block)
            if mode == "compiled blocks":
                block.compile()
        fully_shard(model)
        if mode == "compiled model":
            model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        times, losses = [], []
        start_all = time.perf_counter()
        for step in range(args.warmup + args.steps):
            tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen).to(device)
            dist.barrier()
            start = time.perf_counter()
            loss = lm_loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == args.warmup - 1:
                warm = time.perf_counter() - start_all
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(loss.item())
        results[mode] = (statistics.median(times), warm, losses)
    if rank == 0:
        eager = results["eager"][0]
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}, batch {args.batch_size}x{cfg.seq_len}, world size {world_size}, "
              f"{device.type}, {args.steps} timed steps")
        print("| mode | step | vs eager | warm-up (compilation) | max loss diff vs eager |")
        print("|---|---|---|---|---|")
        for mode, (step_time, warm, losses) in results.items():
            diff = max(abs(a - b) for a, b in zip(losses, results["eager"][2]))
            print(f"| {mode} | {step_time * 1e3:.0f} ms | {step_time / eager:.3f}x | {warm:.1f} s | {diff:.1e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
