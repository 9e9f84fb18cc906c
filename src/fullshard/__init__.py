"""fullshard: fully sharded data parallel training for PyTorch.

``from fullshard import fully_shard`` is a drop-in for
``from torch.distributed.fsdp import fully_shard``.
"""

from torch.distributed.fsdp import DataParallelMeshDims

from fullshard import checkpoint
from fullshard.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from fullshard.errors import AlreadyShardedError, UsageError
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.state_dict import (
    OptimStateKeyType,
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    rekey_optim_state_dict,
)

__all__ = [
    "AlreadyShardedError",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OptimStateKeyType",
    "OffloadPolicy",
    "UnshardHandle",
    "UsageError",
    "checkpoint",
    "full_optim_state_dict",
    "full_state_dict",
    "fully_shard",
    "load_full_optim_state_dict",
    "rekey_optim_state_dict",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
