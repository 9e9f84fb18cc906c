"""fullshard against torch.distributed.fsdp.fully_shard on a 12-block GPT, step by step in one run.

A shortcut for ``fullshard bench --implementations fullshard torch-fsdp2``
(see ``fullshard bench --help``; any of its options can be added):

    python benchmarks/compare_fsdp2.py                       # 2 local ranks (gloo on CPU)
    torchrun --nproc-per-node 2 benchmarks/compare_fsdp2.py --device cuda
"""

import sys

from fullshard.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--implementations", "fullshard", "torch-fsdp2", *sys.argv[1:]]))
