"""``python -m fullshard.as_fsdp2 (-m MODULE | SCRIPT) [ARGS...]``: run a program with torch's FSDP2 names
pointing at fullshard (:func:`fullshard.use_as_fsdp2`), e.g. under ``torchrun``::

    torchrun --nproc-per-node 8 -m fullshard.as_fsdp2 -m torchtitan.train --job.config_file llama3_8b.toml
"""

from __future__ import annotations

import os
import runpy
import sys

from fullshard.swap import use_as_fsdp2

USAGE = "usage: python -m fullshard.as_fsdp2 (-m MODULE | SCRIPT) [ARGS...]"


def main(argv: list[str]) -> None:
    """Swap the names, then run ``-m MODULE`` or ``SCRIPT`` as ``__main__`` with ``ARGS`` as its ``sys.argv``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    use_as_fsdp2()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(f"{USAGE}\nfullshard.as_fsdp2: error: -m needs a module name", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        if not os.path.exists(argv[0]):
            print(f"{USAGE}\nfullshard.as_fsdp2: error: no such script: {argv[0]}", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
