"""``fullshard bench``: fullshard against torch's ``fully_shard`` (FSDP2) and DDP, step by step in one run.

The three copies of one GPT (same seed) train on the same batches with AdamW.
Steps rotate through the implementations so none always runs first; every
step starts after a barrier and its time is the slowest rank's. Reported per
implementation: median step time and its ratio to fullshard's, training state
(parameters + gradients + optimizer state) per rank, peak device memory (CUDA
only: what the implementation keeps between steps, measured as allocator deltas
when it is built and across its first step, plus the largest rise of allocated
memory within one of its steps, so the other models living beside it are left
out), and bytes each rank sends per step. Bytes are counted from the
collectives' sizes with ring-algorithm costs: an all-gather or reduce-scatter
of N bytes moves N(W-1)/W per rank, an all-reduce twice that.

``--simulate-ranks N`` runs one rank of an N-rank job in this process instead,
torch's fake process group standing in for the other ranks: its collectives
send nothing (every rank is taken to hold this rank's data), so the times leave
the wire out while the shards, buffers and copies are those of a rank at world
size N. The fake group ignores the ``AVG`` FSDP2 asks of it, so FSDP2's gradients
come out N times fullshard's and its losses differ a little (AdamW is nearly
scale-invariant). ``benchmarks/simulate_ranks.py`` does the same with mixed
precision, larger models and a profile of where the time goes.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

from fullshard.api import fully_shard
from fullshard.cli import launch
from fullshard.cli.train import state_bytes
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.policy import MixedPrecisionPolicy

IMPLEMENTATIONS = ("fullshard", "torch-fsdp2", "ddp")


class ByteCounter:
    """Adds up what each rank sends for the collectives issued through ``torch.distributed``."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")

    def __init__(self) -> None:
        self.bytes = 0.0
        self._originals = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        for name, fn in self._originals.items():
            setattr(dist, name, self._counting(name, fn))

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            tensor = _payload(name, args, kwargs)
            nbytes = tensor.numel() * tensor.element_size() * (world - 1) / world
            self.bytes += 2 * nbytes if name == "all_reduce" else nbytes
            return fn(*args, **kwargs)

        return wrapper

    def ddp_hook(self) -> Callable[..., Any]:
        """A DDP comm hook that all-reduces each bucket through ``dist.all_reduce``, where it is counted once
        (DDP's reducer would otherwise call the process group directly, bypassing the counter)."""

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations here
            return default_hooks.allreduce_hook(state, bucket)

        return hook

    def restore(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)


def _payload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The tensor whose size a collective moves: the all-reduced tensor, the gathered output, the scattered input."""
    if name == "all_reduce":
        return args[0] if args else kwargs["tensor"]
    if "gather" in name:
        return args[0] if args else kwargs["output_tensor"]
    return args[1] if len(args) > 1 else kwargs["input"]


def build(name: str, cfg: GPTConfig, device: torch.device, counter: ByteCounter,
          args: argparse.Namespace | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if name == "ddp":
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        ddp.register_comm_hook(None, counter.ddp_hook())
        return ddp
    shard = fully_shard if name == "fullshard" else torch_fully_shard
    kwargs: dict[str, Any] = {}
    if args is not None and getattr(args, "dtype", "fp32") == "bf16":
        policy = MixedPrecisionPolicy if name == "fullshard" else TorchMixedPrecisionPolicy
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        shard(block, **kwargs)
    root_reshard = True if args is not None and getattr(args, "reshard_root", False) else None
    shard(model, reshard_after_forward=root_reshard, **kwargs)
    return model


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def warm_device(cfg: GPTConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """One step of a plain one-block model, so that library workspaces (cuBLAS keeps one per thread and stream)
    exist before any implementation is measured and none of them is charged for them. CPU: nothing to do."""
    if device.type != "cuda":
        return
    with torch.device(device):
        model = GPT(replace(cfg, n_layers=1, seq_len=min(cfg.seq_len, 256))).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (1, model.cfg.seq_len + 1), device=device)
    lm_loss(model, tokens).backward()
    torch.cuda.synchronize(device)


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """torch's AdamW: its default implementation, or ``--foreach off`` (one kernel per parameter)."""
    foreach = None if getattr(args, "foreach", "default") == "default" else False
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available() and args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = GPTConfig(dim=args.dim, n_heads=args.heads, hidden=4 * args.dim, n_layers=args.layers, seq_len=args.seq_len)
    counter = ByteCounter()
    warm_device(cfg, device, torch.bfloat16 if getattr(args, "dtype", "fp32") == "bf16" else torch.float32)
    runs: dict[str, dict[str, Any]] = {}
    for name in args.implementations:
        before = allocated(device)
        model = build(name, cfg, device, counter, args)
        runs[name] = {"model": model, "opt": make_optimizer(model, args), "times": [], "bytes": [],
                      "resident": allocated(device) - before, "peak_rise": 0, "state": 0, "params": 0,
                      "losses": [], "phases": []}
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen).to(device)
        order = list(args.implementations)
        shift = step % len(order)
        for name in order[shift:] + order[:shift]:
            run = runs[name]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            at_start = allocated(device)
            dist.barrier()
            counter.bytes = 0.0
            cpu_start = _cpu_seconds()
            start = time.perf_counter()
            loss = lm_loss(run["model"], tokens)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            run["opt"].step()
            stepped = time.perf_counter()
            if not run["state"]:
                held = state_bytes(run["model"], run["opt"])
                run["state"], run["params"] = sum(held.values()), held["params"]
            run["opt"].zero_grad()
            if cuda:
                torch.cuda.synchronize()
                run["peak_rise"] = max(run["peak_rise"], torch.cuda.max_memory_allocated() - at_start)
                if step == 0:  # lazy initialisation and the optimizer state: kept from now on
                    run["resident"] += allocated(device) - at_start
            cpu = [b - a for a, b in zip(cpu_start, _cpu_seconds())]
            elapsed = torch.tensor(time.perf_counter() - start, device=device)  # NCCL reduces device tensors
            sent = counter.bytes
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            run["losses"].append(loss.item())
            if step >= args.warmup:
                run["times"].append(elapsed.item())
                run["bytes"].append(sent)
                run["phases"].append((forward - start, backward - forward, stepped - backward, *cpu))
    counter.restore()
    if rank == 0:
        print(report(runs, cfg, world_size, device, args))


def report(runs: dict[str, dict[str, Any]], cfg: GPTConfig, world_size: int, device: torch.device,
           args: argparse.Namespace) -> str:
    n_params = sum(p.numel() for p in GPT(cfg).parameters())
    first = args.implementations[0]
    lines = [
        f"GPT {cfg.n_layers} blocks, width {cfg.dim}, {n_params / 1e6:.2f}M parameters, batch {args.batch_size}x"
        f"{cfg.seq_len} per rank, world size {world_size}, {device.type}, {args.steps} timed steps each; "
        f"{getattr(args, 'dtype', 'fp32')}, root resharded after forward: {getattr(args, 'reshard_root', False)}, "
        f"AdamW foreach: {getattr(args, 'foreach', 'default')}",
        f"{'':12s} {'step ms':>9s} {'vs ' + first:>14s} {'params B/rank':>14s} {'state MiB/rank':>15s} {'peak MiB':>9s} "
        f"{'sent MiB/step':>14s} {'max loss diff':>14s}",
    ]
    base = statistics.median(runs[first]["times"])
    for name, run in runs.items():
        median = statistics.median(run["times"])
        peak = f"{(run['resident'] + run['peak_rise']) / 2**20:.1f}" if device.type == "cuda" else "n/a"
        diff = max(abs(a - b) for a, b in zip(run["losses"], runs[first]["losses"]))
        lines.append(f"{name:12s} {median * 1e3:9.1f} {median / base:14.3f} {run['params']:14d} {run['state'] / 2**20:15.2f} "
                     f"{peak:>9s} {statistics.median(run['bytes']) / 2**20:14.2f} {diff:14.2e}")
    lines.append("rank 0, median ms per step: forward, backward, optimizer.step, and the CPU time of its process "
                 "(every thread: the collectives' too) in user and system mode")
    lines.append(f"{'':12s} {'forward':>9s} {'backward':>9s} {'optimizer':>9s} {'CPU user':>9s} {'CPU system':>10s}")
    for name, run in runs.items():
        medians = [statistics.median(column) * 1e3 for column in zip(*run["phases"])]
        lines.append(f"{name:12s} " + " ".join(f"{m:9.1f}" for m in medians[:4]) + f" {medians[4]:10.1f}")
    return "\n".join(lines)


def _cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start when not under torchrun (default: 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: run under torchrun, one rank per GPU")
    p.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                   help="what to compare; ratios are against the first (default: all three; fullshard and "
                        "torch-fsdp2 with --simulate-ranks)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per implementation (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first (default: 3)")
    p.add_argument("--layers", type=int, default=12, help="transformer blocks (default: 12)")
    p.add_argument("--dim", type=int, default=256, help="model width (default: 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default: 128)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default: 4)")
    p.add_argument("--reshard-root", action="store_true",
                   help="reshard the root's parameters after forward too (default: kept for backward, as FSDP2's)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for both FSDPs (default: fp32)")
    p.add_argument("--foreach", choices=("default", "off"), default="default",
                   help="torch's AdamW with its default implementation, or foreach=False (default: default)")
    p.add_argument("--simulate-ranks", type=int, metavar="N",
                   help="one rank of an N-rank job in this process, torch's fake process group standing in for the "
                        "others (no bytes move; --nproc is ignored)")


def add_command(commands: Any) -> None:
    p = commands.add_parser("bench", help="time fullshard against torch's fully_shard and DDP on the same model",
                            description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    if args.implementations is None:
        args.implementations = list(IMPLEMENTATIONS[:2] if args.simulate_ranks is not None else IMPLEMENTATIONS)
    if args.simulate_ranks is not None:
        simulate(args)
        return 0
    launch.run(worker, args.nproc, args, device_type=args.device)
    return 0


def simulate(args: argparse.Namespace) -> None:
    """``worker`` as rank 0 of ``args.simulate_ranks`` ranks, in this process, over torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if args.simulate_ranks < 2:
        raise ValueError(f"--simulate-ranks must be at least 2, got {args.simulate_ranks}")
    if "ddp" in args.implementations:
        raise ValueError("--simulate-ranks does not run ddp: DDP's all-reduce hook reads a result the fake process "
                         "group does not produce; compare fullshard and torch-fsdp2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.simulate_ranks)
    try:
        worker(0, args.simulate_ranks, args)
    finally:
        dist.destroy_process_group()
