"""Muon on sharded matrices: each matrix is orthogonalised whole, once, by one owner rank.

[Note: Sharded Muon]
Muon's update needs the whole matrix (Newton-Schulz iterations on ``U @ U.T``), while
FSDP leaves each rank with some rows of it. Gathering every matrix on every rank and
orthogonalising it everywhere costs a full all-gather and ``world_size`` times the
compute. Instead, per param group and shard group:

1. Momentum is elementwise, so it stays on the local rows (state ``momentum_buffer`` is
   a ``DTensor`` sharded like the parameter, as torch's Muon keeps it on DTensors).
2. Every matrix gets one owner rank, assigned greedily by Newton-Schulz cost
   (``rows * cols * min(rows, cols)``), the same on every rank.
3. One ``all_to_all_single`` sends each rank's rows of the update, in bf16 (torch's
   Newton-Schulz starts by casting to bf16, so this loses nothing), to the owners; each
   owner stacks the rows (dim-0 shards, in rank order) into the whole matrix.
4. The owner runs torch's own Newton-Schulz on it.
5. One more ``all_to_all_single`` returns every rank its rows of the result, which it
   applies locally (weight decay, then the update with torch's learning-rate adjustment).

A matrix sharded on dim 1 (``shard_placement_fn``) travels as its transpose, whose rows
are the columns each rank holds; the owner turns the stacked rows back into the matrix
before Newton-Schulz (so the iterations are those of the unsharded matrix, square ones
included) and sends each rank the rows of the result's transpose.

A matrix split over two mesh axes (tensor parallel under FSDP, placements such as
``(_StridedShard(0), Shard(0))`` or ``(Shard(0), Shard(1))``) has no one group whose rows
stack into it: its bf16 update is gathered whole on every rank of its mesh
(``full_tensor``), orthogonalised there, and each rank keeps its own part
(``distribute_tensor`` without communication). Newton-Schulz then runs once per rank,
not once per matrix, but on the whole matrix, so the step is the unsharded one (through
DTensor the iterations would run as sharded matrix products with bf16 partial sums).

Bytes on the wire per step: each matrix's bf16 rows travel to the owner and back, so
about the fp32 gradient's size in all (at most 2x the matrices' gradient bytes), against
``world_size - 1`` shards of fp32 per rank for gathering everything everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

__all__ = ["Muon", "servable", "sharded_step"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _rows_on(rows: int, world_size: int, rank: int) -> int:
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def _sharding(p: torch.Tensor) -> tuple[dist.ProcessGroup, int] | None:
    """The group over which ``p`` is split and the dim it is split on (0: rows, 1: columns), None when this
    rank holds it whole."""
    if not isinstance(p, DTensor):
        return None
    axes = [axis for axis, placement in enumerate(p.placements) if not placement.is_replicate()]
    if not axes:
        return None
    group = p.device_mesh.get_group(axes[0])
    return None if dist.get_world_size(group) == 1 else (group, cast(Shard, p.placements[axes[0]]).dim)


def _one_split(p: DTensor) -> bool:
    """Whether ``p`` is split over at most one mesh axis, by rows or by columns (``Shard``, not ``Partial``)."""
    split = [pl for pl in p.placements if not pl.is_replicate()]
    return len(split) <= 1 and all(pl.is_shard(0) or pl.is_shard(1) for pl in split)


def servable(opt: torch.optim.Optimizer) -> bool:
    """Whether :func:`sharded_step` can run ``opt`` (torch's Muon): every parameter with a gradient plain, or a ``DTensor``
    split by ``Shard`` placements (no ``Partial``) with its gradient placed alike."""
    for group in opt.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is None or (type(p) is not DTensor and type(grad) is not DTensor):
                continue
            if type(p) is not DTensor or type(grad) is not DTensor or grad._spec != p._spec or \
                    any(pl.is_partial() for pl in p.placements):
                return False
    return True


def owners(shapes: list[torch.Size], world_size: int) -> list[int]:
    """An owner rank per matrix, balancing Newton-Schulz cost (largest first, to the least loaded rank)."""
    load = [0] * world_size
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1] * min(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += shapes[i][0] * shapes[i][1] * min(shapes[i])
    return owner


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (same arguments, param groups, state and ``state_dict()``) for sharded 2-D parameters.

    See [Note: Sharded Muon]. Results equal torch's Muon on the unsharded model up to the
    order of floating-point sums: the Newton-Schulz iterations are torch's own, run once per
    matrix on its owner. Parameters that are not ``DTensor``s (or not sharded) are
    orthogonalised locally. As with torch's, other parameters (embeddings, norms, biases)
    belong to another optimizer.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded_step(self)
        return loss


@torch.no_grad()
def sharded_step(opt: torch.optim.Optimizer) -> None:
    """One step of ``opt`` (``torch.optim.Muon``'s hyperparameters and state) on the local shards, each matrix
    orthogonalised whole ([Note: Sharded Muon]); torch's refusals (complex, sparse) kept."""
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        _check(group, params)
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        updates = []
        for p in params:
            state = opt.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        for p, rows in zip(params, _orthogonalise(params, updates, ns)):
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(rows, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def _check(group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """torch's refusals, made on every rank before any collective: Newton-Schulz runs on the owner rank only, so
    its own argument checks would fail there alone and leave the other ranks waiting in the all-to-all."""
    for p in params:
        grad = cast(torch.Tensor, p.grad)  # params: those with a gradient
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        if grad.ndim != 2:  # a parameter added by add_param_group, which does not check
            raise ValueError(f"Muon: every parameter's gradient must be a 2D matrix, got shape {tuple(grad.shape)}")
    if params and group["ns_steps"] >= 100:
        raise ValueError(f"Muon: ns_steps must be less than 100, got {group['ns_steps']}")
    if params and len(group["ns_coefficients"]) != 3:
        raise ValueError(f"Muon: ns_coefficients must be 3 values, got {group['ns_coefficients']!r}")


def _orthogonalise(params: list[torch.Tensor], updates: list[torch.Tensor], ns: tuple[Any, ...]) -> list[torch.Tensor]:
    """Each parameter's rows of the orthogonalised update (bf16)."""
    results: list[torch.Tensor | None] = [None] * len(params)
    by_group: dict[dist.ProcessGroup, list[int]] = {}
    columns: set[int] = set()  # split on dim 1: travel as their transpose (see the Note)
    for i, p in enumerate(params):
        if isinstance(p, DTensor) and not _one_split(p):  # tensor parallel under FSDP: see the Note
            results[i] = _orthogonalise_whole(p, updates[i], ns)
            continue
        sharding = _sharding(p)
        if sharding is None:
            results[i] = _zeropower_via_newtonschulz(updates[i], *ns)
            continue
        group, dim = sharding
        by_group.setdefault(group, []).append(i)
        if dim == 1:
            columns.add(i)
    for group, indices in by_group.items():
        shapes = [torch.Size(reversed(params[i].shape)) if i in columns else params[i].shape for i in indices]
        local = [updates[i].T if i in columns else updates[i] for i in indices]
        transposed = [i in columns for i in indices]
        for i, rows in zip(indices, _orthogonalise_on(group, shapes, local, ns, transposed)):
            results[i] = rows.T if i in columns else rows
    return [r for r in results if r is not None]


def _orthogonalise_whole(p: DTensor, update: torch.Tensor, ns: tuple[Any, ...]) -> torch.Tensor:
    """This rank's part of the orthogonalised update of ``p``, a matrix split over several mesh axes, gathered whole
    on every rank of its mesh (bf16: Newton-Schulz casts to it first) and orthogonalised there."""
    mesh, placements = p.device_mesh, p.placements
    whole = DTensor.from_local(update.to(torch.bfloat16), mesh, placements, run_check=False, shape=p.shape,
                               stride=p.stride()).full_tensor()
    return distribute_tensor(_zeropower_via_newtonschulz(whole, *ns), mesh, placements, src_data_rank=None).to_local()


def _orthogonalise_on(
    group: dist.ProcessGroup, shapes: list[torch.Size], updates: list[torch.Tensor], ns: tuple[Any, ...],
    transposed: list[bool],
) -> list[torch.Tensor]:
    """[Note: Sharded Muon] steps 2-5 for the matrices of one shard group (every rank calls it alike);
    ``shapes`` and ``updates`` as they travel, ``transposed`` where that is the matrix's transpose."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = owners(shapes, world_size)
    device = updates[0].device
    comm_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else device
    cols = [shape[1] for shape in shapes]

    def rows(i: int, r: int) -> int:
        return _rows_on(shapes[i][0], world_size, r)

    # Step 3: my rows of every matrix, grouped by owner.
    send = torch.cat([updates[i].to(comm_device, torch.bfloat16).reshape(-1)
                      for dest in range(world_size) for i in range(len(shapes)) if owner[i] == dest] or
                     [torch.empty(0, dtype=torch.bfloat16, device=comm_device)])
    send_splits = [sum(rows(i, rank) * cols[i] for i in range(len(shapes)) if owner[i] == dest) for dest in range(world_size)]
    mine = [i for i in range(len(shapes)) if owner[i] == rank]
    recv_splits = [sum(rows(i, src) * cols[i] for i in mine) for src in range(world_size)]
    received = torch.empty(sum(recv_splits), dtype=torch.bfloat16, device=comm_device)
    dist.all_to_all_single(received, send, recv_splits, send_splits, group=group)

    # Step 4: whole matrices on their owner.
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    offset = 0
    for src in range(world_size):
        for i in mine:
            n = rows(i, src) * cols[i]
            pieces[i].append(received.narrow(0, offset, n).view(rows(i, src), cols[i]))
            offset += n
    ortho = {}
    for i in mine:
        whole = torch.cat(pieces[i])
        if transposed[i]:
            ortho[i] = _zeropower_via_newtonschulz(whole.T.contiguous(), *ns).T
        else:
            ortho[i] = _zeropower_via_newtonschulz(whole, *ns)

    # Step 5: every rank's rows back.
    starts = {i: [sum(rows(i, r) for r in range(s)) for s in range(world_size)] for i in mine}
    back = torch.cat([ortho[i].narrow(0, starts[i][dest], rows(i, dest)).reshape(-1)
                      for dest in range(world_size) for i in mine] or
                     [torch.empty(0, dtype=torch.bfloat16, device=comm_device)])
    back_recv = torch.empty(sum(send_splits), dtype=torch.bfloat16, device=comm_device)
    dist.all_to_all_single(back_recv, back.contiguous(), send_splits, recv_splits, group=group)
    out: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
    offset = 0
    for dest in range(world_size):
        for i in range(len(shapes)):
            if owner[i] == dest:
                n = rows(i, rank) * cols[i]
                out[i] = back_recv.narrow(0, offset, n).view(rows(i, rank), cols[i]).to(device)
                offset += n
    return out
