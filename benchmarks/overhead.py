"""Runtime CPU overhead per training step: fullshard against torch's fully_shard, side by side in one run.

Two models (``--model``, both by default), one group per layer or block plus
the root's, so compute is small and the step time is mostly the runtime's own
work: hooks, state changes, collective calls, gradient bookkeeping.

- ``chain``: a chain of 16x16 linear layers (``--groups``), the last one the
  root's; the step is forward + backward, then every gradient set to ``None``.
- ``blocks``: real transformer blocks (``--blocks``; ``fullshard.gpt.Block`` at
  width 64, MLP 256, 4 heads, 2 sequences of 8 tokens: pre-norm attention with
  qkv and output projections and a GELU MLP, 12 parameters each: two LayerNorms,
  four linear layers, weights and biases) and a final LayerNorm, the root's. Every
  group, the root's included, has ``reshard_after_forward=True``. The step is the
  whole training step: forward, backward, ``optimizer.step()``, ``zero_grad()``,
  once per optimizer column (``--optimizers``):

  - ``adamw``: ``torch.optim.AdamW()`` with its defaults for every model (on CPU
    torch's default is the per-tensor loop, as ``foreach=False``: torch takes
    foreach kernels by default only on accelerators);
  - ``adamw-loop``: ``torch.optim.AdamW(foreach=False)`` for every model;
  - ``fullshard-adamw``: ``fullshard.optim.AdamW(foreach=True)`` for fullshard
    (and its unwrapped model), torch's ``AdamW()`` for FSDP2 (and its own). On
    the unwrapped model it steps every parameter (foreach kernels on CPU loop over
    the tensors), on fullshard one flat buffer per group, which is faster: that
    column's fullshard overhead is the runtime's cost less the optimizer's gain.

Overhead is the median step time of a sharded model minus that of the same
model unwrapped with the same optimizer, measured in rounds that alternate
every model (fullshard, FSDP2 and the unwrapped ones) in one process; the last
columns leave out the time spent inside the collective calls themselves (the
fake backend's own cost, or gloo's issue cost), which both pay alike.

Python's cyclic garbage collector is run before every timed run, and everything
built before the rounds (every model, its optimizer state, the warm-up's
caches) is frozen out of its passes (``gc.freeze()``): otherwise a full pass over
the half a million objects of the three models (about 160 ms at 200 blocks)
lands on whichever model happens to be running then, and moves one model's
median by 10-20% from one process to the next.

- ``--fake``: in one process, with torch's fake process group standing in for
  8, 64 and 512 ranks (collectives return at once; shapes are those of a real
  rank);
- ``--gloo``: 2 local ranks with gloo (collectives included);
- neither: both. Every rank runs one thread.

    python benchmarks/overhead.py                                 # both models, gloo and fake, 8 / 48 / 200
    python benchmarks/overhead.py --model chain --fake --ranks 64 --groups 48
    python benchmarks/overhead.py --model blocks --fake --ranks 64 --blocks 48 --optimizers adamw
    python benchmarks/overhead.py --profile fullshard --ranks 64 --blocks 48 --optimizers adamw
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullshard
import fullshard.optim
from fullshard.cli import launch
from fullshard.gpt import Block, GPTConfig

DIM = 16  # the chain's layers
BLOCK = GPTConfig(dim=64, hidden=256, n_heads=4, seq_len=8)  # the blocks model's width, MLP, heads and tokens
BATCH = 2  # sequences per step of the blocks model

MODELS = ("chain", "blocks")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "torch AdamW()": lambda params: torch.optim.AdamW(params),
    "torch AdamW(foreach=False)": lambda params: torch.optim.AdamW(params, foreach=False),
    "fullshard AdamW(foreach=True)": lambda params: fullshard.optim.AdamW(params, foreach=True),
}
# Optimizer column: (fullshard's optimizer, FSDP2's); each implementation's unwrapped model takes its optimizer.
COLUMNS: dict[str, tuple[str, str]] = {
    "adamw": ("torch AdamW()", "torch AdamW()"),
    "adamw-loop": ("torch AdamW(foreach=False)", "torch AdamW(foreach=False)"),
    "fullshard-adamw": ("fullshard AdamW(foreach=True)", "torch AdamW()"),
}


def build(n_groups: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(n_groups)])  # n_groups - 1 layers + the root's last


def shard(model: nn.Sequential, fully_shard: Callable[..., Any], mesh: Any) -> nn.Sequential:
    for layer in list(model)[:-1]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    for p in model.parameters():
        p.grad = None


class Blocks(nn.Module):
    """``n_blocks`` transformer blocks (12 parameters each) and a final LayerNorm: ``12 * n_blocks + 2`` parameters."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(BLOCK) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(BLOCK.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def sharded_blocks(n_blocks: int, fully_shard: Callable[..., Any] | None, mesh: Any) -> Blocks:
    """The blocks model (seed 0), one group per block and the root's, all resharded after forward."""
    torch.manual_seed(0)
    model = Blocks(n_blocks)
    if fully_shard is not None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor
) -> tuple[float, float, float, float]:
    """One step; seconds of its forward, backward, ``optimizer.step()`` and ``zero_grad()``."""
    start = time.perf_counter()
    loss = (model(x) - target).square().mean()
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    stepped = time.perf_counter()
    optimizer.zero_grad()
    return forward - start, backward - forward, stepped - backward, time.perf_counter() - stepped


def runs_needed(columns: list[str]) -> list[tuple[str, str]]:
    """(implementation, optimizer) of every model the blocks ``columns`` compare, each once, in column order."""
    needed: list[tuple[str, str]] = []
    for column in columns:
        ours, theirs = COLUMNS[column]
        for run in (("plain", ours), ("fullshard", ours), ("plain", theirs), ("torch-fsdp2", theirs)):
            if run not in needed:
                needed.append(run)
    return needed


def key(implementation: str, optimizer: str) -> str:
    return f"{implementation} / {optimizer}"


class CallTimer:
    """Seconds spent inside the collective calls (both implementations call them through ``dist``).

    With the fake process group these calls are the backend's own bookkeeping, which grows with the
    number of ranks and is the same for both implementations; the table also shows the overhead without it.
    """

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_reduce")

    def __init__(self) -> None:
        self.total = 0.0
        self._originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._originals.items():
            setattr(dist, name, self._timed(fn))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return call

    def restore(self) -> None:
        """Put ``dist``'s own functions back (a process measures several model sizes)."""
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


def chain_steps(n_groups: int, mesh: Any) -> dict[str, Callable[[], Any]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    x = torch.randn(4, DIM)
    models = {
        "plain": build(n_groups),
        "fullshard": shard(build(n_groups), fullshard.fully_shard, mesh),
        "torch-fsdp2": shard(build(n_groups), torch_fully_shard, mesh),
    }
    return {name: functools.partial(step, model, x) for name, model in models.items()}


def blocks_steps(n_blocks: int, mesh: Any, columns: list[str]) -> dict[str, Callable[[], Any]]:
    """One training step of every model the ``columns`` compare, by ``key``; each returns its phase times."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    implementations = {"plain": None, "fullshard": fullshard.fully_shard, "torch-fsdp2": torch_fully_shard}
    x, target = torch.randn(BATCH, BLOCK.seq_len, BLOCK.dim), torch.randn(BATCH, BLOCK.seq_len, BLOCK.dim)
    steps: dict[str, Callable[[], Any]] = {}
    for implementation, optimizer in runs_needed(columns):
        model = sharded_blocks(n_blocks, implementations[implementation], mesh)
        opt = OPTIMIZERS[optimizer](model.parameters())
        steps[key(implementation, optimizer)] = functools.partial(training_step, model, opt, x, target)
    return steps


def measure(model: str, size: int, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per step of each model (and in its collective calls), alternating them every round."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps = chain_steps(size, mesh) if model == "chain" else blocks_steps(size, mesh, args.optimizers)
    for run in steps.values():
        for _ in range(3):
            run()
    gc.collect()
    gc.freeze()
    timer = CallTimer()
    n_steps = steps_per_round(model, args)
    times: dict[str, list[float]] = {name: [] for name in steps}
    in_calls: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for r in range(args.rounds):
            order = list(steps.items())
            order = order[r % len(order):] + order[: r % len(order)]
            for name, run in order:
                gc.collect()
                dist.barrier()
                start, calls = time.perf_counter(), timer.total
                for _ in range(n_steps):
                    run()
                times[name].append((time.perf_counter() - start) / n_steps)
                in_calls[name].append((timer.total - calls) / n_steps)
    finally:
        timer.restore()
        gc.unfreeze()
    return {name: statistics.median(t) for name, t in times.items()} | {
        f"{name} calls": statistics.median(t) for name, t in in_calls.items()
    }


def steps_per_round(model: str, args: argparse.Namespace) -> int:
    if args.steps is not None:
        return int(args.steps)
    return 10 if model == "chain" else 5  # torch's AdamW on DTensors: 0.7-1.3 s per step at 200 blocks


def fake_worker(world_size: int, model: str, size: int, args: argparse.Namespace) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return measure(model, size, args)
    finally:
        dist.destroy_process_group()


def gloo_worker(rank: int, world_size: int, args: argparse.Namespace, model: str) -> None:
    torch.set_num_threads(1)
    for size in sizes(model, args):
        t = measure(model, size, args)
        if rank == 0:
            print("\n".join(rows(model, f"{world_size} (gloo)", size, t, args)), flush=True)


def sizes(model: str, args: argparse.Namespace) -> list[int]:
    return list(args.groups if model == "chain" else args.blocks)


def overheads(label: str, groups: int, t: dict[str, float], ours: tuple[str, str], theirs: tuple[str, str]) -> str:
    """Columns from the overhead on: (sharded, unwrapped) keys of fullshard's and FSDP2's models in ``t``."""
    ours_ms, theirs_ms = t[ours[0]] - t[ours[1]], t[theirs[0]] - t[theirs[1]]
    cells = (f"{ours_ms * 1e3:.2f} | {theirs_ms * 1e3:.2f} | "
             f"{ours_ms / groups * 1e6:.0f} | {theirs_ms / groups * 1e6:.0f} | {ours_ms / theirs_ms:.2f} |")
    if "gloo" in label:  # FSDP2 waits inside gloo's calls (fullshard waits apart): only the full overhead compares
        return cells + " | | |"
    ours_own, theirs_own = ours_ms - t[f"{ours[0]} calls"], theirs_ms - t[f"{theirs[0]} calls"]
    return cells + f" {ours_own / groups * 1e6:.0f} | {theirs_own / groups * 1e6:.0f} | {ours_own / theirs_own:.2f} |"


def header(model: str) -> str:
    tail = ("fullshard overhead ms | FSDP2 overhead ms | fullshard us/group | FSDP2 us/group | ratio | "
            "fullshard us/group outside collective calls | FSDP2 us/group outside collective calls | ratio |")
    if model == "chain":
        return "| ranks | groups | unwrapped step ms | " + tail + "\n" + "|---" * 11 + "|"
    return ("| ranks | blocks | groups | parameters | optimizer | unwrapped step ms (fullshard's optimizer; FSDP2's) | "
            "fullshard step ms | FSDP2 step ms | " + tail + "\n" + "|---" * 16 + "|")


def rows(model: str, label: str, size: int, t: dict[str, float], args: argparse.Namespace) -> list[str]:
    if model == "chain":
        return [f"| {label} | {size} | {t['plain'] * 1e3:.2f} | "
                + overheads(label, size, t, ("fullshard", "plain"), ("torch-fsdp2", "plain"))]
    out = []
    for column in args.optimizers:
        ours, theirs = COLUMNS[column]
        ours_keys, theirs_keys = (key("fullshard", ours), key("plain", ours)), (key("torch-fsdp2", theirs), key("plain", theirs))
        name = ours if ours == theirs else f"{ours}; FSDP2: {theirs}"
        plain = f"{t[ours_keys[1]] * 1e3:.2f}" + ("" if ours == theirs else f"; {t[theirs_keys[1]] * 1e3:.2f}")
        out.append(f"| {label} | {size} | {size + 1} | {12 * size + 2} | {name} | {plain} | "
                   f"{t[ours_keys[0]] * 1e3:.2f} | {t[theirs_keys[0]] * 1e3:.2f} | "
                   + overheads(label, size + 1, t, ours_keys, theirs_keys))
    return out


def profile(args: argparse.Namespace) -> None:
    """One blocks configuration on the fake group (the first of ``--ranks``, ``--blocks`` and ``--optimizers``):
    median phase times of every model it compares, then cProfile of ``--profile``'s steps, by own and by
    cumulative time. cProfile's own cost per Python call inflates the times; read them as shares."""
    import cProfile
    import pstats

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size, n_blocks, column = args.ranks[0], args.blocks[0], args.optimizers[0]
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        steps = blocks_steps(n_blocks, init_device_mesh("cpu", (world_size,)), [column])
        for run in steps.values():
            for _ in range(3):
                run()
        phases: dict[str, list[tuple[float, ...]]] = {name: [] for name in steps}
        for _ in range(steps_per_round("blocks", args) * args.rounds):
            for name, run in steps.items():
                phases[name].append(run())
        print(f"{world_size} fake ranks, {n_blocks} blocks ({n_blocks + 1} groups, {12 * n_blocks + 2} parameters), "
              f"median ms of {steps_per_round('blocks', args) * args.rounds} steps each\n")
        print("| model | forward | backward | optimizer.step | zero_grad | step |\n|---|---|---|---|---|---|")
        for name, times in phases.items():
            medians = [statistics.median(phase) * 1e3 for phase in zip(*times)]
            print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {sum(medians):.2f} |")
        ours, theirs = COLUMNS[column]
        name = key(args.profile, ours if args.profile == "fullshard" else theirs)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps_per_round("blocks", args)):
            steps[name]()
        profiler.disable()
        for order in ("tottime", "cumulative"):
            print(f"\ncProfile of {name}, {steps_per_round('blocks', args)} steps, by {order}:")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(args.profile_lines)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=(*MODELS, "both"), default="both", help="which model (default both)")
    parser.add_argument("--fake", action="store_true", help="only the fake process group runs")
    parser.add_argument("--gloo", action="store_true", help="only the 2-rank gloo run")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512], help="fake world sizes")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 48, 200], help="chain: groups")
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 48, 200], help="blocks model: blocks")
    parser.add_argument("--optimizers", nargs="+", choices=list(COLUMNS), default=list(COLUMNS),
                        help="blocks model: optimizer columns")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, help="steps per model per round (default 10 for chain, 5 for blocks)")
    parser.add_argument("--profile", choices=("fullshard", "torch-fsdp2"),
                        help="instead of the tables: phase times and cProfile of one blocks configuration (fake group)")
    parser.add_argument("--profile-lines", type=int, default=40, help="functions listed per cProfile order")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # (world size, model, size): one fake run
    args = parser.parse_args()
    if args.profile:
        profile(args)
        return
    if args.child:
        world_size, model, size = args.child
        print(json.dumps(fake_worker(int(world_size), model, int(size), args)))
        return
    for model in MODELS if args.model == "both" else (args.model,):
        print(header(model), flush=True)
        if not args.fake:
            launch.run(gloo_worker, 2, args, model)
        if not args.gloo:
            for world_size in args.ranks:
                for size in sizes(model, args):
                    cmd = [sys.executable, __file__, "--child", str(world_size), model, str(size),
                           "--rounds", str(args.rounds), "--optimizers", *args.optimizers]
                    if args.steps is not None:
                        cmd += ["--steps", str(args.steps)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                    print("\n".join(rows(model, f"{world_size} (fake)", size, json.loads(out.splitlines()[-1]), args)),
                          flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
