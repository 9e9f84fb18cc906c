"""Checkpoint size and save/load time of the 12-block GPT with AdamW state, through fullshard.checkpoint.

    python benchmarks/checkpoint_io.py [--world-size 2] [--dir /tmp/fullshard-ckpt]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import fullshard
from fullshard import checkpoint
from fullshard.cli import launch
from fullshard.gpt import GPT, GPTConfig, lm_loss


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig(n_layers=args.layers, dim=args.dim, hidden=4 * args.dim)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fullshard.fully_shard(block)
    fullshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), device=device)).backward()
    opt.step()
    opt.zero_grad()
    path = Path(args.dir)
    saves, loads, manifests, verifies = [], [], [], []
    for _ in range(args.repeats):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        saves.append(timed(lambda: checkpoint.save(state, path)))
        loads.append(timed(lambda: checkpoint.load(state, path)))
        # The checksum parts on their own: hashing for the manifest (inside save), checking it (inside load).
        manifests.append(timed(lambda: checkpoint._write_manifest(path)))
        verifies.append(timed(lambda: checkpoint.verify(path)))
    if rank == 0:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        n_params = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"GPT {cfg.n_layers} blocks, {n_params / 1e6:.2f}M parameters + AdamW state, world size {world_size}")
        print(f"checkpoint size: {size / 2**20:.1f} MiB in {sum(1 for f in path.rglob('*') if f.is_file())} files")
        save, load = statistics.median(saves), statistics.median(loads)
        manifest, verify = statistics.median(manifests), statistics.median(verifies)
        print(f"save: median {save * 1e3:.0f} ms, load: median {load * 1e3:.0f} ms ({args.repeats} repeats)")
        print(f"checksums: manifest {manifest * 1e3:.0f} ms ({manifest / save:.0%} of save), "
              f"verify {verify * 1e3:.0f} ms ({verify / load:.0%} of load)")
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/fullshard-checkpoint-bench")
    args = p.parse_args()
    launch.run(worker, args.world_size, args, device_type="cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
