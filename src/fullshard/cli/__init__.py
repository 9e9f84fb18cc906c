"""The ``fullshard`` command."""

from __future__ import annotations

import argparse
import os
import sys

from fullshard.cli import bench, convert, launch, train
from fullshard.cli.launch import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard", description="Fully sharded data parallel training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_command(commands)
    bench.add_command(commands)
    convert.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.run(args) or 0)
    except (FileNotFoundError, ValueError, UserError) as err:
        print(f"fullshard {args.command}: error: {err}", file=sys.stderr)
        code = 2
    except launch.RankFailed as err:  # the failing rank printed its traceback; the others were stopped
        print(f"fullshard {args.command}: error: {err}; the other ranks were stopped", file=sys.stderr)
        code = 1
    if launch.under_launcher() and args.command in ("train", "bench"):
        # A torchrun rank: skip interpreter finalisation, where the process group's C++
        # threads can abort the process after the work is done (see launch._local_rank).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
