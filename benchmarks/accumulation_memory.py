"""Parameter and gradient memory of gradient accumulation, with and without resharding after backward.

Trains the 12-block GPT for one optimizer step of ``--micro-batches``
micro-batches: every micro-batch but the last runs without gradient sync
(``set_requires_gradient_sync(False)``), once with parameters resharded after
each backward and once kept unsharded (``set_reshard_after_backward(False)``).
Measured on rank 0 at every module boundary: the bytes fullshard holds in
unsharded parameters and unsharded gradients (activations are not counted; on
CUDA the allocator's peak is printed too). Also counts the all-gathers.

    python benchmarks/accumulation_memory.py
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import fullshard
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.runtime import state_of


def held_bytes(model: GPT) -> int:
    total = 0
    for module in model.modules():
        state = state_of(module)
        if state is None or state.group is None or module is not state.modules[0]:
            continue
        total += state.group.unsharded_buffer.untyped_storage().nbytes()
        for p in state.group.params:
            for grad in (p.unsharded.grad, p.accumulated_grad):
                total += 0 if grad is None else grad.numel() * grad.element_size()
    return total


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim)
    results: dict[str, dict[str, Any]] = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        for block in model.blocks:
            fullshard.fully_shard(block)
        fullshard.fully_shard(model)
        peak = 0

        def sample(*_: Any) -> None:
            nonlocal peak
            peak = max(peak, held_bytes(model))

        for block in model.blocks:
            block.register_forward_pre_hook(sample)
            block.register_forward_hook(sample)
            block.register_full_backward_hook(sample)
        gathers = 0
        original = dist.all_gather_single

        def counting(*a: Any, **k: Any) -> Any:
            nonlocal gathers
            gathers += 1
            return original(*a, **k)

        dist.all_gather_single = counting  # type: ignore[assignment]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        gen = torch.Generator().manual_seed(rank)
        between = []
        for micro in range(args.micro_batches):
            last = micro == args.micro_batches - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(reshard or last)
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).to(device)
            lm_loss(model, tokens).backward()
            sample()
            between.append(held_bytes(model))
        dist.all_gather_single = original  # type: ignore[assignment]
        results["reshard" if reshard else "keep unsharded"] = {
            "peak": peak,
            "between": max(between[:-1]),
            "gathers": gathers,
            "device_peak": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        }
    if rank == 0:
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {cfg.n_layers} blocks, {n_params / 1e6:.2f}M parameters, world size {world_size}, "
              f"{args.micro_batches} micro-batches of {args.batch}x{cfg.seq_len}")
        print(f"{'':16s} {'peak param+grad MiB':>20s} {'held between MiB':>17s} {'all-gathers':>12s} {'device peak MiB':>16s}")
        for name, r in results.items():
            dev = f"{r['device_peak'] / 2**20:.1f}" if r["device_peak"] else "n/a"
            print(f"{name:16s} {r['peak'] / 2**20:20.1f} {r['between'] / 2**20:17.1f} {r['gathers']:12d} {dev:>16s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
