"""A weight tensor subclass for tests of FSDP2's all-gather hooks: subclasses add the hooks."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


class WrapperWeight(torch.Tensor):
    """Test-only: a tensor subclass around ``_data`` that stays itself through the ops sharding applies
    (views, slices, copies, detach) and in place; other ops give plain tensors."""

    _data: torch.Tensor
    _keep = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
             torch.ops.aten.clone.default, torch.ops.aten.slice.Tensor, torch.ops.aten._to_copy.default}

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> WrapperWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device, requires_grad=data.requires_grad
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], ctx: None, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda t: t._data if isinstance(t, WrapperWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.name.endswith("_") and isinstance(args[0], cls):  # in place: the wrapper itself
            return args[0]
        return cls(out) if func in cls._keep and isinstance(out, torch.Tensor) else out
