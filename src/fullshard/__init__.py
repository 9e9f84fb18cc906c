"""fullshard: fully sharded data parallel training for PyTorch.

``from fullshard import fully_shard`` is a drop-in for
``from torch.distributed.fsdp import fully_shard``.
"""

from torch.distributed.fsdp import DataParallelMeshDims

from fullshard.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from fullshard.errors import AlreadyShardedError, UsageError
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "AlreadyShardedError",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "UsageError",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
