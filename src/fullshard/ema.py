"""An exponential moving average of a sharded model's parameters, kept shard by shard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard.errors import expect_module
from fullshard.group import group_of
from fullshard.param import full_tensor, registrations
from fullshard.runtime import TrainingState, states_in, take_over_changes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMA:
    """``ema = decay * ema + (1 - decay) * param`` for every trainable parameter of ``model``.

    The average has the parameters' sharding: each rank keeps (and updates) the
    rows it owns, so :meth:`update` needs no communication and the state is
    1/N of the model per rank. Call :meth:`update` after each optimizer step;
    ``with ema.swap():`` evaluates the averaged weights. :meth:`state_dict` holds
    ``DTensor``s keyed like the model's parameters, so it goes into
    ``torch.distributed.checkpoint`` next to the model and loads at another world
    size; :meth:`full_state_dict` gathers full tensors (rank 0 by default).
    It follows the parameters by name: one assigned later in place of another
    (``block.weight = nn.Parameter(...)``) is averaged from the next update on.

    Works on plain (unsharded) models too, e.g. as the reference in a test.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        expect_module("EMA", model)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be a number in [0, 1], got {decay!r}")
        self.model = model
        self.decay = float(decay)
        self._params = {name: p for name, p in self._registered(remove_duplicate=True).items() if p.requires_grad}
        self._registrations_seen = registrations.count
        with torch.no_grad():
            self._average = {name: p.detach().clone() for name, p in self._params.items()}

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self._check_idle("EMA")
        if self._registrations_seen != registrations.count:  # a parameter may have been assigned since
            now = self._registered(remove_duplicate=False)  # a name tied since still has its parameter
            self._params = {name: now.get(name, p) for name, p in self._params.items()}
            self._registrations_seen = registrations.count
        names = list(self._params)
        return [_local(self._average[n]) for n in names], [_local(self._params[n]).detach() for n in names]

    def _registered(self, remove_duplicate: bool) -> dict[str, torch.Tensor]:
        """The model's parameters by name: the sharded ones (every group resharded)."""
        take_over_changes(states_in(self.model))  # an assigned value becomes its group's sharded parameter
        for group in (group for state in states_in(self.model) for group in state.groups):
            group.reshard()
        return dict(self.model.named_parameters(remove_duplicate=remove_duplicate))

    def _check_idle(self, what: str) -> None:
        busy = [s.label for s in states_in(self.model) if s.training_state is not TrainingState.IDLE]
        if busy:
            raise ValueError(f"{what} cannot run inside forward or backward (busy: {busy})")

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the current parameters (local shards only, no communication)."""
        averages, params = self._pairs()
        if averages:
            torch._foreach_lerp_(averages, params, 1.0 - self.decay)

    @contextlib.contextmanager
    def swap(self) -> Iterator[None]:
        """Inside, the model's parameters hold the averaged values; on exit the trained values again."""
        averages, params = self._pairs()
        with torch.no_grad():
            saved = [p.clone() for p in params]
            self._write_shards(params, averages)
        try:
            yield
        finally:
            with torch.no_grad():
                self._write_shards(params, saved)

    def _write_shards(self, params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy ``values`` into the parameters' shards; unsharded copies (a root kept unsharded after a
        forward) would be stale, so every group is resharded and the next forward gathers anew."""
        for group in (group for state in states_in(self.model) for group in state.groups):
            group.reshard()
            group.streams.shards_written()
        torch._foreach_copy_(params, values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages, keyed by parameter name (``DTensor``s for sharded parameters)."""
        return dict(self._average)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load averages saved by :meth:`state_dict` (any placement or world size) or full tensors."""
        missing = sorted(set(self._average) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._average))
        if missing or unexpected:
            raise ValueError(f"EMA state dict does not match the model: missing {missing}, unexpected {unexpected}")
        for name, average in self._average.items():
            value = state_dict[name]
            if tuple(value.shape) != tuple(average.shape):
                raise ValueError(f"EMA state for {name!r} has shape {tuple(value.shape)}, expected {tuple(average.shape)} "
                                 "(the parameter's full shape: pass EMA.state_dict() or full tensors of this model)")
            if isinstance(average, DTensor):
                if isinstance(value, DTensor) and value.placements == average.placements \
                        and value.device_mesh == average.device_mesh:
                    local = value.to_local()
                else:
                    local = self._local_piece(name, average, full_tensor(value) if isinstance(value, DTensor) else value)
                average.to_local().copy_(local)
            else:
                average.copy_(full_tensor(value) if isinstance(value, DTensor) else value)

    def _local_piece(self, name: str, average: DTensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor ``full`` of parameter ``name``.

        A parameter of a fullshard group is cut as the model's own ``load_state_dict`` cuts it
        (its tensor-parallel piece first, then this rank's rows of that, none of it collective), so
        rows that divide unevenly over (dp, tp) land where the parameter's own rows are.
        """
        param = self._params[name]
        group = group_of(param)
        if group is not None:
            sharded = next(p for p in group.params if p.sharded is param)
            return sharded.local_part(full)
        return distribute_tensor(full.to(average.dtype), average.device_mesh, average.placements).to_local()

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full CPU tensors of the averages: ``{}`` on ranks other than 0 when ``rank0_only``. Collective."""
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        out = {}
        for name, average in self._average.items():
            full = (full_tensor(average) if isinstance(average, DTensor) else average).detach().cpu()
            if keep:
                out[name] = full
        return out

