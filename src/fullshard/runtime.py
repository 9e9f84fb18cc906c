"""Hooks that drive the groups: forward, backward, prefetch, end of backward.

[Note: Hook placement]
- forward pre-hook: unshard this group (waiting for a prefetch if one was
  issued), issue the next group's all-gather, and wrap the inputs that need a
  gradient in ``_PostBackward`` so that its backward runs once every gradient
  of this call has been computed.
- forward hook: reshard (when ``reshard_after_forward``) and register a
  multi-grad hook on the outputs: the first output gradient to arrive in
  backward unshards the group again (pre-backward).
- ``_PostBackward.backward``: reshard and reduce-scatter the gradients.
- The first backward hook to run queues one end-of-backward callback on the
  autograd engine. It reduces what no post-backward handled (modules whose
  inputs need no gradient, e.g. the first layer), reshards everything, waits
  for every reduction and returns all states to IDLE.
A module may run several times per forward: each call gets its own hooks and
reduces its own gradients, which accumulate in the sharded gradients.

[Note: Recovery]
If a forward or backward raises, some groups may be left unsharded with
collectives in flight. The root's next forward notices (a state not IDLE, or an
end-of-backward callback that never ran), completes the in-flight collectives,
drops unreduced gradients and reshards everything, so training can continue.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from fullshard.collectives import CommStreams
from fullshard.group import ParamGroup, PendingReduce, ShardedState
from fullshard.policy import MixedPrecisionPolicy

log = logging.getLogger("fullshard")

STATE_KEY = "_fullshard_state"


class BackwardPrefetchMode(Enum):
    """When backward all-gathers the group that runs next in backward (FSDP1's ``BackwardPrefetch``)."""

    PRE = auto()  # in this group's pre-backward, before its gradients are computed
    POST = auto()  # in this group's post-backward, after its gradients are computed
    NONE = auto()  # no implicit backward prefetch


class TrainingState(Enum):
    """What a state's hooks are in the middle of."""

    IDLE = auto()
    FORWARD = auto()  # between pre-forward and post-forward
    PRE_BACKWARD = auto()  # unsharded for backward, gradients not yet reduced
    POST_BACKWARD = auto()  # resharding and reducing


def state_of(module: object) -> ShardState | None:
    state = getattr(module, "__dict__", {}).get(STATE_KEY)
    return state if isinstance(state, ShardState) else None


def states_in(module: nn.Module, recurse: bool = True) -> list[ShardState]:
    """The states of ``module`` and (with ``recurse``) of its submodules, each once, in module order."""
    states: list[ShardState] = []
    for mod in module.modules() if recurse else [module]:
        state = state_of(mod)
        if state is not None and state not in states:
            states.append(state)
    return states


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class IterationContext:
    """What every state under one root shares: order, in-flight reductions, backward flags."""

    def __init__(self, states: list[ShardState], streams: CommStreams) -> None:
        self.states = states
        self.streams = streams
        self.forward_order: list[ShardState] = []
        self.order_frozen = False
        self.pending_reduces: deque[PendingReduce] = deque()
        self.end_of_backward_queued = False
        self.max_reduces_in_flight = 1
        self.is_last_backward = True  # False: leave reductions in flight past this backward (micro-batching)
        self.post_optim_event: torch.Event | None = None
        # Implicit prefetch: how many groups ahead, and when in backward.
        self.forward_prefetch_depth = 1
        self.backward_prefetch_depth = 1
        self.backward_prefetch_mode = BackwardPrefetchMode.PRE

    def record_forward(self, state: ShardState) -> None:
        if not self.order_frozen and state not in self.forward_order:
            self.forward_order.append(state)

    def neighbours(self, state: ShardState, step: int, depth: int) -> list[ShardState]:
        """Up to ``depth`` states after (``step=+1``) or before (``-1``) ``state`` in the recorded forward order."""
        if state not in self.forward_order:
            return []
        index = self.forward_order.index(state)
        picked = []
        for i in range(1, depth + 1):
            j = index + step * i
            if not 0 <= j < len(self.forward_order):
                break
            picked.append(self.forward_order[j])
        return picked

    def queue_end_of_backward(self) -> None:
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def add_reduce(self, pending: PendingReduce) -> None:
        self.pending_reduces.append(pending)
        # Bound the gradient memory in flight: finish the oldest reductions first.
        while len(self.pending_reduces) > self.max_reduces_in_flight:
            done = self.pending_reduces.popleft()
            done.group.finish_reduce(done)

    def end_of_backward(self) -> None:
        with record_function("fullshard::end_of_backward"):
            for state in self.states:
                group = state.group
                if group is not None and (
                    state.training_state is TrainingState.PRE_BACKWARD
                    or (group.state is not ShardedState.SHARDED and state.reshard_after_backward)
                ):
                    state.post_backward(in_backward_pass=False)
                state.training_state = TrainingState.IDLE
            if self.is_last_backward:
                while self.pending_reduces:
                    done = self.pending_reduces.popleft()
                    done.group.finish_reduce(done)
                if any(s.group is not None and s.group.shard_device != s.group.device for s in self.states):
                    self.streams.host_sync()  # offloaded gradients were copied to the host asynchronously
            self.end_of_backward_queued = False

    def needs_recovery(self) -> bool:
        return self.end_of_backward_queued or any(s.training_state is not TrainingState.IDLE for s in self.states)

    def recover(self) -> None:
        log.warning("fullshard: the previous forward or backward did not finish; resharding and dropping its gradients")
        for pending in self.pending_reduces:
            pending.collective.wait()
        self.pending_reduces.clear()
        for state in self.states:
            if state.group is not None:
                state.group.discard_pending()
            state.training_state = TrainingState.IDLE
        self.end_of_backward_queued = False

    def reshard_all(self) -> None:
        for state in self.states:
            if state.group is not None:
                state.group.reshard()


class _PostBackward(torch.autograd.Function):
    """Identity on a module call's inputs; its backward marks that call's backward as done."""

    @staticmethod
    def forward(ctx: Any, state: ShardState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.state.post_backward()
        return (None, *grads)


class ShardState:
    """Hook state of one ``fully_shard`` call (one group, one or more modules)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        device: torch.device,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
        streams: CommStreams,
    ) -> None:
        self.modules = modules
        self.group = group
        self.device = device
        self.mp_policy = mp_policy
        self.streams = streams
        self.reshard_after_forward_arg = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward) if reshard_after_forward is not None else True
        self.training_state = TrainingState.IDLE
        self.ctx: IterationContext | None = None
        self.is_root = False
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        for module in modules:
            module.__dict__[STATE_KEY] = self
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook, prepend=False)

    @property
    def label(self) -> str:
        return self.group.label if self.group is not None else type(self.modules[0]).__name__

    # ---- lazy init -----------------------------------------------------------

    def lazy_init(self) -> IterationContext:
        """Make this state the root of every state in its module tree.

        Runs at the first forward (or explicit unshard) of a state that has no
        root yet. A state that was a root earlier, because its module ran on its
        own first, becomes a non-root of the enclosing root.
        """
        root_module = self.modules[0]
        module_names = {module: name for name, module in root_module.named_modules()}
        states: list[ShardState] = []
        for module, name in module_names.items():
            state = state_of(module)
            if state is None or state in states:
                continue
            states.append(state)
            if state.group is not None:
                state.group.label = name
                for p in state.group.params:
                    prefix = module_names.get(p.sites[0].module, "")
                    p.fqn = f"{prefix}.{p.sites[0].name}" if prefix else p.sites[0].name
        _check_no_shared_originals(states)
        for state in states:
            if state.group is not None:
                state.group.adopt_reassigned()
        ctx = IterationContext(states, self.streams)
        for state in states:
            state.ctx = ctx
            # One pair of communication streams per root: more would only add synchronisation.
            state.streams = self.streams
            if state.group is not None:
                state.group.streams = self.streams
            state.is_root = state is self
            if state.reshard_after_forward_arg is None:
                # Like FSDP2: the root's parameters are needed first in backward, keep them.
                state.reshard_after_forward = not state.is_root
        return ctx

    # ---- forward -------------------------------------------------------------

    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if in_backward():
            # Activation-checkpoint recomputation: the group is already unsharded for backward.
            if self.group is not None:
                self.group.unshard()
            return args, kwargs
        if self.ctx is None:
            self.lazy_init()
        assert self.ctx is not None
        if self.is_root:
            if self.ctx.needs_recovery():
                self.ctx.recover()
            if self.ctx.post_optim_event is not None:
                self.streams.wait_event(self.ctx.post_optim_event)
                self.ctx.post_optim_event = None
            if self.device.type != "cpu":
                args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), (args, kwargs))
        self.training_state = TrainingState.FORWARD
        self.ctx.record_forward(self)
        if self.group is not None:
            with record_function(f"fullshard::pre_forward {self.label}"):
                self.group.unshard(async_op=True)
                targets = self.forward_prefetch
                if targets is None and self.ctx.order_frozen:
                    targets = self.ctx.neighbours(self, +1, self.ctx.forward_prefetch_depth)
                self._prefetch(targets or [], backward=False)
                self.group.wait_for_unshard()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _post_forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if in_backward():
            return output
        assert self.ctx is not None
        if self.group is not None and self.reshard_after_forward:
            self.group.reshard_post_forward()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        needs_backward = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            self.ctx.order_frozen = True
            if not needs_backward or not module.training:
                # Inference (no_grad, or eval mode): leave every group sharded. An eval-mode
                # forward that is back-propagated anyway all-gathers again in backward.
                self.ctx.reshard_all()
        return output

    def _prefetch(self, targets: list[ShardState], backward: bool) -> None:
        for target in targets:
            if backward and not target.unshard_in_backward:
                continue
            if target.group is not None and target.group.state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD):
                with record_function(f"fullshard::prefetch {target.label}"):
                    target.group.unshard(async_op=True)

    def _wrap_inputs_for_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return args, kwargs
        wrapped = _PostBackward.apply(self, *(flat[i] for i in positions))
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        new_args, new_kwargs = tree_unflatten(flat, spec)
        return new_args, new_kwargs

    def _register_pre_backward(self, output: Any) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return False
        register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        return True

    # ---- backward ------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        assert self.ctx is not None
        self.ctx.queue_end_of_backward()
        self.training_state = TrainingState.PRE_BACKWARD
        if self.group is None or not self.unshard_in_backward:
            return
        with record_function(f"fullshard::pre_backward {self.label}"):
            self.group.unshard(async_op=True)
            self._prefetch(self._backward_targets(BackwardPrefetchMode.PRE), backward=True)
            self.group.wait_for_unshard()

    def _backward_targets(self, mode: BackwardPrefetchMode) -> list[ShardState]:
        """The groups to all-gather at this point (``mode``) of this group's backward."""
        assert self.ctx is not None
        if self.backward_prefetch is not None:  # explicit: always before this group's gradients
            return self.backward_prefetch if mode is BackwardPrefetchMode.PRE else []
        if mode is not self.ctx.backward_prefetch_mode:
            return []
        return self.ctx.neighbours(self, -1, self.ctx.backward_prefetch_depth)

    def post_backward(self, in_backward_pass: bool = True) -> None:
        """Reshard and issue the reduce-scatter of this group's gradients.

        ``in_backward_pass=False`` (the end-of-backward callback) skips prefetching:
        no group runs after it.
        """
        assert self.ctx is not None
        self.ctx.queue_end_of_backward()
        if self.group is None:
            self.training_state = TrainingState.IDLE
            return
        self.training_state = TrainingState.POST_BACKWARD
        with record_function(f"fullshard::post_backward {self.label}"):
            if self.reshard_after_backward:
                self.group.reshard()
            if in_backward_pass:
                self._prefetch(self._backward_targets(BackwardPrefetchMode.POST), backward=True)
            if self.requires_gradient_sync:
                pending = self.group.reduce_grads()
                if pending is not None:
                    self.ctx.add_reduce(pending)
            else:
                self.group.accumulate_unsharded_grads()
        self.training_state = TrainingState.IDLE


def _check_no_shared_originals(states: list[ShardState]) -> None:
    """Raise if an original parameter was sharded by two groups (a tie across ``fully_shard`` calls).

    Each group would train its own copy and the tie would silently break.
    """
    for state in states:
        for p in state.group.params if state.group is not None else ():
            first = p.shared_with
            if first is not None:
                raise ValueError(
                    f"Parameter {p.fqn!r} is shared with {first.fqn!r}, a parameter already managed by another "
                    "fully_shard group, so the two groups would train two copies of it. Shard every module using "
                    "a tied parameter in one fully_shard call (a common ancestor, or a list of the modules)"
                )


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, tree)
