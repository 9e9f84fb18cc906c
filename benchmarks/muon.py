"""Muon on a sharded model: fullshard's owner-rank Muon against gathering every matrix everywhere, and AdamW.

Times the optimizer step (after the same backward) and counts the bytes each rank sends in it, on the
bench GPT's block matrices (Muon's domain; embeddings, head, norms and biases are left out of all three).

- fullshard.optim.Muon: rows to one owner per matrix and back (two all-to-alls), Newton-Schulz once.
- naive: all-gather each full update on every rank (DTensor.full_tensor), Newton-Schulz on every rank.
- fullshard.optim.AdamW: the elementwise baseline (no communication).

    python benchmarks/muon.py [--world-size 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import common
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import fullshard
from fullshard.gpt import lm_loss


class NaiveMuon(torch.optim.Muon):
    """What people do without owner ranks: the whole update on every rank, orthogonalised everywhere."""

    sent = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p.grad))
                grad, local_buf = p.grad.to_local(), buf.to_local()
                local_buf.lerp_(grad, 1 - group["momentum"])
                update = DTensor.from_local(grad.lerp(local_buf, group["momentum"]), p.device_mesh, p.placements,
                                            shape=p.shape, stride=p.stride())
                full = update.full_tensor()  # a functional all-gather: counted here, not by `Sent`
                self.sent += grad.numel() * grad.element_size() * (dist.get_world_size() - 1)
                ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
                rows = p.to_local().shape[0]
                start = dist.get_rank() * -(-p.shape[0] // dist.get_world_size())
                local = p.to_local()
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho.narrow(0, min(start, p.shape[0]), rows), alpha=-_adjust_lr(group["lr"], None, p.shape))


class Sent:
    def __init__(self) -> None:
        self.bytes = 0
        self._orig = (dist.all_to_all_single, dist.all_gather_single, dist.all_gather_into_tensor)
        dist.all_to_all_single = self._a2a  # type: ignore[assignment]
        dist.all_gather_single = self._ag  # type: ignore[assignment]
        dist.all_gather_into_tensor = self._ag_old  # type: ignore[assignment]

    def _a2a(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any = None, input_split_sizes: Any = None,
             **kwargs: Any) -> Any:
        mine = input_split_sizes[dist.get_rank(kwargs.get("group"))] if input_split_sizes else 0
        self.bytes += (inp.numel() - mine) * inp.element_size()  # what leaves this rank
        return self._orig[0](output, inp, output_split_sizes, input_split_sizes, **kwargs)

    def _ag(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.bytes += inp.numel() * inp.element_size() * (dist.get_world_size(kwargs.get("group")) - 1)
        return self._orig[1](output, inp, **kwargs)

    def _ag_old(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.bytes += inp.numel() * inp.element_size() * (dist.get_world_size(kwargs.get("group")) - 1)
        return self._orig[2](output, inp, **kwargs)

    def close(self) -> None:
        dist.all_to_all_single, dist.all_gather_single, dist.all_gather_into_tensor = self._orig  # type: ignore[assignment]


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dev, cfg = common.device(), common.config(args)
    results = {}
    for name in ("fullshard.optim.Muon", "naive Muon", "fullshard.optim.AdamW"):
        model = common.sharded_gpt(cfg, dev)
        matrices = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
        opt: torch.optim.Optimizer
        if name == "fullshard.optim.Muon":
            opt = fullshard.optim.Muon(matrices, lr=0.02)
        elif name == "naive Muon":
            opt = NaiveMuon(matrices, lr=0.02)
        else:
            opt = fullshard.optim.AdamW(matrices, lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        times, sent = [], 0
        for step in range(args.steps + 1):
            lm_loss(model, common.tokens(cfg, args.batch_size, gen, dev)).backward()
            counter = Sent()
            elapsed = common.timed(opt.step, dev)
            counter.close()
            opt.zero_grad()
            if step:
                times.append(elapsed)
                sent = counter.bytes + getattr(opt, "sent", 0)
            if isinstance(opt, NaiveMuon):
                opt.sent = 0
        total = torch.tensor(float(sent), device=dev)
        dist.all_reduce(total)
        results[name] = (statistics.median(times), sent, total.item())
        grad_bytes = sum(p.numel() * 4 for p in matrices)
    if rank == 0:
        print(f"GPT {cfg.n_layers} blocks, width {cfg.dim}: {len(matrices)} block matrices, {grad_bytes / 2**20:.2f} MiB of "
              f"fp32 gradients; world size {world_size}, {dev.type}; optimizer step only")
        print("| optimizer | step | vs fullshard Muon | sent per step: rank 0 | all ranks | all ranks vs gradient bytes |")
        print("|---|---|---|---|---|---|")
        base = results["fullshard.optim.Muon"][0]
        for name, (step_time, sent, total) in results.items():
            print(f"| {name} | {step_time * 1e3:.1f} ms | {step_time / base:.2f}x | {sent / 2**20:.2f} MiB | "
                  f"{total / 2**20:.2f} MiB | {total / grad_bytes:.2f}x |")


def main() -> None:
    common.launch_workers(worker, common.parser(__doc__, world_size=4, steps=5, batch_size=2).parse_args())


if __name__ == "__main__":
    main()
