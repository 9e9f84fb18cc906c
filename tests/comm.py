"""Record the collectives fullshard issues, and which module each all-gather serves."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.runtime import state_of


class CommRecorder:
    """Wraps the single-tensor collectives and the modules' forwards to record one event list."""

    def __init__(self, model: nn.Module) -> None:
        self.events: list[tuple[str, str]] = []
        self.all_gather_sizes: list[int] = []  # world size of each all-gather's group
        self._names: dict[int, str] = {}
        for name, module in model.named_modules():
            state = state_of(module)
            if state is not None and state.group is not None:
                label = name or "root"
                self._names[state.group.flat_shard.data_ptr()] = label
                module.register_forward_pre_hook(lambda *_, label=label: self.events.append(("fwd", label)))
        self._orig = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
        dist.all_gather_single = self._all_gather  # type: ignore[assignment]
        dist.reduce_scatter_single = self._reduce_scatter  # type: ignore[assignment]
        dist.all_reduce = self._all_reduce  # type: ignore[assignment]

    def _all_gather(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.events.append(("ag", self._names.get(inp.data_ptr(), "?")))
        self.all_gather_sizes.append(dist.get_world_size(kwargs.get("group")))
        return self._orig["all_gather_single"](output, inp, **kwargs)

    def _reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
        self.events.append(("rs", f"{inp.numel()}"))
        return self._orig["reduce_scatter_single"](output, inp, **kwargs)

    def _all_reduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.events.append(("ar", f"{tensor.numel()}"))
        return self._orig["all_reduce"](tensor, **kwargs)

    def close(self) -> None:
        """Put the original collectives back."""
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def count(self, kind: str) -> int:
        return sum(e[0] == kind for e in self.events)

    def take(self) -> list[tuple[str, str]]:
        events, self.events = self.events, []
        return events
