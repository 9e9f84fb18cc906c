"""Optimizers that still hold the parameters ``fully_shard`` replaced.

``fully_shard`` puts a new sharded ``DTensor`` parameter on the module in place of
each original one. An optimizer built before it (``AdamW(model.parameters())``
followed by ``fully_shard(model)``) keeps the originals: they are no longer used by
the model, never get a gradient, and ``step()`` skips them, so nothing trains and
nothing says so. A global optimizer step pre-hook, registered at the first
``fully_shard``, raises ``ValueError`` instead when an optimizer about to step holds
a trainable original that a live sharded parameter replaced and that has no
gradient, naming it. An original with a gradient is left alone: something still
uses it (a module outside ``fully_shard``'s reach tied to it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fullshard.param import claimant_of

__all__ = ["refuse_replaced"]


def refuse_replaced(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The global optimizer step pre-hook (registered at the first ``fully_shard``)."""
    if torch.compiler.is_compiling():
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if type(p) is DTensor or not p.requires_grad or p.grad is not None:
                continue  # an original with a gradient is still used (tied to a module fully_shard did not take)
            sharded = claimant_of(p)
            if sharded is not None:
                raise ValueError(
                    f"fullshard: {type(opt).__name__} holds the original parameter {sharded.fqn!r}, which "
                    "fully_shard replaced with a sharded one: the model no longer uses it, so this step would "
                    "train nothing. Build the optimizer after fully_shard, from model.parameters()."
                )
