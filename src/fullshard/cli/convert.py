"""``fullshard consolidate`` and ``fullshard shard``: sharded checkpoint <-> one full ``torch.save`` file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from fullshard.checkpoint import complete_checkpoint, verify


def consolidate(args: argparse.Namespace) -> int:
    source = complete_checkpoint(args.checkpoint)
    verify(source)  # a damaged file is a ValueError naming it: "fullshard consolidate: error: ...", status 2
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(source, args.output)
    print(f"wrote {args.output} from {source}")
    return 0


def shard(args: argparse.Namespace) -> int:
    source = Path(args.input)
    if not source.is_file():
        raise FileNotFoundError(f"no such file: {source}")
    torch_save_to_dcp(source, args.checkpoint)
    print(f"wrote checkpoint {args.checkpoint} from {source}")
    return 0


def add_commands(commands: Any) -> None:
    p = commands.add_parser(
        "consolidate",
        help="turn a sharded (torch.distributed.checkpoint) checkpoint into one full torch.save file",
        description="Read every shard of CKPT_DIR and write the full, FQN-keyed tensors to OUT.pt, "
        "keeping the checkpoint's nesting (e.g. {'model': ..., 'optim': ...}). Runs in one process.",
    )
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("output", metavar="OUT.pt")
    p.set_defaults(run=consolidate)
    p = commands.add_parser(
        "shard",
        help="turn one full torch.save file into a sharded checkpoint that loads at any world size",
        description="Write the state in IN.pt as a torch.distributed.checkpoint directory CKPT_DIR.",
    )
    p.add_argument("input", metavar="IN.pt")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.set_defaults(run=shard)
