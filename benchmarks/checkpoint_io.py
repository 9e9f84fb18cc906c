"""Checkpoint size and save/load time of the 12-block GPT with AdamW state, through fullshard.checkpoint.

    python benchmarks/checkpoint_io.py [--world-size 2] [--dir /tmp/fullshard-ckpt]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fullshard import checkpoint
from fullshard.gpt import GPT, lm_loss


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    dev, cfg = common.device(), common.config(args)
    model = common.sharded_gpt(cfg, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), device=dev)).backward()
    opt.step()
    opt.zero_grad()
    path = Path(args.dir)
    saves, loads, manifests, verifies = [], [], [], []
    for _ in range(args.repeats):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        saves.append(common.timed(lambda: checkpoint.save(state, path), dev, after_barrier=True))
        loads.append(common.timed(lambda: checkpoint.load(state, path), dev, after_barrier=True))
        # The checksum parts on their own: hashing for the manifest (inside save), checking it (inside load).
        manifests.append(common.timed(lambda: checkpoint._write_manifest(path), dev, after_barrier=True))
        verifies.append(common.timed(lambda: checkpoint.verify(path), dev, after_barrier=True))
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
    p = common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/fullshard-checkpoint-bench")
    common.launch_workers(worker, p.parse_args())


if __name__ == "__main__":
    main()
