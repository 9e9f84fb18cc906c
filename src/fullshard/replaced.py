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

The same holds for an optimizer built from the unsharded parameters: between a
forward and its backward (and after a forward without backward while a group stays
unsharded: the root, or ``reshard_after_forward=False``) ``model.parameters()`` lists
them, as in FSDP2. Their gradients go to the sharded parameters, so an optimizer
holding them steps nothing, silently on FSDP2; the hook names them too.
"""

from __future__ import annotations

from typing import Any

import torch

from fullshard.param import claimant_of, unsharded_owner

__all__ = ["refuse_replaced"]


def refuse_replaced(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The global optimizer step pre-hook (registered at the first ``fully_shard``)."""
    if torch.compiler.is_compiling():
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if not p.requires_grad or p.grad is not None:
                continue  # an original with a gradient is still used (tied to a module fully_shard did not take)
            sharded = claimant_of(p)
            if sharded is not None and sharded.sharded is not p:
                raise ValueError(
                    f"fullshard: {type(opt).__name__} holds the original parameter {sharded.fqn!r}, which "
                    "fully_shard replaced with a sharded one (or the sharded parameter of a group below, which an "
                    "enclosing call replaced when it took it over: a tie, or a module shared by two calls): the "
                    "model no longer uses it, so this step would train nothing. Build the optimizer after "
                    "fully_shard, from model.parameters()."
                )
            owner = unsharded_owner(p)
            if owner is not None:
                raise ValueError(
                    f"fullshard: {type(opt).__name__} holds the unsharded parameter {owner.fqn!r}, which "
                    "model.parameters() lists while its group is unsharded (after a forward, before its "
                    "backward); its gradient goes to the sharded parameter, so this step would not train it. "
                    "Build the optimizer from the sharded parameters: before the first forward, or after a "
                    "backward."
                )
