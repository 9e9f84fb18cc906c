"""How a parameter travels in its group's all-gather when it is not the plain cast of its shard.

[Note: Packed all-gather]
A group whose parameters all travel as their shard cast to the compute dtype
all-gathers its flat shard buffer (``collectives.all_gather``). A group with a
parameter that travels otherwise - a tensor subclass with FSDP2's
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks, or the int8 weights of
:class:`QuantizedCommPolicy` - gives every parameter a *codec*:

- ``encode(chunk)`` turns this rank's padded chunk (original dtype, on the
  device) into one or more tensors of any dtype, the same sizes on every rank;
- the group packs every parameter's tensors into one byte buffer (each at an
  offset aligned to 16 bytes) and all-gathers it: still one collective per
  group;
- ``decode(parts)`` gets each of its tensors back from every rank, rank-major
  (``(world_size, numel)``), and writes the unsharded parameter.

Codecs run on the all-gather stream (encode) and the compute stream (decode).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fullshard.layout import is_float8
from fullshard.mesh import MeshInfo
from fullshard.param import ShardedParam, contiguous_stride, rank_axis_view, slots_to_full, unsharded_view
from fullshard.policy import MixedPrecisionPolicy


@dataclass(frozen=True)
class QuantizedCommPolicy:
    """Communicate in low precision: int8 weights in the all-gather, bf16 gradients in the reduce-scatter.

    - Parameters with at least ``min_ndim`` dims (weight matrices, embeddings) are
      all-gathered as int8 in blocks of ``block_size`` elements of the flattened
      shard, each block with its fp32 absmax scale, and dequantized into the compute
      dtype after the gather. Other parameters (norms, biases; complex, integer and
      one-byte float ones whatever their dims) travel as they are.
    - Gradients are reduce-scattered in ``reduce_dtype`` (bf16 by default) and
      accumulated into fp32 sharded gradients; backwards without sync sum them unsharded
      in the compute dtype, and HSDP partial sums stay in it, never in a lower ``reduce_dtype``. A
      ``MixedPrecisionPolicy.reduce_dtype`` given as well must agree.
    - Sharded parameters and the optimizer stay in full precision: only the
      forward/backward copies carry the quantization error.

    Bytes on the wire against fp32: all-gather ``(1 + 4 / block_size) / 4`` (0.258x at
    128), reduce-scatter 0.5x.
    """

    block_size: int = 128
    reduce_dtype: torch.dtype = torch.bfloat16
    min_ndim: int = 2


def validate_comm_policy(policy: object) -> QuantizedCommPolicy | None:
    if policy is None:
        return None
    if not isinstance(policy, QuantizedCommPolicy):
        raise TypeError(f"comm_policy must be a QuantizedCommPolicy or None, got {type(policy).__name__}")
    if isinstance(policy.block_size, bool) or not isinstance(policy.block_size, int) or policy.block_size < 1:
        raise ValueError(f"QuantizedCommPolicy.block_size must be a positive int, got {policy.block_size!r}")
    if not isinstance(policy.reduce_dtype, torch.dtype) or not policy.reduce_dtype.is_floating_point:
        raise ValueError(f"QuantizedCommPolicy.reduce_dtype must be a floating-point torch.dtype, got {policy.reduce_dtype!r}")
    if isinstance(policy.min_ndim, bool) or not isinstance(policy.min_ndim, int) or policy.min_ndim < 1:
        raise ValueError(f"QuantizedCommPolicy.min_ndim must be a positive int, got {policy.min_ndim!r}")
    return policy


class CodecGroup(Protocol):
    """What the codecs read of their parameter group (:class:`fullshard.group.ParamGroup`).

    A protocol rather than the class itself, so that imports flow one way: group -> codec.
    """

    @property
    def params(self) -> list[ShardedParam]: ...

    @property
    def mixed(self) -> bool: ...

    @property
    def mesh_info(self) -> MeshInfo: ...

    def param_compute_dtype(self, p: ShardedParam) -> torch.dtype: ...


class Codec:
    """A parameter sent as its shard cast to the compute dtype (the default, inside a packed group)."""

    lossy = False  # whether decode may give other values than the shard's (besides the cast)

    def __init__(self, param: ShardedParam, group: CodecGroup) -> None:
        self.param = param
        self.group = group

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.group.param_compute_dtype(self.param)

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.to(self.compute_dtype)]

    def decode(self, parts: list[torch.Tensor], region: torch.Tensor) -> None:
        self._write(parts[0], region)

    def _write(self, rank_major: torch.Tensor, region: torch.Tensor) -> None:
        """Copy ``(world_size, shard_numel)`` chunks into this parameter's slice of the unsharded buffer."""
        lay = self.param.layout
        world_size = rank_major.shape[0]
        if lay.compact:
            slots_to_full(rank_major, unsharded_view(region, lay), lay)
            return
        full = region.view(lay.padded_shape)
        rank_axis_view(full, lay.shard_dim, world_size).copy_(rank_major.view(world_size, *lay.chunk_shape))

    def reshard(self) -> None:
        """The group freed its unsharded buffer; free what this codec holds besides."""


class Int8BlockCodec(Codec):
    """int8 in blocks with fp32 absmax scales (:class:`QuantizedCommPolicy`)."""

    lossy = True

    def __init__(self, param: ShardedParam, group: CodecGroup, block_size: int) -> None:
        super().__init__(param, group)
        self.block_size = block_size
        self.numel = param.layout.shard_numel
        self.blocks = math.ceil(self.numel / block_size)

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        x = chunk.float()
        pad = self.blocks * self.block_size - self.numel
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        blocks = x.view(self.blocks, self.block_size)
        scale = blocks.abs().amax(dim=1).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
        q = torch.round(blocks / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
        return [q.view(-1), scale]

    def decode(self, parts: list[torch.Tensor], region: torch.Tensor) -> None:
        q, scale = parts
        world_size = q.shape[0]
        values = q.view(world_size, self.blocks, self.block_size).to(self.compute_dtype)
        values.mul_(scale.view(world_size, self.blocks, 1).to(self.compute_dtype))
        self._write(values.view(world_size, -1)[:, : self.numel], region)


class ExtensionCodec(Codec):
    """A tensor subclass that defines FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

    ``encode`` calls ``fsdp_pre_all_gather`` on the subclass wrapping this rank's padded
    chunk (so uneven shards just work) and keeps its metadata for ``decode``, which calls
    ``fsdp_post_all_gather`` with each all-gather output shaped
    ``(world_size * size[0], *size[1:])``. As in FSDP2, its first result becomes the
    unsharded parameter for good (cut to the parameter's shape); the outputs it was given
    are kept, refilled by every later all-gather, and passed again with ``out=`` the
    unsharded parameter, so a result that views them stays valid; those outputs and the
    inner tensors the hook names are freed at reshard. The group's unsharded buffer still
    reserves the parameter's slot (unused).
    """

    def __init__(self, param: ShardedParam, group: CodecGroup, mesh: Any, module: nn.Module,
                 mp_policy: MixedPrecisionPolicy) -> None:
        super().__init__(param, group)
        self.mesh = mesh
        self.module = module
        self.mp_policy = mp_policy
        self.metadata: Any = None
        self.sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []  # all-gather outputs kept for the hook (freed at reshard)
        self.inner: tuple[torch.Tensor, ...] = ()  # tensors the hook asked to free at reshard

    def encode(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        p = self.param
        local = p.wrap_local(chunk.view(p.layout.chunk_shape))
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if len(inspect.signature(hook).parameters) == 1:
            inputs, self.metadata = hook(self.mesh)
        else:
            inputs, self.metadata = hook(self.mesh, torch.Size(p.shape), tuple(p.sharded.stride()), self.module,
                                         self.mp_policy)
        self.sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def decode(self, parts: list[torch.Tensor], region: torch.Tensor) -> None:
        p = self.param
        world_size = parts[0].shape[0]
        views = [part.view(world_size * size[0], *size[1:]) if len(size) else part.view(-1)
                 for part, size in zip(parts, self.sizes)]
        hook = p.sharded.to_local().fsdp_post_all_gather  # type: ignore[attr-defined]
        if self.outputs:  # the unsharded parameter may view these: refill them, then let the hook update it
            for kept, new in zip(self.outputs, views):
                kept.untyped_storage().resize_(kept.numel() * kept.element_size())
                kept.data.copy_(new)  # `.data`: a result viewing it keeps its version (autograd saved it)
            for t in self.inner:
                t.untyped_storage().resize_(t.numel() * t.element_size())
            with torch.autograd._unsafe_preserve_version_counter(p.unsharded):
                hook(tuple(self.outputs), self.metadata, self.compute_dtype, out=p.unsharded)
            return
        self.outputs = [v.clone() for v in views]
        result, inner = hook(tuple(self.outputs), self.metadata, self.compute_dtype)
        self.inner = tuple(inner)
        if tuple(result.shape) != p.shape:  # padded rows at the end: cut, as FSDP2 does
            result = torch.as_strided(result, p.shape, contiguous_stride(p.shape), 0)
        p.set_unsharded(nn.Parameter(result, requires_grad=p.requires_grad))

    def reshard(self) -> None:
        for t in (*self.outputs, *self.inner):
            t.untyped_storage().resize_(0)


def quantizable(dtype: torch.dtype) -> bool:
    """Whether int8 blocks may carry a parameter of ``dtype``: real floats wider than a byte."""
    return dtype.is_floating_point and not is_float8(dtype)


def make_codecs(group: CodecGroup, policy: QuantizedCommPolicy | None, mp_policy: MixedPrecisionPolicy) -> list[Codec] | None:
    """The group's codecs, or None when every parameter travels plain (the flat all-gather)."""
    if policy is None and not group.mixed and not any(p.extension is not None for p in group.params):
        return None
    info = group.mesh_info
    names = info.mesh.mesh_dim_names
    sliced = info.mesh.ndim > 1 and names is not None and info.shard_axis is not None
    shard_mesh = info.mesh[names[info.shard_axis]] if sliced else info.mesh  # type: ignore[index]
    codecs: list[Codec] = []
    for p in group.params:
        if p.extension is not None:
            if p.tp is not None or p.layout.shard_dim != 0:
                raise NotImplementedError(
                    f"parameter {p.fqn!r}: all-gather extensions are supported on dim-0 sharding without tensor parallel"
                )
            codecs.append(ExtensionCodec(p, group, shard_mesh, p.sites[0].module, mp_policy))
        elif policy is not None and len(p.shape) >= policy.min_ndim and quantizable(p.orig_dtype):
            codecs.append(Int8BlockCodec(p, group, policy.block_size))
        else:
            codecs.append(Codec(p, group))
    return codecs
