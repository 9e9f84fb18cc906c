"""fullshard: fully sharded data parallel training for PyTorch.

``from fullshard import fully_shard`` is a drop-in for
``from torch.distributed.fsdp import fully_shard``.
"""

import logging

from fullshard import checkpoint, optim
from fullshard.api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from fullshard.codec import QuantizedCommPolicy
from fullshard.ema import EMA
from fullshard.errors import AlreadyShardedError, UsageError
from fullshard.failures import DivergenceError, RankFailureError, collective_timeout, set_collective_timeout
from fullshard.fsdp1 import (
    ReduceState,
    bf16_compress_hook,
    clip_grad_norm_,
    fp16_compress_hook,
    no_sync,
    nonfinite_gradients,
    reduce_scatter_hook,
    register_comm_hook,
    summon_full_params,
)
from fullshard.mesh import DataParallelMeshDims
from fullshard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fullshard.state_dict import (
    OptimStateKeyType,
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    rekey_optim_state_dict,
)
from fullshard.swap import use_as_fsdp2
from fullshard.wrap import (
    BackwardPrefetch,
    CPUOffload,
    CustomPolicy,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    shard_model,
    size_based_auto_wrap_policy,
)

__all__ = [
    "AlreadyShardedError",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "CustomPolicy",
    "EMA",
    "DataParallelMeshDims",
    "DivergenceError",
    "FSDPModule",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "OptimStateKeyType",
    "QuantizedCommPolicy",
    "RankFailureError",
    "ReduceState",
    "ShardingStrategy",
    "UnshardHandle",
    "UsageError",
    "bf16_compress_hook",
    "checkpoint",
    "clip_grad_norm_",
    "collective_timeout",
    "fp16_compress_hook",
    "full_optim_state_dict",
    "full_state_dict",
    "fully_shard",
    "load_full_optim_state_dict",
    "no_sync",
    "nonfinite_gradients",
    "optim",
    "reduce_scatter_hook",
    "register_comm_hook",
    "register_fsdp_forward_method",
    "rekey_optim_state_dict",
    "set_collective_timeout",
    "shard_model",
    "share_comm_ctx",
    "size_based_auto_wrap_policy",
    "summon_full_params",
    "use_as_fsdp2",
]

# One logger for the package, quiet unless the application configures logging.
logging.getLogger("fullshard").addHandler(logging.NullHandler())
