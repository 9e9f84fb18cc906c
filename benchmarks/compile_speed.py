"""Step time of the bench GPT sharded by fullshard: eager, compiled blocks (block.compile()), compiled whole model.

Same process, same data; compilation happens in the warm-up steps and is reported apart.

    python benchmarks/compile_speed.py [--world-size 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

from fullshard.gpt import lm_loss


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dev, cfg = common.device(), common.config(args)
    results = {}
    for mode in ("eager", "compiled blocks", "compiled model"):
        model = common.sharded_gpt(cfg, dev, (lambda block: block.compile()) if mode == "compiled blocks" else None)
        if mode == "compiled model":
            model.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        times, losses = [], []
        start_all = time.perf_counter()
        for step in range(args.warmup + args.steps):
            tokens = common.tokens(cfg, args.batch_size, gen, dev)

            def train_step() -> None:
                loss = lm_loss(model, tokens)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())

            elapsed = common.timed(train_step, dev)
            if step == args.warmup - 1:
                warm = time.perf_counter() - start_all
            if step >= args.warmup:
                times.append(elapsed)
        results[mode] = (statistics.median(times), warm, losses)
    if rank == 0:
        eager = results["eager"][0]
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}, batch {args.batch_size}x{cfg.seq_len}, world size {world_size}, "
              f"{dev.type}, {args.steps} timed steps")
        print("| mode | step | vs eager | warm-up (compilation) | max loss diff vs eager |")
        print("|---|---|---|---|---|")
        for mode, (step_time, warm, losses) in results.items():
            diff = max(abs(a - b) for a, b in zip(losses, results["eager"][2]))
            print(f"| {mode} | {step_time * 1e3:.0f} ms | {step_time / eager:.3f}x | {warm:.1f} s | {diff:.1e} |")


def main() -> None:
    common.launch_workers(worker, common.parser(__doc__, steps=10, warmup=3, batch_size=4).parse_args())


if __name__ == "__main__":
    main()
