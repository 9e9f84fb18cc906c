"""Runtime CPU overhead per training step: fullshard against torch's fully_shard, side by side in one run.

The model is a chain of small linear layers, one group each (plus the root's
head), so compute is negligible and the step time is mostly the runtime's own
work: hooks, state changes, collective calls, gradient bookkeeping. Overhead
is the median forward + backward time of the sharded model minus that of the
same model unwrapped, measured in rounds that alternate the three models; the
last columns leave out the time spent inside the collective calls themselves
(the fake backend's own cost, or gloo's issue cost), which both pay alike.

- ``--fake``: in one process, with torch's fake process group standing in for
  8, 64 and 512 ranks (collectives return at once; shapes are those of a real
  rank);
- otherwise: 2 local ranks with gloo (collectives included).

    python benchmarks/overhead.py                 # both, 8 / 48 / 200 groups
    python benchmarks/overhead.py --fake --ranks 64 --groups 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullshard
from fullshard.cli import launch

DIM = 16


def build(n_groups: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(n_groups)])  # n_groups - 1 layers + the root's last


def shard(model: nn.Module, fully_shard: Callable[..., Any], mesh: Any) -> nn.Module:
    for layer in list(model)[:-1]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    for p in model.parameters():
        p.grad = None


class CallTimer:
    """Seconds spent inside the collective calls (both implementations call them through ``dist``).

    With the fake process group these calls are the backend's own bookkeeping, which grows with the
    number of ranks and is the same for both implementations; the table also shows the overhead without it.
    """

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_reduce")

    def __init__(self) -> None:
        self.total = 0.0
        for name in self.NAMES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return call


def measure(n_groups: int, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each model (and in its collective calls), alternating them every round."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = {
        "plain": build(n_groups),
        "fullshard": shard(build(n_groups), fullshard.fully_shard, mesh),
        "torch-fsdp2": shard(build(n_groups), torch_fully_shard, mesh),
    }
    x = torch.randn(4, DIM)
    for model in models.values():
        for _ in range(3):
            step(model, x)
    timer = CallTimer()
    times: dict[str, list[float]] = {name: [] for name in models}
    in_calls: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models.items())
        order = order[r % len(order):] + order[: r % len(order)]
        for name, model in order:
            dist.barrier()
            start, calls = time.perf_counter(), timer.total
            for _ in range(steps):
                step(model, x)
            times[name].append((time.perf_counter() - start) / steps)
            in_calls[name].append((timer.total - calls) / steps)
    return {name: statistics.median(t) for name, t in times.items()} | {
        f"{name} calls": statistics.median(t) for name, t in in_calls.items()
    }


def fake_worker(world_size: int, n_groups: int, rounds: int, steps: int) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return measure(n_groups, rounds, steps)
    finally:
        dist.destroy_process_group()


def gloo_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    for n in args.groups:
        t = measure(n, args.rounds, args.steps)
        if rank == 0:
            print(row(f"{world_size} (gloo)", n, t), flush=True)


def row(label: str, groups: int, t: dict[str, float]) -> str:
    ours, theirs = t["fullshard"] - t["plain"], t["torch-fsdp2"] - t["plain"]
    ours_own, theirs_own = ours - t["fullshard calls"], theirs - t["torch-fsdp2 calls"]
    full = (f"| {label} | {groups} | {t['plain'] * 1e3:.2f} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | "
            f"{ours / groups * 1e6:.0f} | {theirs / groups * 1e6:.0f} | {ours / theirs:.2f} |")
    if "gloo" in label:  # FSDP2 waits inside gloo's calls (fullshard waits apart): only the full overhead compares
        return full + " | | |"
    return full + f" {ours_own / groups * 1e6:.0f} | {theirs_own / groups * 1e6:.0f} | {ours_own / theirs_own:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="only the fake process group runs")
    parser.add_argument("--gloo", action="store_true", help="only the 2-rank gloo run")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512], help="fake world sizes")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 48, 200])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per model per round")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)  # (world size, groups), one fake run
    args = parser.parse_args()
    if args.child:
        print(json.dumps(fake_worker(*args.child, args.rounds, args.steps)))
        return
    print("| ranks | groups | unwrapped step ms | fullshard overhead ms | FSDP2 overhead ms | "
          "fullshard us/group | FSDP2 us/group | ratio | fullshard us/group outside collective calls | "
          "FSDP2 us/group outside collective calls | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    if not args.fake:
        launch.run(gloo_worker, 2, args)
    if not args.gloo:
        for world_size in args.ranks:
            for n in args.groups:
                cmd = [sys.executable, __file__, "--child", str(world_size), str(n),
                       "--rounds", str(args.rounds), "--steps", str(args.steps)]
                t = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
                print(row(f"{world_size} (fake)", n, t), flush=True)


if __name__ == "__main__":
    main()
