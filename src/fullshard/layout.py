"""Sharding arithmetic: which rows of which parameter each rank owns, and where.

Pure value objects, no process group and no tensors, so every offset can be
unit-tested in one process.

[Note: Vocabulary]
The same words are used in identifiers throughout the package:

- *original parameter*: the ``nn.Parameter`` the user created.
- *sharded parameter*: the ``DTensor`` parameter registered on the module while
  its group is sharded. Its local tensor is a view into the flat shard buffer.
- *flat shard buffer*: one contiguous 1-D tensor per group and rank holding this
  rank's padded shard of every parameter of the group, in parameter order.
- *all-gather input*: what a rank contributes to the all-gather, the flat shard
  buffer itself (or its cast to the compute dtype).
- *all-gather output*: ``world_size`` flat shard buffers back to back,
  rank-major.
- *unsharded buffer*: every parameter's padded full tensor back to back,
  parameter-major. It is the all-gather output reordered by one copy.
- *unsharded parameter*: the plain ``nn.Parameter`` registered while the group
  is unsharded, a view into the unsharded buffer.
- *flat gradient buffer*: like the flat shard buffer, but over the parameters
  that received a gradient in this backward; the sharded gradients are views
  into it.

[Note: Padding]
A parameter with ``n`` rows along its shard dim is cut into ``world_size``
chunks of ``ceil(n / world_size)`` rows, the rule ``torch.chunk`` and
``DTensor``'s ``Shard`` use. The last ranks may own fewer rows, or none. Every
rank reserves a full chunk in its flat shard buffer regardless, so that all
ranks contribute equal-size all-gather inputs. Two ranks, parameters ``a`` with
5 rows and ``b`` with 2 rows (one element per row)::

    rank 0 flat shard buffer:  a0 a1 a2 | b0
    rank 1 flat shard buffer:  a3 a4 __ | b1        (__ = padding)
    all-gather output:         a0 a1 a2 b0 a3 a4 __ b1       (rank-major)
    unsharded buffer:          a0 a1 a2 a3 a4 __ | b0 b1     (parameter-major)

``a`` is the first 5 rows of the unsharded buffer's first 6 rows; ``b`` the
next 2.

[Note: Replicated scalars]
A 0-dim parameter has no dimension to cut: every rank keeps the whole value
(its sharded parameter is a ``Replicate`` DTensor, as torch's optimizers,
``clip_grad_norm_`` and DCP expect of a replicated tensor). Its layout cuts the
shape ``(world_size,)`` instead, one row per rank, so each rank's flat shard
buffer holds its own copy and the flat buffers, the all-gather and the
reduce-scatter need nothing of their own for it. The unsharded parameter views
rank 0's copy. Its gradient is packed into rank 0's row only (zeros in the
others), so the reduce-scatter leaves the sum on rank 0, and one all-reduce
over the shard ranks then gives every rank that same sum, bit for bit (a
reduce-scatter of the gradient into every row would sum each row in another
order on NCCL), so the copies step alike and stay equal.

[Note: Uneven cuts off dim 0]
Cut on dim 0, a rank's real rows are the first elements of its padded chunk
and a parameter is the first elements of its padded full tensor, so both stay
contiguous. Cut on another dim into chunks that do not divide it (torch's FSDP2
refuses these), the padding would sit inside every row instead: a (3, 5)
weight on dim 1 over 2 ranks pads each row to 6 columns, and the partial rank's
(3, 2) rows and the (3, 5) unsharded parameter would be strided views. Such a
layout is *compact*: each rank's rows are stored contiguously at the start of
its slot (the padding is the slot's tail), and the unsharded parameter is the
contiguous start of its region of the unsharded buffer. Moving rows between
slots and the full tensor then takes one copy per rank (``slots_to_full`` and
``full_to_slots`` in param.py) instead of one strided copy; every other path
(flat buffers, collectives, elementwise optimizer steps, norms over the flat
gradients) sees the same slots and zero padding as for any layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ParamLayout:
    """One parameter cut along ``shard_dim`` into ``world_size`` padded chunks."""

    shape: tuple[int, ...]
    shard_dim: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.shard_dim < len(self._cut):
            raise ValueError(f"shard dim {self.shard_dim} is out of range for shape {self.shape}")
        if self.world_size < 1:
            raise ValueError(f"world size must be positive, got {self.world_size}")

    @cached_property
    def replicated(self) -> bool:
        """A 0-dim parameter, whole on every rank ([Note: Replicated scalars])."""
        return not self.shape

    @cached_property
    def _cut(self) -> tuple[int, ...]:
        """The shape the flat buffers cut: one row per rank for a 0-dim parameter."""
        return (self.world_size,) if self.replicated else self.shape

    @cached_property
    def dim_size(self) -> int:
        return self._cut[self.shard_dim]

    @cached_property
    def chunk_rows(self) -> int:
        """Rows of the shard dim each rank reserves (the padded chunk)."""
        return math.ceil(self.dim_size / self.world_size)

    @cached_property
    def row_numel(self) -> int:
        """Elements in one row, i.e. one index along the shard dim."""
        return math.prod(self._cut) // self.dim_size if self.dim_size else 0

    @cached_property
    def chunk_shape(self) -> tuple[int, ...]:
        return self._with_shard_dim(self.chunk_rows)

    @cached_property
    def shard_numel(self) -> int:
        """Elements one rank reserves in its flat shard buffer, padding included."""
        return self.chunk_rows * self.row_numel

    @cached_property
    def padded_shape(self) -> tuple[int, ...]:
        return self._with_shard_dim(self.chunk_rows * self.world_size)

    @cached_property
    def unsharded_numel(self) -> int:
        """Elements in the unsharded buffer, padding included."""
        return self.shard_numel * self.world_size

    @cached_property
    def is_even(self) -> bool:
        return self.dim_size % self.world_size == 0

    @cached_property
    def compact(self) -> bool:
        """Cut unevenly on a dim other than 0: rows stored at the start of each slot ([Note: Uneven cuts off
        dim 0])."""
        return self.shard_dim != 0 and not self.is_even and not self.replicated

    def rows_on(self, rank: int) -> int:
        """Real (unpadded) rows that ``rank`` owns: a full chunk, a partial one, or 0."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return max(0, min(self.chunk_rows, self.dim_size - rank * self.chunk_rows))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.shape if self.replicated else self._with_shard_dim(self.rows_on(rank))

    def _with_shard_dim(self, rows: int) -> tuple[int, ...]:
        shape = list(self._cut)
        shape[self.shard_dim] = rows
        return tuple(shape)


@dataclass(frozen=True)
class GroupLayout:
    """Parameters of one group, packed back to back in the flat buffers."""

    params: tuple[ParamLayout, ...]

    def __post_init__(self) -> None:
        sizes = {p.world_size for p in self.params}
        if len(sizes) > 1:
            raise ValueError(f"parameters of one group disagree on the world size: {sorted(sizes)}")

    @property
    def world_size(self) -> int:
        return self.params[0].world_size if self.params else 1

    @cached_property
    def shard_offsets(self) -> tuple[int, ...]:
        """Start of each parameter's chunk in the flat shard buffer."""
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += p.shard_numel
        return tuple(offsets)

    @cached_property
    def shard_numel(self) -> int:
        """Length of the flat shard buffer (every rank's is the same)."""
        return sum(p.shard_numel for p in self.params)

    @cached_property
    def shard_numels(self) -> tuple[int, ...]:
        return tuple(p.shard_numel for p in self.params)

    @cached_property
    def replicated_offsets(self) -> tuple[int, ...]:
        """Where the replicated (0-dim) parameters sit in the flat shard buffer ([Note: Replicated scalars])."""
        return tuple(off for p, off in zip(self.params, self.shard_offsets) if p.replicated)

    @property
    def unsharded_offsets(self) -> tuple[int, ...]:
        """Start of each padded parameter in the unsharded buffer."""
        return tuple(off * self.world_size for off in self.shard_offsets)

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def subset(self, keep: tuple[bool, ...]) -> GroupLayout:
        """The layout of the parameters flagged in ``keep``, packed anew (gradients)."""
        if len(keep) != len(self.params):
            raise ValueError(f"mask of length {len(keep)} for {len(self.params)} parameters")
        return GroupLayout(tuple(p for p, k in zip(self.params, keep) if k))


def is_float8(dtype: torch.dtype) -> bool:
    """A one-byte float: torch does not promote it and gloo cannot carry it, so fullshard moves its bytes."""
    return dtype.is_floating_point and dtype.itemsize == 1
