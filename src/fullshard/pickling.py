"""Pickling (``torch.save``) of DTensors whose local tensor starts inside a shared buffer.

[Note: Pickling DTensor views]
A group keeps its parameters' shards in one flat buffer, so every parameter's
local tensor but the first views that buffer at a storage offset; so do
gradients and the flat optimizer state. A ``DTensor`` wrapper takes its local
tensor's storage offset, and torch's ``Tensor.__reduce_ex__`` (2.13) tells a
wrapper subclass (no data of its own) by ``data_ptr() == 0``, which a nonzero
offset breaks: ``torch.save`` of such a ``DTensor`` (a state dict entry, a
gradient) then raises "invalid python storage". ``install()`` registers a
``copyreg`` reducer for ``DTensor`` that, for exactly those tensors, returns
what torch returns for one at offset 0 (an empty wrapper rebuilt from its
metadata, its local tensor and spec pickled as its state); every other
``DTensor`` pickles through torch's own ``__reduce_ex__``, unchanged. The
saved file is the one torch writes for FSDP2's parameters and loads the same
way, with ``weights_only=True`` too.
"""

from __future__ import annotations

import copyreg
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_PROTOCOL = 2  # torch.save's default; torch's tensor reduction does not depend on it


def _torch_reduces(t: DTensor) -> bool:
    """Whether torch's own reduction handles ``t``: no offset, or a device it treats before its data check."""
    early = ("meta", "xla", "maia", "mtia", torch._C._get_privateuse1_backend_name())
    return t.storage_offset() == 0 or t.device.type in early


def _reduce_dtensor(t: DTensor) -> Any:
    if _torch_reduces(t):
        return t.__reduce_ex__(_PROTOCOL)
    args = (type(t), t.dtype, tuple(t.size()), t.stride(), t.storage_offset(), t.layout, t.device, t.requires_grad)
    state = torch._utils._get_obj_state(t)
    return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, type(t), args, state)


def install() -> None:
    """Register the reducer (idempotent); see [Note: Pickling DTensor views]."""
    copyreg.pickle(DTensor, _reduce_dtensor)
