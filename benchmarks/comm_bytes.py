"""Bytes on the wire per training step: fp32, bf16 (mixed precision) and QuantizedCommPolicy on the bench GPT.

Counts what each rank puts into the all-gathers and reduce-scatters of one step (forward, backward with
the blocks gathered again, reduction), by wrapping torch.distributed's single-tensor collectives, and
times the step. Ratios are against fp32 in the same run.

    python benchmarks/comm_bytes.py [--world-size 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import common
import torch
import torch.distributed as dist

from fullshard import MixedPrecisionPolicy, QuantizedCommPolicy
from fullshard.gpt import GPT, lm_loss

SETUPS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)},
    "int8 weights, bf16 grads": {"comm_policy": QuantizedCommPolicy()},
}


class Counter:
    def __init__(self) -> None:
        self.bytes = {"all-gather": 0, "reduce-scatter": 0}
        self._orig = (dist.all_gather_single, dist.reduce_scatter_single)
        dist.all_gather_single = self._ag  # type: ignore[assignment]
        dist.reduce_scatter_single = self._rs  # type: ignore[assignment]

    def _ag(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.bytes["all-gather"] += inp.numel() * inp.element_size()
        return self._orig[0](output, inp, **kwargs)

    def _rs(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.bytes["reduce-scatter"] += inp.numel() * inp.element_size()
        return self._orig[1](output, inp, **kwargs)

    def close(self) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self._orig  # type: ignore[assignment]


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dev, cfg = common.device(), common.config(args)
    rows = []
    for name, kwargs in SETUPS.items():
        model = common.sharded_gpt(cfg, dev, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        times, counted = [], None
        for step in range(args.steps + 1):
            tokens = common.tokens(cfg, args.batch_size, gen, dev)
            counter = Counter() if step == 1 else None

            def train_step() -> None:
                lm_loss(model, tokens).backward()
                opt.step()
                opt.zero_grad()

            elapsed = common.timed(train_step, dev)
            if step:
                times.append(elapsed)
            if counter is not None:
                counter.close()
                counted = counter.bytes
        assert counted is not None
        rows.append((name, counted, statistics.median(times)))
    if rank == 0:
        params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim} ({params / 1e6:.2f}M parameters), world size {world_size}, "
              f"{dev.type}; bytes each rank sends per step")
        print("| setup | all-gather | vs fp32 | reduce-scatter | vs fp32 | step |")
        print("|---|---|---|---|---|---|")
        base = rows[0][1]
        for name, counted, step_time in rows:
            ag, rs = counted["all-gather"], counted["reduce-scatter"]
            print(f"| {name} | {ag / 2**20:.2f} MiB | {ag / base['all-gather']:.3f}x | {rs / 2**20:.2f} MiB | "
                  f"{rs / base['reduce-scatter']:.3f}x | {step_time * 1e3:.0f} ms |")


def main() -> None:
    common.launch_workers(worker, common.parser(__doc__, steps=5, batch_size=4).parse_args())


if __name__ == "__main__":
    main()
