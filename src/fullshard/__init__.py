"""fullshard: fully sharded data parallel training for PyTorch.

``from fullshard import fully_shard`` is a drop-in for
``from torch.distributed.fsdp import fully_shard``.
"""

from fullshard.api import AlreadyShardedError, FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "AlreadyShardedError",
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
