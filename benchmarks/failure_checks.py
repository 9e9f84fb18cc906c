"""What the always-on failure checks cost: step time of the 12-block GPT with and without them, same run.

The checks measured: recording each collective in the iteration's schedule (a CRC-32 update and a look at the
verified schedule; a comparison before the collectives of the first iteration), the
divergence check at the end of each backward (one 24-byte all-gather on its own process group) and
the heartbeat thread. Steps alternate between "on" and "off" (the checks replaced by no-ops), so
both see the same machine load.

    python benchmarks/failure_checks.py [--world-size 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics

import common
import torch

from fullshard import failures
from fullshard.gpt import lm_loss


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dev, cfg = common.device(), common.config(args)
    model = common.sharded_gpt(cfg, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = (failures.issued, failures.check_schedule)
    off = (lambda kind, label, numel, group=None: 0, lambda group: None)
    times: dict[str, list[float]] = {"on": [], "off": []}
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.warmup + 2 * args.steps):
        mode = "on" if step % 2 == 0 else "off"
        failures.issued, failures.check_schedule = real if mode == "on" else off
        tokens = common.tokens(cfg, args.batch_size, gen, dev)

        def train_step() -> None:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()

        elapsed = common.slowest(common.timed(train_step, dev), dev)
        if step >= args.warmup:
            times[mode].append(elapsed)
    failures.issued, failures.check_schedule = real
    if rank == 0:
        on, off_ = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}, world size {world_size}, {dev.type}, "
              f"{args.steps} steps each")
        print(f"step with checks {on * 1e3:.1f} ms, without {off_ * 1e3:.1f} ms: cost {on / off_ - 1:+.2%}")


def main() -> None:
    common.launch_workers(worker, common.parser(__doc__, steps=20, warmup=4, batch_size=4).parse_args())


if __name__ == "__main__":
    main()
