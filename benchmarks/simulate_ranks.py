"""One rank of a many-rank job on one device: fullshard against torch's fully_shard with the fake process group.

torch's fake process group stands in for N ranks in one process. Its
collectives send nothing: in torch 2.13 an all-gather writes this rank's
input into every rank's slot of the output and a reduce-scatter copies this
rank's row of the input, as if every rank held the same data. Everything else
a rank does is real: each rank keeps 1/N of the parameters, gradients and
AdamW state, while the all-gather outputs, unsharded parameters, activations
and reduce-scatter inputs are full size. So the step time, host time and peak
memory measured here are those of one rank of an N-rank job minus the time on
the wire, and the copies around the collectives (copy-in, copy-out, packing,
casts) are real kernels on real buffers.

What the fake group does not reproduce: the time on the wire and how it
overlaps compute; the averaging inside NCCL's reduce-scatter (FSDP2 asks any
backend for ``ReduceOp.AVG``, fullshard only NCCL, so here fullshard sums and
then divides each group's gradient shard in a small kernel of its own that a
real NCCL job does not run, while the fake group ignores the AVG: FSDP2's
gradients come out N times fullshard's); and fullshard's divergence check at
the end of backward, which NCCL jobs run and fake groups skip.

The same GPT (``fullshard.gpt``; same seed) is built twice, once sharded by
fullshard and once by torch's ``fully_shard`` (FSDP2), one group per block and
one for the rest, with the same mixed precision and optimizer. Both train on
the same batches; every step runs both, the order alternating. Reported per
implementation:

- step: median wall time of a step (forward, backward, optimizer step,
  ``zero_grad``) up to ``torch.cuda.synchronize()``;
- host: median wall time until the step's last operation is queued (before
  the synchronize); on CPU the same as the step;
- resident and peak memory (CUDA): what the implementation keeps between
  steps (measured as allocator deltas when it is built and across its first
  step: sharded parameters, AdamW state, caches), and that plus the largest
  ``torch.cuda.max_memory_allocated()`` rise within a timed step. Both models
  live on the device together; each one's peak leaves the other's resident
  memory out. CPU: "n/a";
- the profile split of ``--profile-steps`` extra steps (``torch.profiler``; see
  ``category``): device time on CUDA (host time in a second table), CPU time on
  CPU; each category's median over those steps, and the sum of the medians.
  On CPU the profiler's own cost (it records every operation) makes the sum
  larger than the step time.

The fake collectives make every rank's shards equal, so both implementations
train the same model on the same batches; AdamW is nearly blind to the
gradients' scale, so their losses stay within a rounding step or two of the
bf16 loss (about 0.03 near 6): the largest loss difference is shown as a check
that both trained the same model, not as an exact comparison.

    python benchmarks/simulate_ranks.py --device cpu --preset tiny --ranks 8 --steps 3
    python benchmarks/simulate_ranks.py --device cuda --preset 1b --ranks 8 64
    python benchmarks/simulate_ranks.py --device cuda --preset 8b-shaped --ranks 8 64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import DeviceType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fullshard
from fullshard.cli.bench import allocated, warm_device
from fullshard.gpt import GPT, GPTConfig, lm_loss


@dataclass(frozen=True)
class Preset:
    """A model and the batch one rank trains on."""

    cfg: GPTConfig
    batch_size: int
    about: str


# GPT blocks have a GELU MLP of two matrices (Llama's SwiGLU has three) and full multi-head attention, so
# "8b-shaped" has Llama-3 8B's width, MLP width and vocabulary, not its exact parameter list.
PRESETS = {
    "tiny": Preset(GPTConfig(vocab_size=512, dim=64, n_heads=4, hidden=256, n_layers=2, seq_len=64), 2,
                   "for CPU smoke runs"),
    "1b": Preset(GPTConfig(vocab_size=32768, dim=2048, n_heads=16, hidden=8192, n_layers=18, seq_len=2048), 2,
                 "about 1B parameters"),
    "8b-shaped": Preset(GPTConfig(vocab_size=128256, dim=4096, n_heads=32, hidden=14336, n_layers=4, seq_len=4096), 1,
                        "Llama-3 8B's width (4096), MLP (14336) and vocabulary, 4 blocks"),
}

IMPLEMENTATIONS = ("fullshard", "torch-fsdp2")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# ---- profile categories -------------------------------------------------------------------------------------
#
# Each profiled operation's self time (device time on CUDA, CPU time on CPU) goes to the first category
# below whose rule matches the operation's own name or the name of any operation or record_function label
# enclosing it (so a kernel launched by ``aten::copy_`` inside ``aten::_to_copy`` inside
# ``FSDP::all_gather`` is a cast):
#
# optimizer   inside ``Optimizer.step#...`` / ``Optimizer.zero_grad#...`` (torch.optim's own labels, where
#             the foreach or fused AdamW kernels run), or a fused Adam op anywhere.
# collective  a c10d operation (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ...,
#             ``record_param_comms``, ``nccl:*``). With the fake process group this is the copy it makes
#             in place of sending (see the module docstring); equal for both but for one case: an
#             all-gather whose input is already the output's own slot (FSDP2) skips that slot's copy.
# cast        inside ``aten::_to_copy`` (a dtype conversion as its own kernel; not the divisor's conversion
#             inside ``aten::div_``, which goes with the division to "other"), or FSDP2's
#             ``aten::_foreach_copy_`` inside ``FSDP::all_gather`` but outside ``fsdp::all_gather_copy_in``
#             (it runs only when the parameters are cast: their param-dtype copies, made before the
#             copy-in). fullshard casts inside its copy-in kernel, and both cast the gradients to the
#             reduce dtype inside the packing kernel, so those casts count as copy-in and rs-copy-in.
# copy-out    ``aten::split_with_sizes_copy`` / ``fsdp::split_with_sizes_copy`` or inside
#             ``FSDP::all_gather_copy_out``: the all-gather output (rank-major) reordered into the
#             unsharded parameters.
# rs-copy-in  ``aten::_chunk_cat`` / ``fsdp::chunk_cat`` or inside ``fullshard::reduce_scatter_copy_in``:
#             the unsharded gradients packed rank-major into the reduce-scatter input (with fullshard's
#             pre-division, when there is one).
# copy-in     anything else inside ``fullshard::all_gather`` / ``FSDP::all_gather``: allocating the
#             all-gather buffers and copying the sharded parameters into the input
#             (``fsdp::all_gather_copy_in`` for FSDP2, a casting ``aten::copy_`` for fullshard).
# other       the rest: the model's forward and backward, the loss, hooks, bookkeeping, and the division
#             of the reduced gradients (see the module docstring).
#
# Device time is kernel time summed over streams (a copy on a side stream overlapping compute counts in
# full). On CPU the split is of CPU time, so the Python work inside a label counts too (FSDP2's own bookkeeping
# inside ``FSDP::all_gather`` is copy-in there); on CUDA the main split is of kernel time, and the host
# table shows the CPU side the same way.

CATEGORIES = ("copy-in", "copy-out", "rs-copy-in", "cast", "optimizer", "collective", "other")
COLLECTIVE_PREFIXES = ("c10d::", "record_param_comms", "nccl:")
COPY_OUT_OPS = frozenset({"aten::split_with_sizes_copy", "fsdp::split_with_sizes_copy"})
RS_COPY_IN_OPS = frozenset({"aten::_chunk_cat", "fsdp::chunk_cat"})


def category(chain: list[str]) -> str:
    """The category of an operation, given its name and those enclosing it (innermost first)."""
    if any(n.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) or "fused_adam" in n for n in chain):
        return "optimizer"
    if any(n.startswith(COLLECTIVE_PREFIXES) for n in chain):
        return "collective"
    if ("aten::_to_copy" in chain and "aten::div_" not in chain) or (
        "aten::_foreach_copy_" in chain and "fsdp::all_gather_copy_in" not in chain
        and any(n.startswith("FSDP::all_gather") for n in chain)
    ):
        return "cast"
    if any(n in COPY_OUT_OPS or n.startswith("FSDP::all_gather_copy_out") for n in chain):
        return "copy-out"
    if any(n in RS_COPY_IN_OPS or n.startswith("fullshard::reduce_scatter_copy_in") for n in chain):
        return "rs-copy-in"
    if any(n.startswith(("fullshard::all_gather", "FSDP::all_gather")) for n in chain):
        return "copy-in"
    return "other"


def split(events: Any, on_device: bool) -> tuple[Counter[str], Counter[str]]:
    """Microseconds per category of a profile's host operations: (device or CPU self time, host self time)."""
    main: Counter[str] = Counter()
    host: Counter[str] = Counter()
    for event in events:
        if event.device_type != DeviceType.CPU:  # kernels are counted through the operation that launched them
            continue
        chain, parent = [], event
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        kind = category(chain)
        host[kind] += event.self_cpu_time_total
        main[kind] += event.self_device_time_total if on_device else event.self_cpu_time_total
    return main, host


# ---- one implementation ------------------------------------------------------------------------------------


class Trainee(NamedTuple):
    """One sharded model and its optimizer; they live for one world size."""

    model: nn.Module
    opt: torch.optim.Optimizer


@dataclass
class Run:
    """What one implementation's steps measured at one world size."""

    name: str
    resident: int  # bytes kept between steps (CUDA): the sharded model's, then the first step's delta
    step_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    peak_rise: int = 0  # the largest rise of allocated bytes within a timed step (CUDA)
    losses: list[float] = field(default_factory=list)
    profile: list[Counter[str]] = field(default_factory=list)  # microseconds per category, one per profiled step
    profile_host: list[Counter[str]] = field(default_factory=list)


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **flags)


def build(name: str, cfg: GPTConfig, dev: torch.device, mesh: DeviceMesh, args: argparse.Namespace) -> tuple[Trainee, Run]:
    """The GPT (seed 0) made on ``dev`` and sharded by ``name``, one group per block and one for the rest."""
    param_dtype, reduce_dtype = DTYPES[args.param_dtype], DTYPES[args.reduce_dtype]
    shard: Callable[..., Any]
    if name == "fullshard":
        shard, policy = fullshard.fully_shard, fullshard.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    else:
        shard, policy = torch_fully_shard, TorchMixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    gc.collect()
    before = allocated(dev)
    torch.manual_seed(0)
    with torch.device(dev):  # made on the device: a 1B model's CPU initialisation would take longer than the run
        model = GPT(cfg)
    for block in model.blocks:
        shard(block, mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    gc.collect()  # the unsharded parameters made above go
    return Trainee(model, optimizer(model.parameters(), args.optimizer)), Run(name, allocated(dev) - before)


def train_step(trainee: Trainee, run: Run, tokens: torch.Tensor, dev: torch.device, *, timed: bool, first: bool) -> None:
    synchronize(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    at_start = allocated(dev)
    start = time.perf_counter()
    loss = lm_loss(trainee.model, tokens)
    loss.backward()
    trainee.opt.step()
    trainee.opt.zero_grad(set_to_none=True)
    queued = time.perf_counter()
    synchronize(dev)
    end = time.perf_counter()
    run.losses.append(loss.item())
    del loss
    if first:  # lazy initialisation, AdamW state: kept from now on
        run.resident += allocated(dev) - at_start
    if timed:
        run.step_s.append(end - start)
        run.host_s.append(queued - start)
        if dev.type == "cuda":
            run.peak_rise = max(run.peak_rise, torch.cuda.max_memory_allocated(dev) - at_start)


def profile_step(trainee: Trainee, run: Run, tokens: torch.Tensor, dev: torch.device) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(dev)
    with torch.profiler.profile(activities=activities) as prof:
        lm_loss(trainee.model, tokens).backward()
        trainee.opt.step()
        trainee.opt.zero_grad(set_to_none=True)
        synchronize(dev)
    main, host = split(prof.events(), dev.type == "cuda")
    run.profile.append(main)
    run.profile_host.append(host)


def simulate(preset: Preset, world_size: int, dev: torch.device, args: argparse.Namespace) -> dict[str, Run]:
    """Build both implementations at ``world_size`` fake ranks and train them side by side."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh(dev.type, (world_size,))
        warm_device(preset.cfg, dev, DTYPES[args.param_dtype])
        trainees, runs = {}, {}
        for name in IMPLEMENTATIONS:
            trainees[name], runs[name] = build(name, preset.cfg, dev, mesh, args)
        gen = torch.Generator().manual_seed(1)
        for step in range(args.warmup + args.steps + args.profile_steps):
            tokens = torch.randint(0, preset.cfg.vocab_size, (preset.batch_size, preset.cfg.seq_len + 1), generator=gen)
            tokens = tokens.to(dev)
            order = IMPLEMENTATIONS[step % 2:] + IMPLEMENTATIONS[: step % 2]
            for name in order:
                if step < args.warmup + args.steps:
                    train_step(trainees[name], runs[name], tokens, dev, timed=step >= args.warmup, first=step == 0)
                else:
                    profile_step(trainees[name], runs[name], tokens, dev)
        return runs  # the models go with this frame, before the next world size builds its own
    finally:
        dist.destroy_process_group()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# ---- report --------------------------------------------------------------------------------------------------


def parameters(cfg: GPTConfig) -> int:
    """The model's parameter count (the tied embedding once), from a copy made on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def mib(n: int, dev: torch.device) -> str:
    return f"{n / 2**20:.1f}" if dev.type == "cuda" else "n/a"


def ratio(ours: float, theirs: float, dev: torch.device, *, memory: bool = False) -> str:
    return "n/a" if memory and dev.type != "cuda" else f"{ours / theirs:.3f}"


def table(name: str, preset: Preset, results: dict[int, dict[str, Run]], dev: torch.device,
          args: argparse.Namespace) -> str:
    cfg = preset.cfg
    split_unit = "device" if dev.type == "cuda" else "CPU"
    lines = [
        f"preset {name} ({preset.about}): GPT {cfg.n_layers} blocks, width {cfg.dim}, MLP {cfg.hidden}, vocabulary "
        f"{cfg.vocab_size}, {parameters(cfg) / 1e6:,.1f}M parameters; batch {preset.batch_size}x{cfg.seq_len} per rank; "
        f"{dev.type}; param {args.param_dtype}, reduce {args.reduce_dtype}, AdamW {args.optimizer}; "
        f"{args.steps} timed steps each, profile of {args.profile_steps} (ms of {split_unit} time per step)",
        "",
        "| ranks | implementation | step ms | host ms | resident MiB | peak MiB | "
        + " | ".join(f"{c} ms" for c in CATEGORIES) + " | total ms |",
        "|---" * (7 + len(CATEGORIES)) + "|",
    ]

    def split_cells(profile: list[Counter[str]]) -> str:
        """Each category's median over the profiled steps (one slow step on a busy machine moves none), and their sum."""
        if not profile:
            return " | ".join("n/a" for _ in range(len(CATEGORIES) + 1))
        ms = [round(statistics.median(step[c] for step in profile) / 1e3, 2) for c in CATEGORIES]
        return " | ".join(f"{v:.2f}" for v in [*ms, sum(ms)])

    for world_size, runs in results.items():
        for run in runs.values():
            lines.append(
                f"| {world_size} | {run.name} | {statistics.median(run.step_s) * 1e3:.2f} | "
                f"{statistics.median(run.host_s) * 1e3:.2f} | {mib(run.resident, dev)} | "
                f"{mib(run.resident + run.peak_rise, dev)} | {split_cells(run.profile)} |"
            )
    if dev.type == "cuda":
        lines += ["", "host (CPU) time of the same profile, ms per step:", "",
                  "| ranks | implementation | " + " | ".join(f"{c} ms" for c in CATEGORIES) + " | total ms |",
                  "|---" * (3 + len(CATEGORIES)) + "|"]
        for world_size, runs in results.items():
            for run in runs.values():
                lines.append(f"| {world_size} | {run.name} | {split_cells(run.profile_host)} |")
    lines += ["", "| ranks | fullshard/FSDP2 step | fullshard/FSDP2 peak memory | fullshard/FSDP2 host | max loss difference |",
              "|---|---|---|---|---|"]
    for world_size, runs in results.items():
        ours, theirs = runs["fullshard"], runs["torch-fsdp2"]
        diff = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
        lines.append(
            f"| {world_size} | {ratio(statistics.median(ours.step_s), statistics.median(theirs.step_s), dev)} | "
            f"{ratio(ours.resident + ours.peak_rise, theirs.resident + theirs.peak_rise, dev, memory=True)} | "
            f"{ratio(statistics.median(ours.host_s), statistics.median(theirs.host_s), dev)} | {diff:.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the simulated rank runs (default: cuda when there is one)")
    p.add_argument("--preset", nargs="+", choices=tuple(PRESETS), default=["tiny"], help="models to run (default: tiny)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="simulated world sizes (default: 8 64)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per implementation (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first (default: 2)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="profiled steps per implementation, after the timed ones (default: 3)")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--batch-size", type=int, help="override the preset's sequences per rank")
    p.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    p.add_argument("--param-dtype", choices=tuple(DTYPES), default="bf16", help="MixedPrecisionPolicy.param_dtype")
    p.add_argument("--reduce-dtype", choices=tuple(DTYPES), default="fp32", help="MixedPrecisionPolicy.reduce_dtype")
    p.add_argument("--optimizer", choices=("fused", "foreach", "for-loop"),
                   help="AdamW implementation (default: fused on CUDA, foreach on CPU)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if min(args.ranks) < 2 or args.steps < 1 or args.warmup < 1 or args.profile_steps < 0:
        p.error("--ranks must be at least 2, --steps and --warmup at least 1, --profile-steps at least 0")
    args.optimizer = args.optimizer or ("fused" if args.device == "cuda" else "foreach")
    if args.device == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)  # the fake process group leaves device selection to us
    else:
        dev = torch.device("cpu")
        torch.set_flush_denormal(True)  # tiny models' small values would otherwise hit slow denormal paths
        torch.set_num_threads(1)  # a rank of a CPU job has about one core; intra-op threads on a busy machine stall
    for name in args.preset:
        preset = PRESETS[name]
        overrides = {k: v for k, v in (("n_layers", args.layers), ("seq_len", args.seq_len)) if v is not None}
        preset = replace(preset, cfg=replace(preset.cfg, **overrides), batch_size=args.batch_size or preset.batch_size)
        results = {world_size: simulate(preset, world_size, dev, args) for world_size in args.ranks}
        print(table(name, preset, results, dev, args), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
