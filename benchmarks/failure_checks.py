"""What the always-on failure checks cost: step time of the 12-block GPT with and without them, same run.

The checks measured: recording each collective in its group's list (a CRC-32 update and a look at the
known lists; a comparison before the collectives of the first iteration), the divergence check at the
end of each backward (one 24-byte-per-rank all-gather per group on a gloo backend of its own) and the
heartbeat thread. Steps alternate between "on" and "off" (the checks replaced by no-ops), so both see
the same machine load. Also counted over the "on" steps: comparisons (host round trips) per step, and
keys added to the process group's store.

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
    monitor = failures.Monitor
    real = (monitor.issued, monitor.end_backward, monitor.root_forward)
    off = (lambda self, kind, label, numel, group: None, lambda self: None, lambda self: None)
    compare, round_trips = monitor._compare, [0]

    def counted(self: failures.Monitor, *args: object) -> None:
        round_trips[0] += 1
        compare(self, *args)  # type: ignore[arg-type]

    monitor._compare = counted  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"on": [], "off": []}
    gen = torch.Generator().manual_seed(rank)
    store = torch.distributed.distributed_c10d._get_default_store()
    keys = []
    for step in range(args.warmup + 2 * args.steps):
        mode = "on" if step % 2 == 0 else "off"
        monitor.issued, monitor.end_backward, monitor.root_forward = real if mode == "on" else off  # type: ignore
        tokens = common.tokens(cfg, args.batch_size, gen, dev)

        def train_step() -> None:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()

        elapsed = common.slowest(common.timed(train_step, dev), dev)
        if step >= args.warmup:
            times[mode].append(elapsed)
        if step == args.warmup:
            round_trips[0], keys = 0, [store.num_keys()]
    keys.append(store.num_keys())
    monitor.issued, monitor.end_backward, monitor.root_forward = real  # type: ignore
    monitor._compare = compare  # type: ignore[method-assign]
    if rank == 0:
        on, off_ = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}, world size {world_size}, {dev.type}, "
              f"{args.steps} steps each")
        print(f"step with checks {on * 1e3:.1f} ms, without {off_ * 1e3:.1f} ms: cost {on / off_ - 1:+.2%}")
        steps_on = args.steps - 1  # the "on" steps after the warm-up step where counting started
        print(f"comparisons (host round trips) per step: {round_trips[0] / steps_on:.2f}; store keys added over "
              f"{steps_on} steps: {keys[1] - keys[0]}")


def main() -> None:
    common.launch_workers(worker, common.parser(__doc__, steps=20, warmup=4, batch_size=4).parse_args())


if __name__ == "__main__":
    main()
