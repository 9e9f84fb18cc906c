"""One original parameter's two faces: a sharded DTensor and an unsharded view."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.layout import ParamLayout
from fullshard.mesh import MeshInfo


@dataclass(frozen=True, eq=False)
class ParamSite:
    """One place a parameter is registered: ``module._parameters[name]``.

    A shared (tied) parameter has several sites; every one of them is swapped
    between the sharded and the unsharded parameter together.
    """

    module: nn.Module
    name: str


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class ShardedParam:
    """Holds the sharded and unsharded parameter of one original parameter.

    Neither face owns memory of its own: the sharded parameter's local tensor
    is a view into the group's flat shard buffer, and the unsharded parameter a
    view into the group's unsharded buffer. The objects are created once and
    live as long as the group, so optimizers, autograd's saved tensors and
    user references stay valid across every unshard/reshard.
    """

    def __init__(
        self, fqn: str, sites: list[ParamSite], original: nn.Parameter, layout: ParamLayout, mesh_info: MeshInfo
    ) -> None:
        self.fqn = fqn
        self.sites = sites
        self.layout = layout
        self.mesh_info = mesh_info
        self.orig_dtype = original.dtype
        # Weak: the original's memory must be freed once the modules drop it, but a
        # module outside this group that still holds it (a broken tie) must be detected.
        self.original_ref = weakref.ref(original)
        # Unsharded gradients kept across no-sync backwards when the reduce dtype differs.
        self.accumulated_grad: torch.Tensor | None = None
        self.sharded: nn.Parameter = original  # replaced by bind_shard
        self.unsharded: nn.Parameter = original  # replaced by bind_unsharded

    @property
    def requires_grad(self) -> bool:
        # The sharded parameter is what users and optimizers see; follow it.
        return self.sharded.requires_grad

    def local_rows(self, padded_chunk: torch.Tensor) -> torch.Tensor:
        """This rank's real rows inside its padded chunk of a flat buffer."""
        lay = self.layout
        return padded_chunk.view(lay.chunk_shape).narrow(lay.shard_dim, 0, lay.rows_on(self.mesh_info.shard_rank))

    def fill_shard(self, original: torch.Tensor, padded_chunk: torch.Tensor) -> None:
        """Copy this rank's rows of ``original`` into its chunk, zeroing the padding."""
        lay = self.layout
        rank = self.mesh_info.shard_rank
        rows = lay.rows_on(rank)
        padded_chunk.zero_()
        if rows:
            src = original.narrow(lay.shard_dim, rank * lay.chunk_rows, rows)
            self.local_rows(padded_chunk).copy_(src)

    def as_dtensor(self, padded_chunk: torch.Tensor) -> DTensor:
        lay = self.layout
        return DTensor.from_local(
            self.local_rows(padded_chunk),
            self.mesh_info.mesh,
            self.mesh_info.placements(lay.shard_dim),
            run_check=False,
            shape=torch.Size(lay.shape),
            stride=contiguous_stride(lay.shape),
        )

    def bind_shard(self, padded_chunk: torch.Tensor, requires_grad: bool) -> None:
        with torch.no_grad():
            self.sharded = nn.Parameter(self.as_dtensor(padded_chunk), requires_grad=requires_grad)

    def bind_unsharded(self, padded_full: torch.Tensor) -> None:
        """``padded_full``: this parameter's slice of the unsharded buffer."""
        lay = self.layout
        full = padded_full.view(lay.padded_shape).narrow(lay.shard_dim, 0, lay.dim_size)
        self.unsharded = nn.Parameter(full, requires_grad=self.requires_grad)

    def register(self, param: nn.Parameter) -> None:
        for site in self.sites:
            site.module._parameters[site.name] = param

    def register_unsharded(self) -> None:
        if self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)
        self.register(self.unsharded)
