"""Live tensor bytes per rank over one training step, fullshard next to torch's FSDP2 (no GPU needed).

Every storage a tensor op creates is tracked (a ``TorchDispatchMode`` sees each op's outputs; a weak
reference on the storage sees it die; ``UntypedStorage.resize_`` is watched, since both implementations
free and re-allocate their unsharded buffers by resizing storages). Before the step, the storages of the
parameters, buffers, gradients and optimizer state are counted as live. The peak of the step is reported
with the phase it happens in (forward, backward, optimizer) and the largest storages live at that moment
(the op that made each).

Configurations: plain fp32, bf16 mixed precision, ``reshard_after_forward=False``, gradient accumulation
(two micro-batches, the first without gradient sync) and HSDP (a 2 x 2 mesh at 4 ranks). Every group,
the root's included, reshards after forward unless the configuration says otherwise; the optimizer is
torch's ``AdamW(foreach=False)``. ``bound`` is what a step needs at least: the sharded state (parameters,
gradients, optimizer state), the largest group unsharded (parameters and gradients) and the activations
(measured on the unwrapped model with this rank's batch). ``left after the step`` is what the step
allocated that is still live after its ``optimizer.zero_grad()``, with the garbage collector off: memory
that only a collection would give back (a reference cycle) shows here, and grows a process step by step.

    python benchmarks/memory.py                      # every configuration, 2 ranks (HSDP: 4)
    python benchmarks/memory.py --configs plain bf16 --top 8
"""

from __future__ import annotations

import argparse
import gc
import weakref
from typing import Any

import torch
import torch.distributed as dist
from common import launch_workers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fullshard.gpt import GPT, GPTConfig, lm_loss

MIB = 1 << 20
CONFIGS = ("plain", "bf16", "no_reshard", "accumulation", "hsdp")


class LiveBytes(TorchDispatchMode):
    """Bytes of every live storage created by tensor ops (and of those registered with :meth:`add`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self.total = 0
        self.peak = 0
        self.peak_phase = ""
        self.peak_top: list[tuple[int, str]] = []
        self.phase = ""
        self.top = 6
        self._resize: Any = None
        self.recent: list[str] = []  # the last allocations, for --trace
        self.peak_recent: list[str] = []
        self.left = 0  # bytes the step made that are still live after it (optimizer.zero_grad() included)

    def add(self, storage: torch.UntypedStorage, label: str) -> None:
        if storage.device.type == "meta":
            return
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key] = 0
            self.labels[key] = label
            weakref.finalize(storage, self._freed, key)
        self._set(key, storage.nbytes())

    def _set(self, key: int, nbytes: int) -> None:
        self.total += nbytes - self.sizes[key]
        if nbytes - self.sizes[key] > 1 << 18:
            change = f"{(nbytes - self.sizes[key]) / MIB:+.2f} {self.labels[key]} -> {self.total / MIB:.2f}"
            self.recent = [*self.recent[-11:], change]
        self.sizes[key] = nbytes
        if self.total > self.peak:
            self.peak, self.peak_phase = self.total, self.phase
            self.peak_top = sorted(((n, self.labels[k]) for k, n in self.sizes.items() if n), reverse=True)[: self.top]
            self.peak_recent = list(self.recent)

    def _freed(self, key: int) -> None:
        freed = self.sizes.pop(key, 0)
        self.total -= freed
        if freed > 1 << 18:
            self.recent = [*self.recent[-11:], f"-{freed / MIB:.2f} {self.labels.get(key)} -> {self.total / MIB:.2f}"]
        self.labels.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor:
                self.add(t.untyped_storage(), f"{func.__name__} ({self.phase})")
        return out

    def __enter__(self) -> LiveBytes:
        tracker, original = self, torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            tracker.add(storage, f"storage resize ({tracker.phase})")
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def register_state(tracker: LiveBytes, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Count the step's starting state as live: parameters, buffers, gradients, optimizer state."""
    for p in model.parameters():
        tracker.add(_local(p).untyped_storage(), "parameter")
        if p.grad is not None:
            tracker.add(_local(p.grad).untyped_storage(), "gradient")
    for b in model.buffers():
        tracker.add(b.untyped_storage(), "buffer")
    from fullshard.runtime import states_in

    for state in states_in(model):  # name fullshard's unsharded buffers (they are resized, not re-made)
        if state.group is not None:
            tracker.add(state.group.unsharded_buffer.untyped_storage(), f"unsharded {state.group.label or 'root'}")
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.add(_local(v).untyped_storage(), "optimizer state")


def shard(model: GPT, impl: str, config: str, mesh: Any) -> None:
    if impl == "fullshard":
        from fullshard import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    kw: dict[str, Any] = {"reshard_after_forward": config != "no_reshard", "mesh": mesh}
    if config == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def step(model: Any, opt: torch.optim.Optimizer, batches: list[torch.Tensor], tracker: LiveBytes | None,
         sharded: bool) -> None:
    for i, batch in enumerate(batches):
        if sharded and len(batches) > 1:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        if tracker is not None:
            tracker.phase = "forward"
        loss = lm_loss(model, batch)
        if tracker is not None:
            tracker.phase = "backward"
        loss.backward()
    if tracker is not None:
        tracker.phase = "optimizer"
    opt.step()
    opt.zero_grad()


def measure(model: Any, batches: list[torch.Tensor], sharded: bool, top: int) -> LiveBytes:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    step(model, opt, batches, None, sharded)  # optimizer state and lazy initialisation exist from here on
    tracker = LiveBytes()
    tracker.top = top
    gc.collect()
    gc.disable()  # what only a garbage collection would free counts as left
    try:
        register_state(tracker, model, opt)
        start = tracker.total
        with tracker:
            step(model, opt, batches, tracker, sharded)
        tracker.left = tracker.total - start
    finally:
        gc.enable()
    return tracker


def activation_bytes(cfg: GPTConfig, batch: torch.Tensor, dtype: torch.dtype) -> int:
    """Peak live bytes of the unwrapped model's forward beyond its parameters (this rank's batch, ``dtype``)."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    tracker = LiveBytes()
    for p in model.parameters():
        tracker.add(p.untyped_storage(), "parameter")
    start = tracker.total
    tracker.phase = "forward"
    with tracker:
        loss = lm_loss(model, batch)
    del loss
    return tracker.peak - start


def bound_bytes(cfg: GPTConfig, config: str, shard_size: int, batch: torch.Tensor) -> int:
    """What a step needs at least: the sharded state (parameters, gradients, two AdamW moments, fp32), the
    unsharded parameters that must coexist (the largest group; every group with reshard_after_forward=False),
    the unsharded gradients kept across micro-batches (accumulation) and the forward's activations."""
    torch.manual_seed(0)
    model = GPT(cfg)
    groups = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    total = sum(p.numel() for p in model.parameters())
    groups.append(total - sum(groups))
    compute_bytes = 2 if config == "bf16" else 4
    state = -(-total // shard_size) * 4 * 4
    unsharded = (sum(groups) if config == "no_reshard" else max(groups)) * compute_bytes
    kept_grads = total * 4 if config == "accumulation" else 0
    dtype = torch.bfloat16 if config == "bf16" else torch.float32
    return state + unsharded + kept_grads + activation_bytes(cfg, batch, dtype)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim, seq_len=args.seq_len)
    gen = torch.Generator().manual_seed(rank)
    configs = [c for c in args.configs if (c == "hsdp") == (world_size == 4)]
    rows = []
    for config in configs:
        micro = 2 if config == "accumulation" else 1
        batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen) for _ in range(micro)]
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if config == "hsdp" else None
        result = {}
        for impl in ("fsdp2", "fullshard"):
            torch.manual_seed(0)
            model = GPT(cfg)
            shard(model, impl, config, mesh)
            result[impl] = measure(model, batches, True, args.top)
            del model
        shard_size = world_size // 2 if config == "hsdp" else world_size
        rows.append((config, result["fullshard"], result["fsdp2"], bound_bytes(cfg, config, shard_size, batches[0])))
    if rank == 0:
        print(f"\nworld size {world_size}: GPT {cfg.n_layers} blocks, width {cfg.dim}, batch {args.batch_size}x{cfg.seq_len}")
        print("| configuration | fullshard peak MiB | FSDP2 peak MiB | fullshard/FSDP2 | fullshard phase | FSDP2 phase "
              "| bound MiB | fullshard/bound | left after the step MiB (fullshard / FSDP2) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for config, ours, theirs, bound in rows:
            print(f"| {config} | {ours.peak / MIB:.2f} | {theirs.peak / MIB:.2f} | {ours.peak / theirs.peak:.3f} | "
                  f"{ours.peak_phase} | {theirs.peak_phase} | {bound / MIB:.2f} | {ours.peak / bound:.3f} | "
                  f"{ours.left / MIB:.2f} / {theirs.left / MIB:.2f} |")
        for config, ours, theirs, _ in rows:
            for name, tracker in (("fullshard", ours), ("FSDP2", theirs)):
                top = ", ".join(f"{n / MIB:.2f} {label}" for n, label in tracker.peak_top)
                print(f"  {config} {name} at its peak: {top}")
                if args.trace:
                    print("    " + "\n    ".join(tracker.peak_recent))
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--trace", action="store_true", help="also print the allocations that led to each peak")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    args = p.parse_args()
    for world_size in (2, 4):
        if any((c == "hsdp") == (world_size == 4) for c in args.configs):
            args.world_size = world_size
            launch_workers(worker, args)


if __name__ == "__main__":
    main()
