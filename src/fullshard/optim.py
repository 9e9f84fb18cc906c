"""Optimizers that step the local shards of a sharded model, without DTensor dispatch per operation.

``fullshard.optim.Adam``, ``AdamW`` and ``SGD`` are subclasses of torch's, with
the same arguments, param groups, state and ``state_dict()`` layout (state
tensors are ``DTensor``s sharded like their parameters, so
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, DCP checkpoints and
torch's own optimizers interchange with them). Only ``step()`` differs: it
hands the *local* tensors of parameters, gradients and state to torch's
functional implementation, with ``foreach`` kernels unless ``foreach=False``
is given, or with torch's fused kernel (Adam, AdamW) when ``fused=True`` is:
on CPU (CPU training, CPU offload) it is several times faster than foreach.
The arithmetic is torch's own, so results equal torch's optimizer with the
same options stepping the ``DTensor``s; what goes away is the dispatch of every
elementwise operation through ``DTensor`` (tens of microseconds per operation
and parameter). Plain (unsharded) parameters work too. ``capturable`` and
``differentiable`` fall back to torch's ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _adam
from torch.optim.sgd import sgd as _sgd

__all__ = ["SGD", "Adam", "AdamW", "Muon"]


def _local(t: torch.Tensor) -> torch.Tensor:
    # `_local_tensor` is the DTensor's local tensor itself: `to_local()` adds an autograd node per call.
    return t._local_tensor if isinstance(t, DTensor) else t


def _torch_steps(group: dict[str, Any]) -> bool:
    """Options whose step stays torch's."""
    return bool(group.get("capturable") or group.get("differentiable"))


def _foreach(group: dict[str, Any]) -> bool:
    return group.get("foreach") is not False


class _LocalAdamStep:
    """``step()`` of Adam / AdamW over local shards."""

    state: Any
    param_groups: list[dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if any(_torch_steps(g) for g in self.param_groups):
            return super().step(closure)  # type: ignore[misc]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
                if torch.is_complex(p):
                    return super().step(closure)  # type: ignore[misc]
                state = self.state[p]
                if not state:
                    # As torch: a CPU scalar (fused: on the parameter's device), float64 only under a float64 default.
                    double = torch.get_default_dtype() == torch.float64 and not group.get("fused")
                    state["step"] = torch.tensor(0.0, dtype=torch.float64 if double else torch.float32,
                                                 device=_local(p).device if group.get("fused") else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(_local(p))
                grads.append(_local(p.grad))
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            fused = bool(group.get("fused"))
            _adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                foreach=_foreach(group) and not fused, fused=fused or None,
                decoupled_weight_decay=group.get("decoupled_weight_decay", False),
                amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            )
        return loss


class Adam(_LocalAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` stepping local shards (see the module docstring)."""


class AdamW(_LocalAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` stepping local shards (see the module docstring)."""


class SGD(torch.optim.SGD):
    """``torch.optim.SGD`` stepping local shards (see the module docstring)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if any(_torch_steps(g) for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p.grad.is_sparse for p in with_grad):
                return super().step(closure)
            buffers = [self.state[p].get("momentum_buffer") for p in with_grad]
            local_buffers: list[torch.Tensor | None] = [None if b is None else _local(b) for b in buffers]
            _sgd(
                [_local(p) for p in with_grad], [_local(p.grad) for p in with_grad], local_buffers,
                foreach=_foreach(group), weight_decay=group["weight_decay"], momentum=group["momentum"],
                lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            )
            if group["momentum"] != 0:
                for p, before, local in zip(with_grad, buffers, local_buffers, strict=True):
                    if before is None and local is not None:  # created by this step: keep it sharded like p
                        self.state[p]["momentum_buffer"] = _like(p, local)
        return loss


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor sharded like ``p``."""
    if not isinstance(p, DTensor):
        return local
    return DTensor(local, p._spec, requires_grad=False)  # same shape, stride, dtype; `local` stays on its device


from fullshard.muon import Muon  # noqa: E402  (re-exported: fullshard.optim.Muon)
