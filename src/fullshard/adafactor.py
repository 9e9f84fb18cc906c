"""torch's ``Adafactor`` on fullshard's parameters: its reductions summed across the shards.

[Note: Sharded Adafactor]
``torch.optim.Adafactor`` is not elementwise. Per parameter it takes the norm of the
whole parameter and of the whole update (the step size and its clipping), and for a
matrix (the last two dims) the mean of the squared gradient over each row and over each
column, and the mean of the row factor over the rows. On a parameter split by rows across
ranks, the column means and the row-factor mean run over rows that other ranks hold.
Through DTensor torch's step fails (an in-place square of a partial norm: the same error
on FSDP2's parameters); run on the local shards it would be silently wrong.

So fullshard runs the step itself, on the local tensors, with the same formulas and
every reduction over a split dimension summed across the ranks that split it: a sum of
squares per shard, then one all-reduce per process group and phase. Three phases per
step: the parameter norms and the gradient's row and column means (before any update),
the row factor's mean (after its update), the update norms. Sums are taken in float32
(float64 for float64 parameters) and cast back to the state's dtype.

State is torch's, as ``DTensor``s on the parameter's mesh: ``step`` (a plain 0-dim
tensor), ``variance`` for parameters of fewer than two dims, sharded like the parameter,
and ``row_var`` (the parameter's shape with the last dim 1) and ``col_var`` (second-last
dim 1), each placed like the parameter except ``Replicate`` on mesh axes that split the
dim it is reduced over (a matrix split by rows keeps its rows' ``row_var`` and the whole
``col_var`` on every rank). A full state dict therefore holds exactly the unsharded
optimizer's tensors; state loaded with another placement (a full state dict distributed
like the parameter, say) is redistributed at the next step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.group import group_of

__all__ = ["servable", "step"]


def servable(opt: torch.optim.Optimizer) -> bool:
    """Whether every parameter with a gradient is a plain tensor or a ``DTensor`` without ``Partial`` placements
    (fullshard's, or tensor parallel's) whose gradient is placed like it. A local tensor may be a subclass (an
    all-gather extension's weight): the step runs torch's operations on it, as torch's own would."""
    for group in opt.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue  # the step skips it
            if type(p) is not DTensor:
                if type(p) not in (torch.Tensor, torch.nn.Parameter) or type(grad) is not torch.Tensor:
                    return False
                continue
            if any(isinstance(pl, Partial) for pl in p.placements):
                return False
            if not (type(grad) is DTensor and grad._spec == p._spec):
                return False
    return True


@dataclass
class _Param:
    """One parameter's step: its local tensors and the process groups that split each of its dims."""

    param: torch.Tensor  # the real parameter: the state's key, and its global shape
    local: torch.Tensor
    grad: torch.Tensor  # local, negated for ``maximize``
    state: dict[str, Any]
    groups: dict[int | None, list[dist.ProcessGroup]]  # tensor dim (None: any) -> the groups that split it
    device: torch.device  # where its collectives run
    hyper: dict[str, Any]
    eps1: float
    alpha: float = 0.0
    row_sq: torch.Tensor | None = None  # sum of squares of the gradient over each row (over the last dim)
    col_sq: torch.Tensor | None = None  # ... over each column (over the second-last dim)

    @property
    def factored(self) -> bool:
        return self.param.dim() > 1

    def over(self, dim: int | None) -> tuple[list[dist.ProcessGroup], torch.device]:
        return self.groups.get(dim, []), self.device


def _split_dim(placement: Placement, ndim: int) -> int | None:
    """The tensor dim a placement splits (``Shard``, or FSDP + TP's ``_StridedShard``, which is no ``Shard``)."""
    return placement.dim % ndim if isinstance(placement, (Shard, _StridedShard)) else None


def _split_by(p: torch.Tensor) -> dict[int | None, list[dist.ProcessGroup]]:
    if type(p) is not DTensor:
        return {}
    groups: dict[int | None, list[dist.ProcessGroup]] = {None: []}
    for axis, placement in enumerate(p.placements):
        dim = _split_dim(placement, p.dim())
        if dim is not None:
            group = p.device_mesh.get_group(axis)
            groups.setdefault(dim, []).append(group)
            groups[None].append(group)
    return groups


def _placements(p: DTensor, reduced_dim: int | None) -> tuple[Placement, ...]:
    """``p``'s placements, ``Replicate`` on the axes that split ``reduced_dim`` (a state dim of size 1)."""
    return tuple(Replicate() if reduced_dim is not None and _split_dim(pl, p.dim()) == reduced_dim else pl
                 for pl in p.placements)


def _placed(p: torch.Tensor, value: Any, shape: list[int], reduced_dim: int | None) -> torch.Tensor:
    """State of ``shape`` for ``p`` as [Note: Sharded Adafactor] places it: zeros for a missing entry
    (``value`` None), and a loaded entry that is placed otherwise (or is a full tensor) re-placed."""
    if type(p) is not DTensor:
        if value is None:
            return torch.zeros(shape, dtype=p.dtype, device=p.device)
        return value.full_tensor() if isinstance(value, DTensor) else value
    placements = _placements(p, reduced_dim)
    if type(value) is DTensor:
        if value.placements == placements and value.device_mesh == p.device_mesh:
            return value
        return value.redistribute(p.device_mesh, placements)
    if value is not None:  # a full tensor, the same on every rank
        return distribute_tensor(value.to(p._local_tensor.device), p.device_mesh, placements, src_data_rank=None)
    local_shape = list(p._local_tensor.shape)
    if reduced_dim is not None:
        local_shape[reduced_dim] = 1
    local = torch.zeros(local_shape, dtype=p.dtype, device=p._local_tensor.device)
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _init_state(p: torch.Tensor, state: dict[str, Any]) -> None:
    """torch's state for ``p``, placed as [Note: Sharded Adafactor] says."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    wanted: dict[str, int | None] = {"row_var": p.dim() - 1, "col_var": p.dim() - 2} if p.dim() > 1 else {"variance": None}
    for key, dim in wanted.items():
        shape = list(p.shape)
        if dim is not None:
            shape[dim] = 1
        state[key] = _placed(p, state.get(key), shape, dim)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if type(t) is DTensor else t


def _sum_across(parts: Iterable[tuple[torch.Tensor, list[dist.ProcessGroup], torch.device]]) -> None:
    """Sum each tensor in place over the ranks of each of its groups: one all-reduce per group and dtype."""
    batches: dict[tuple[dist.ProcessGroup, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor, groups, device in parts:
        for group in groups:
            batches.setdefault((group, device, tensor.dtype), []).append(tensor)
    for (group, device, _), tensors in batches.items():  # the same order on every rank: the parameters' order
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
        dist.all_reduce(flat, group=group)
        flat = flat.to(tensors[0].device)  # back from the device to offloaded shards' host memory
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(piece.view_as(t))


def _sq(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sum of squares of ``t`` (over ``dim``, kept), in float32 at least."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    if dim is None:
        return torch.linalg.vector_norm(t, dtype=dtype).square()
    return torch.linalg.vector_norm(t, dim=dim, keepdim=True, dtype=dtype).square_()


def _sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of ``t`` over ``dim`` (kept), in float32 at least."""
    return t.sum(dim=dim, keepdim=True, dtype=torch.promote_types(t.dtype, torch.float32))


@torch.no_grad()
def step(opt: torch.optim.Optimizer) -> None:
    """One ``Adafactor`` step of ``opt`` (torch's class, hyperparameters and state) on the local shards."""
    entries: list[_Param] = []
    for group in opt.param_groups:
        eps1 = group["eps"][0]  # None: the first stepped parameter's dtype's, for the whole group (as torch)
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Adafactor does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Adafactor does not support sparse gradients")
            state = opt.state[p]
            _init_state(p, state)
            owner = group_of(p) if type(p) is DTensor else None  # its collectives run where its group's do
            grad = _local(p.grad)
            eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
            entries.append(_Param(
                p, _local(p), -grad if group["maximize"] else grad, state, _split_by(p),
                owner.device if owner is not None else _local(p).device, group, eps1,
            ))
    if not entries:
        return
    factored = [e for e in entries if e.factored]

    # Phase 1 (nothing changed yet): parameter norms, the gradient's row and column sums of squares.
    norms = [_sq(e.local) for e in entries]
    parts = [(n, *e.over(None)) for n, e in zip(norms, entries, strict=True)]
    for e in factored:
        rows, cols = e.param.dim() - 1, e.param.dim() - 2
        e.row_sq, e.col_sq = _sq(e.grad, rows), _sq(e.grad, cols)
        parts += [(e.row_sq, *e.over(rows)), (e.col_sq, *e.over(cols))]
    _sum_across(parts)
    for e, norm in zip(entries, _values(norms), strict=True):
        _decay_and_moments(e, norm)

    # Phase 2: the row factor's mean over the rows.
    row_sums = [_sum(_local(e.state["row_var"]), e.param.dim() - 2) for e in factored]
    _sum_across((s, *e.over(e.param.dim() - 2)) for s, e in zip(row_sums, factored, strict=True))
    sums = dict(zip(map(id, factored), row_sums, strict=True))
    updates = [_update(e, sums.get(id(e))) for e in entries]

    # Phase 3: the update norms, then the update.
    norms = [_sq(u) for u in updates]
    _sum_across((n, *e.over(None)) for n, e in zip(norms, entries, strict=True))
    for e, u, norm in zip(entries, updates, _values(norms), strict=True):
        denom = max(1.0, math.sqrt(norm) / (math.sqrt(e.param.numel()) * e.hyper["d"]))
        e.local.add_(u, alpha=-e.alpha / denom)


def _values(scalars: list[torch.Tensor]) -> list[float]:
    """0-dim tensors as floats, with one wait for the device."""
    return torch.stack([s.to(scalars[0].device, torch.float64) for s in scalars]).tolist()


def _lr(hyper: dict[str, Any]) -> float:
    lr = hyper["lr"]
    return lr.item() if isinstance(lr, torch.Tensor) else float(lr)


def _decay_and_moments(e: _Param, norm_sq: float) -> None:
    """Count the step, set the step size from the parameter's norm, decay the weights, move the moments."""
    hyper, lr = e.hyper, _lr(e.hyper)
    e.state["step"] += 1
    t = e.state["step"].item()
    weight = t ** hyper["beta2_decay"]  # torch's 1 - beta2_t
    e.alpha = max(hyper["eps"][1], math.sqrt(norm_sq) / math.sqrt(e.param.numel())) * min(lr, 1 / t ** 0.5)
    if hyper["weight_decay"] != 0:
        e.local.mul_(1 - lr * hyper["weight_decay"])
    if not e.factored:
        _local(e.state["variance"]).lerp_(e.grad * e.grad, weight)
        return
    assert e.row_sq is not None and e.col_sq is not None
    row_var, col_var = _local(e.state["row_var"]), _local(e.state["col_var"])
    row_var.lerp_(e.row_sq.div_(e.param.shape[-1]).to(row_var.dtype), weight)
    col_var.lerp_(e.col_sq.div_(e.param.shape[-2]).to(col_var.dtype), weight)
    e.row_sq = e.col_sq = None


def _update(e: _Param, row_sum: torch.Tensor | None) -> torch.Tensor:
    """The unclipped update: the gradient over the square root of the second-moment estimate."""
    if row_sum is None:
        estimate = _local(e.state["variance"]).clone()
    else:
        row_var, col_var = _local(e.state["row_var"]), _local(e.state["col_var"])
        mean = row_sum.div_(e.param.shape[-2]).clamp_(min=e.eps1).to(row_var.dtype)
        estimate = (row_var @ col_var).div_(mean)
    return estimate.clamp_(min=e.eps1 * e.eps1).rsqrt_().mul_(e.grad)
