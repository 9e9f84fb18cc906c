"""Hooks that drive the groups: forward, backward, prefetch, end of backward.

[Note: Hook placement]
- forward pre-hook: unshard this group (waiting for a prefetch if one was
  issued), issue the next group's all-gather, count the call and wrap the
  inputs that need a gradient in ``_PostBackward``, whose backward runs once
  every gradient of this call has been computed.
- forward hook: reshard (when ``reshard_after_forward``; a list group after the
  last of its modules ran) and register a multi-grad hook on every tensor of
  the output that needs a gradient (pytree containers and plain dataclasses):
  the first output gradient to arrive in backward unshards the group again
  (pre-backward).
- ``_PostBackward.backward``: when the last counted call of the group has
  finished its backward, reshard and reduce the gradients: one reduction per
  group and backward, however many modules the group has and however often
  they ran.
- The first backward hook to run queues one end-of-backward callback on the
  autograd engine. It reduces what no post-backward handled (calls whose inputs
  need no gradient, e.g. the first layer, or whose output was not used), the
  HSDP partial sums still due, reshards everything, waits for every reduction
  and returns all states to IDLE.

[Note: Prefetch]
Each forward records the states in the order their pre-forward ran and in the
order their post-forward ran (first occurrence each). At the root's
post-forward the recorded orders, when they changed, become the prefetch plan:
a state's forward prefetch is the next state(s) in pre-forward order, and its
backward prefetch the state(s) before it in post-forward order, which is the
order backward reaches them (the root finishes forward last, so its
pre-backward prefetches the last block). When control flow changes the order,
the next forward plans anew; a group prefetched for a module that then did not
run is resharded at the root's post-forward, so a stale prefetch holds no
memory into backward. Lookups are dictionaries: no per-call search. A group's
own all-gather is waited for and copied out before the next group's is issued,
so only one all-gather output (the prefetch in flight) is ever live beside the
unsharded groups.

[Note: Recovery]
If a forward or backward raises, some groups may be left unsharded with
collectives in flight. The root's next forward notices (a state not IDLE, or an
end-of-backward callback that never ran), completes the in-flight collectives,
drops unreduced gradients and reshards everything, so training can continue.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fullshard import failures
from fullshard.collectives import CommStreams, profiled
from fullshard.errors import ShardedElsewhereError
from fullshard.group import ParamGroup, ShardedState, group_of
from fullshard.param import registrations, unsharded_owner
from fullshard.policy import MixedPrecisionPolicy
from fullshard.reduce import PendingReduce, ReduceSettings

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


def state_of(module: object) -> HookState | None:
    state = getattr(module, "__dict__", {}).get(STATE_KEY)
    return state if isinstance(state, HookState) else None


def states_in(module: nn.Module, recurse: bool = True) -> list[HookState]:
    """The states of ``module`` and (with ``recurse``) of its submodules, each once, in module order."""
    states: list[HookState] = []
    for mod in module.modules() if recurse else [module]:
        state = state_of(mod)
        if state is not None and state not in states:
            states.append(state)
    return states


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


# [Note: Double backward]
# A backward with create_graph=True (a gradient penalty: torch.autograd.grad(out, x,
# create_graph=True), then a loss that includes the gradient is back-propagated) builds a
# graph whose nodes saved the unsharded parameters, and the backward through it reaches
# them by paths that do not pass the groups' outputs or inputs. So such a backward reduces
# its gradients as usual and at its end registers the sharded parameters again (the
# optimizer, clip_grad_norm_ and state dicts see what they see after any backward), but
# keeps every unsharded buffer allocated with its values. Until a backward without
# create_graph has run, forwards leave the groups unsharded (that backward may run
# through their graph as well); an all-gather in between writes the same values into the
# kept buffer, unless the sharded parameters changed ([Note: Sharded parameters changed
# while unsharded]; torch's unsharded model refuses a backward through a graph whose
# parameters an optimizer step changed since, this one uses the new values). The backward
# without create_graph reduces and reshards every group at its end, once all gradients,
# those through the kept graph included, have arrived, and frees the kept buffers. Memory
# in between is that of reshard_after_forward=False.


# [Note: Sharded parameters changed while unsharded]
# An optimizer step (or a state dict load, an EMA swap) between a forward and the next one
# writes the sharded parameters while a group may still hold unsharded values gathered
# before it: the root or a group with reshard_after_forward=False after a forward that was
# never back-propagated (a metric computed with grad enabled after backward), every group
# after set_reshard_after_backward(False), the groups a create_graph backward kept, the
# post-forward copy of reshard_after_forward=k. Each all-gather records the version
# counters that in-place writes to the sharded values bump (the flat shard buffer's, each
# sharded parameter's and its local tensor's), and unsharding a group that is unsharded or
# holds a post-forward copy compares them first: a change reshards the group and gathers
# the new values. On every rank alike, as the step that wrote them ran on every rank. An
# edit through `.data`, which autograd does not see either, is not noticed. FSDP2 trains
# on with the values from before the step there. An optimizer step (a global step pre-hook,
# outside backward) also reshards the groups a forward or backward left unsharded whose
# parameters it steps (not another model's, whose forward may wait for its backward), so
# that after it model.parameters(), a state dict or an EMA reading the modules see the
# stepped sharded parameters; the check above catches writes that are not optimizer steps.


# [Note: Changes after the first forward]
# Lazy init takes over what was assigned to the modules after fully_shard: a DTensor
# assigned in place of a sharded parameter, a tie to another group's parameter, and it
# warns about parameters that no group manages. The same can happen later, between two
# steps (a layer re-initialised by assigning a new parameter, a head tied or replaced), and
# the forward would then silently train the old parameter. Every parameter or submodule
# registration in the process (``module.w = nn.Parameter(...)``, ``register_parameter``,
# ``module.head = nn.Linear(...)``) bumps ``registrations.count`` through torch's global
# registration hooks; a root's forward that sees a new count checks its module tree again:
# new states join, states whose modules left the tree leave (resharded, dropped from the
# prefetch plan), assignments are taken over as at lazy init. A training loop that
# registers nothing pays one comparison per step.
# Whatever registers parameters outside a forward (unshard, reshard, a conversion,
# summon_full_params, EMA, state_dict, load_state_dict) takes over first
# (``take_over_changes``); and until a root has taken over, a group registering its
# parameters (unshard, reshard, also inside backward) skips the modules holding neither
# face of a parameter (``keep_assigned`` in group.py), so no assignment is lost before a
# root sees it. Taking over needs sharded groups: a group still unsharded (a forward
# without backward) is resharded; a tie made to its unsharded parameter names the sharded
# one afterwards. Reductions still in flight are completed first. Gradients that the
# other parameters accumulated (sharded, unreduced under no-sync, or HSDP partial sums)
# stay through the relink; the assigned parameter starts without one, as a new parameter
# does in PyTorch.


# [Note: Pipeline schedules]
# torch.distributed.pipelining runs a stage's micro-batches as separate backwards, each
# after set_requires_gradient_sync(False) and set_reshard_after_backward(False), and when
# all of them are done it reduces outside any backward: it sets both back to True and
# calls post_backward() on each of FSDP2's param groups of the stage's root, then the
# root's final callback (PipelineStage.perform_reduce_grad). fully_shard.state(module)
# answers those names (fsdp2_state.py): a group's post_backward() is
# reduce_outside_backward, which reshards the group and reduce-scatters the summed
# gradients, also on a rank where the group got none (every rank's schedule reduces every
# group of its stage, so the ranks agree on the collectives); the final callback is
# settle_reductions. Zero-bubble schedules compute the weight gradients in a second pass
# from saved graph nodes, mapped to the stage's parameters by their gradient accumulators:
# that works with reshard_after_forward=False, as in FSDP2 (resharding after forward leaves
# the sharded parameters registered when the first pass reads them).


# [Note: Last backward]
# Every backward ends with every gradient it reduced assigned, also after
# set_is_last_backward(False): FSDP2 assigns them too and only lets its compute stream
# run on without waiting for the last reduce-scatter. Leaving reductions in flight past
# the backward instead left the groups reduced last (the root's, usually) without
# gradients for the optimizer and clipping of that step, and added them into the next
# step's. The flag is accepted and validated; on accelerators the next forward's kernels
# queue behind the last reduce-scatter (a stream wait, the host does not block).


class IterationContext:
    """What every state under one root shares: recorded order, in-flight reductions, backward flags."""

    def __init__(self, states: list[HookState], streams: CommStreams) -> None:
        self.states = states
        self.streams = streams
        # This iteration's order: states by first pre-forward, and by first post-forward.
        self.pre_order: list[HookState] = []
        self.post_order: list[HookState] = []
        self._seen_pre: set[HookState] = set()
        self._seen_post: set[HookState] = set()
        # Implicit prefetch targets, from the last completed forward's order (see [Note: Prefetch]).
        self.forward_next: dict[HookState, list[HookState]] = {}
        self.backward_next: dict[HookState, list[HookState]] = {}
        self._planned_from: tuple[list[HookState], list[HookState]] = ([], [])
        self.pending_reduces: list[PendingReduce] = []  # issued since the last drain, oldest first
        self.inputs_in_flight: deque[PendingReduce] = deque()  # whose reduce-scatter input is still held
        self.end_of_backward_queued = False
        self.in_root_forward = False
        self.submodule_depth = 0  # nested forwards of sharded submodules run on their own (no root forward)
        self.graph_kept = False  # a create_graph=True backward's graph holds the unsharded buffers ([Note: Double backward])
        # A forward or backward since the last optimizer step may have left groups unsharded
        # ([Note: Sharded parameters changed while unsharded]).
        self.unsharded_left = False
        self.post_optim_event: torch.Event | None = None
        self.registrations_seen = -1  # registrations.count when the states were last checked
        # Implicit prefetch: how many groups ahead, and when in backward.
        self.forward_prefetch_depth = 1
        self.backward_prefetch_depth = 1
        self.backward_prefetch_mode = BackwardPrefetchMode.PRE
        # The ranks compare their collectives per group ([Note: Divergence check] in failures.py).
        groups = [group for state in states for group in state.groups]
        self.monitor = failures.Monitor(
            [pg for g in groups for pg in (g.mesh_info.shard_group, g.mesh_info.replicate_group,
                                           g.post_forward.group if g.post_forward is not None else None)],
            tuple(sorted({r for g in groups for r in g.mesh_info.mesh.mesh.flatten().tolist()})),
        )
        streams.monitor = self.monitor
        _contexts.add(self)  # where the optimizer step pre-hook finds it (reshard_before_step)

    def start_forward(self) -> None:
        """The root's pre-forward: a new iteration's order begins."""
        self.in_root_forward = True
        self.pre_order, self.post_order = [], []
        self._seen_pre, self._seen_post = set(), set()
        for state in self.states:
            state.start_iteration()

    def record_pre_forward(self, state: HookState) -> None:
        if state not in self._seen_pre:
            self._seen_pre.add(state)
            self.pre_order.append(state)

    def record_post_forward(self, state: HookState) -> None:
        if state not in self._seen_post:
            self._seen_post.add(state)
            self.post_order.append(state)

    def end_forward(self) -> None:
        """The root's post-forward: plan the next prefetches and drop the ones this forward did not use."""
        self.in_root_forward = False
        if (self.pre_order, self.post_order) != self._planned_from:
            self._planned_from = (self.pre_order, self.post_order)
            self.forward_next = _following(self.pre_order, self.forward_prefetch_depth)
            self.backward_next = _following(self.post_order[::-1], self.backward_prefetch_depth)
        if self.graph_kept:  # [Note: Double backward]
            return
        for state in self.states:
            for group in state.groups:
                if group.state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD):
                    continue
                if state not in self._seen_pre or (state.reshard_after_forward and not state.is_root):
                    # A prefetch for a module that did not run, or a list group some of whose modules did not.
                    group.reshard()

    def forget(self, left: list[HookState]) -> None:
        """``left``'s modules are no longer in the root's tree: free their groups (a prefetch may have
        all-gathered one), let them become roots of their own, and plan prefetches without them."""
        if not left:
            return
        for state in left:
            for group in state.groups:
                group.reshard()
            state.ctx = None
            state.is_root = False
        self.forward_next = {s: [t for t in ts if t not in left] for s, ts in self.forward_next.items() if s not in left}
        self.backward_next = {s: [t for t in ts if t not in left] for s, ts in self.backward_next.items() if s not in left}
        self._planned_from = ([], [])

    def set_prefetch_depth(self, forward: int | None = None, backward: int | None = None) -> None:
        if forward is not None:
            self.forward_prefetch_depth = forward
        if backward is not None:
            self.backward_prefetch_depth = backward
        self._planned_from = ([], [])  # re-plan at the next forward

    def queue_end_of_backward(self) -> None:
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def release_finished_inputs(self) -> None:
        """Drop the reduce-scatter inputs whose collective has already finished (host collectives), so a
        group's backward does not run beside the previous group's input."""
        while self.inputs_in_flight and self.inputs_in_flight[0].reduce_scatter_done():
            self.inputs_in_flight.popleft().release_input()

    def make_room_for_reduce(self, limit: int) -> None:
        """Bound the reduce-scatter inputs alive: before the next input is allocated, the oldest ones go
        (once their reduce-scatter is done), so at most ``limit`` exist at any time."""
        while self.inputs_in_flight and len(self.inputs_in_flight) >= limit:
            self.inputs_in_flight.popleft().release_input()

    def add_reduce(self, pending: PendingReduce) -> None:
        self.pending_reduces.append(pending)
        self.inputs_in_flight.append(pending)

    def end_of_backward(self) -> None:
        keep = torch.is_grad_enabled()  # create_graph=True: the graph it made holds the unsharded parameters
        with profiled("end_of_backward"), _outside_functorch():
            self.unsharded_left = False
            for state in self.states:
                groups = state.groups
                if groups and (state.training_state is TrainingState.PRE_BACKWARD or any(
                    (not keep and group.state is not ShardedState.SHARDED and state.reshard_after_backward)
                    or group.reducer.reduction_due for group in groups
                )):
                    state.post_backward(in_backward_pass=False)
                state.training_state = TrainingState.IDLE
                state.calls_awaiting_backward = 0
                for group in groups:  # [Note: Double backward]
                    if not keep:
                        group.release_storage()
                    elif state.reshard_after_backward:
                        group.reshard(keep_storage=True)
                    self.unsharded_left |= group.state is not ShardedState.SHARDED
            self.graph_kept = keep
            self.settle_reductions()

    def settle_reductions(self) -> None:
        """Assign every gradient reduced so far (the end of a backward, or of a pipeline schedule's step:
        [Note: Pipeline schedules])."""
        self.drain_reduces()  # also when not the last backward: see [Note: Last backward]
        self.streams.host_wait(self.streams.h2d_done)  # the optimizer may write the pinned shards next
        self.streams.shards_written()
        self.end_of_backward_queued = False
        self.monitor.end_backward(all(g.reducer.settings.requires_gradient_sync for s in self.states for g in s.groups))
        if self.registrations_seen != registrations.count:  # a tie made during the step names a parameter
            _unsharded_to_sharded([g for s in self.states for g in s.groups])  # resharded now

    def drain_reduces(self) -> None:
        """Complete every reduction in flight: first let every reduce-scatter finish (CPU: issues the
        HSDP all-reduces), then deliver them all, so the all-reduces overlap each other."""
        for pending in self.pending_reduces:
            pending.release_input()
        for pending in self.pending_reduces:
            pending.finish()
        self.pending_reduces.clear()
        self.inputs_in_flight.clear()

    def needs_recovery(self) -> bool:
        return self.end_of_backward_queued or any(s.training_state is not TrainingState.IDLE for s in self.states)

    def recover(self) -> None:
        log.warning("fullshard: the previous forward or backward did not finish; resharding and dropping its gradients")
        for pending in self.pending_reduces:
            pending.abandon()
        self.pending_reduces.clear()
        self.inputs_in_flight.clear()
        for state in self.states:
            for group in state.groups:
                group.discard_pending()
            state.training_state = TrainingState.IDLE
            state.calls_awaiting_backward = 0
        self.end_of_backward_queued = False

    def reshard_all(self) -> None:
        if self.graph_kept:
            return
        for state in self.states:
            for group in state.groups:
                group.reshard()
        self.unsharded_left = False
        self.streams.host_wait(self.streams.h2d_done)

    def reshard_before_step(self, stepped: set[int]) -> None:
        """An optimizer step is about to write the sharded parameters with these ids: register them on the groups
        left unsharded that hold one ([Note: Sharded parameters changed while unsharded])."""
        self.unsharded_left = False
        for state in self.states:
            for group in state.groups:
                if group.state is ShardedState.SHARDED:
                    continue
                # (a step inside summon_full_params leaves the group to the context's exit)
                if not group.summoned and any(id(p.sharded) in stepped for p in group.params):
                    group.reshard(keep_storage=self.graph_kept)
                self.unsharded_left |= group.state is not ShardedState.SHARDED


_contexts: weakref.WeakSet[IterationContext] = weakref.WeakSet()


def reshard_before_step(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The global optimizer step pre-hook (registered at the first ``fully_shard``): groups that a forward (or a
    backward keeping them) left unsharded and whose parameters this optimizer steps register their sharded
    parameters. Only those: another model's forward may wait for its backward (a GAN's generator while the
    discriminator steps), with unsharded parameters that its graph saved outside the groups' hooks (a tied head
    used after forward). Not in a backward (an optimizer step per parameter from its gradient hook), where
    groups are unsharded for the backward itself."""
    if torch.compiler.is_compiling() or in_backward():
        return
    pending = [ctx for ctx in _contexts if ctx.unsharded_left]
    if pending:
        stepped = {id(p) for group in opt.param_groups for p in group["params"]}
        for ctx in pending:
            ctx.reshard_before_step(stepped)


def _following(order: list[HookState], depth: int) -> dict[HookState, list[HookState]]:
    """Each state's next ``depth`` states in ``order``."""
    return {state: order[i + 1 : i + 1 + depth] for i, state in enumerate(order)}


class _PostBackward(torch.autograd.Function):
    """Identity on a module call's inputs; its backward marks that call's backward as done.

    Its outputs alias the inputs' memory without being their views (``detach()``), so the module may
    change them in place (``nn.ReLU(inplace=True)`` as its first layer) as it could its unwrapped
    inputs: autograd forbids in-place changes of a custom Function's output views. The alias shares the
    input's version counter, so such a change of an input saved for backward is still caught.
    """

    @staticmethod
    def forward(ctx: Any, state: HookState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        return tuple(x.detach() for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.state.call_backward_done()
        return (None, *grads)


# [Note: torch.func transforms]
# Inside torch.func.jvp (forward-mode AD through the model, as consistency models train) the
# module sees functorch's wrapped tensors, and its outputs report requires_grad=False there
# although autograd records them for the backward that follows outside the transform. So the
# hooks' own work (lazy init, all-gathers, resharding) runs with functorch's interpreters set
# aside, on plain tensors; each floating-point output passes through _PreBackward, whose backward runs
# the group's pre-backward (all-gathering it again) where a gradient hook could not be
# registered, on the primal's path and, through its jvp, on the tangent's; and the inputs do
# not pass through _PostBackward, so every group is reduced at the end of the backward, once
# both paths have added their gradients. The same holds under torch.func.vmap and
# torch.func.grad (whose backward runs inside the transform: _PreBackward's backward and the
# end of the backward set the interpreters aside too).


class _PreBackward(torch.autograd.Function):
    """Identity on a module call's output under torch.func transforms; its backward runs the pre-backward
    hook ([Note: torch.func transforms])."""

    generate_vmap_rule = True  # (torch.func.vmap over a module with grad enabled)

    @staticmethod
    def forward(state: HookState, output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return output.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        with _outside_functorch():  # (a backward inside torch.func.grad)
            ctx.state._pre_backward_hook(grad)
        return None, grad

    @staticmethod
    def jvp(ctx: Any, state_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        return None if tangent is None else _PreBackward.apply(ctx.state, tangent)


_UNCHANGED = contextlib.nullcontext()  # one object for every hook outside a transform: hooks allocate nothing


def _outside_functorch(transformed: bool | None = None) -> Any:
    """A context outside torch.func's transforms when ``transformed`` (by default: when one is active; [Note:
    torch.func transforms]): their interpreters are set aside, so what runs inside makes plain tensors,
    parameters included."""
    if transformed is None:
        transformed = torch._C._are_functorch_transforms_active()
    if not transformed:
        return _UNCHANGED
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


# [Note: torch.compile]
# fullshard's forward hooks (all-gather, resharding, registering the backward hooks) run
# eagerly, also when the module is compiled (block.compile(), torch.compile(model)):
# torch.compiler.disable makes Dynamo call them as they are instead of tracing them, so
# a compiled block's graph holds its own computation only and is not broken up by
# collectives, stream waits or storage resizes. Backward hooks run from autograd,
# outside any graph, as in eager mode.


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compiler.disable(hook, recursive=True)


# [Note: Parameters used without calling their module]
# nn.MultiheadAttention passes out_proj.weight and out_proj.bias to its functional form and
# never calls out_proj. Sharded on its own (an auto-wrap policy that picks every nn.Linear),
# out_proj's hooks would never run and the attention would get the sharded DTensors (FSDP2
# fails there with "got mixed torch.Tensor and DTensor"). fully_shard therefore makes every
# call of such an attention module count as a call of out_proj: out_proj's state hooks the
# attention module too (inside the attention's own state's hooks when it has one), so the
# group is all-gathered for the attention's forward, all-gathered again for its backward
# and reduced once the attention's input gradients are computed.


def hook_unused_submodules(modules: Iterable[nn.Module]) -> None:
    """[Note: Parameters used without calling their module] for every such module under ``modules``."""
    for top in modules:
        for module in top.modules():
            if isinstance(module, nn.MultiheadAttention):
                inner = state_of(module.out_proj)
                if inner is not None and inner is not state_of(module):
                    inner.add_caller(module)


class HookState:
    """Hook state of one ``fully_shard`` call (one or more modules): its group over the call's mesh, and one over
    each other mesh ``shard_placement_fn`` put parameters on ([Note: Parameters on other meshes] in api.py)."""

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
        self.group = group  # over the call's mesh; a tie made after fully_shard may form it later
        self.other_groups: list[ParamGroup] = []
        self.ignored_params: frozenset[torch.Tensor] = frozenset()  # fully_shard's ignored_params
        self.device = device
        self.mp_policy = mp_policy
        self.streams = streams
        self.reshard_after_forward_arg = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward) if reshard_after_forward is not None else True
        self.training_state = TrainingState.IDLE
        # Inside summon_full_params: the hooks stand aside ([Note: Summoned values] in group.py).
        self.summoned = False
        self.ctx: IterationContext | None = None
        self.is_root = False
        self.forward_prefetch: list[HookState] | None = None
        self.backward_prefetch: list[HookState] | None = None
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        # Module calls of this iteration whose backward has not finished: the group is reduced
        # (once) when the last one finishes, or at the end of backward.
        self.calls_awaiting_backward = 0
        # FSDPModule.set_* reduction settings given while this state has no group: a group it forms at lazy
        # init (a tie made after fully_shard) reduces with them.
        self.settings_without_group = ReduceSettings()
        # Forms this call's group from sharded parameters when it has none yet (set by fully_shard).
        self.make_group: Callable[[list[Any], list[torch.Tensor]], ParamGroup] | None = None
        # List groups: the modules yet to run in this forward; resharded after the last one.
        self._modules_to_run: set[nn.Module] = set()
        for module in modules:
            module.__dict__[STATE_KEY] = self
            # Outside any torch.compile'd region ([Note: torch.compile]): the compiled graph is the module's own code.
            module.register_forward_pre_hook(_eager(self._pre_forward_hook), prepend=True, with_kwargs=True)
            module.register_forward_hook(_eager(self._post_forward_hook), prepend=False)
            module.register_forward_hook(_eager(self._forward_done), prepend=False, always_call=True)
        self._callers: set[nn.Module] = set()  # [Note: Parameters used without calling their module]
        # Calls of this state's modules counted as forwards run on their own (IterationContext.submodule_depth)
        # that have not finished yet, and whether the last one's output needs a backward.
        self._own_calls = 0
        self._own_needs_backward = True

    def add_caller(self, caller: nn.Module) -> None:
        """Treat every call of ``caller`` as a call of this state's module ([Note: Parameters used without calling
        their module]): its hooks run inside those of ``caller``'s own state, if it has one."""
        if caller in self._callers:
            return
        self._callers.add(caller)
        caller.register_forward_pre_hook(_eager(self._pre_forward_hook), prepend=False, with_kwargs=True)
        caller.register_forward_hook(_eager(self._forward_done), prepend=True, always_call=True)
        caller.register_forward_hook(_eager(self._post_forward_hook), prepend=True)  # (before the line above)

    @property
    def groups(self) -> list[ParamGroup]:
        """Every group this state drives, together: the call's mesh's first."""
        return [*self.other_groups] if self.group is None else [self.group, *self.other_groups]

    def drop_group(self, group: ParamGroup) -> None:
        """``group`` has no parameters left (ties took them over)."""
        if group is self.group:
            self.group = None
        else:
            self.other_groups.remove(group)

    def group_on(self, mesh: Any) -> ParamGroup | None:
        """This state's group over ``mesh``, if any."""
        return next((g for g in self.groups if g.mesh_info.mesh == mesh), None)

    @property
    def label(self) -> str:
        groups = self.groups
        return groups[0].label if groups else type(self.modules[0]).__name__

    def start_iteration(self) -> None:
        self.calls_awaiting_backward = 0
        if len(self.modules) > 1:
            self._modules_to_run = set(self.modules)

    # ---- lazy init -----------------------------------------------------------

    def lazy_init(self) -> IterationContext:
        """Make this state the root of every state in its module tree.

        Runs at the first forward (or explicit unshard) of a state that has no
        root yet. A state that was a root earlier, because its module ran on its
        own first, becomes a non-root of the enclosing root.
        """
        return self._check_tree(None)

    def _check_tree(self, ctx: IterationContext | None) -> IterationContext:
        """Find the states in this root's module tree and take over what was assigned to their modules; at
        lazy init (``ctx`` None) and when parameters or modules were registered since ([Note: Changes after
        the first forward])."""
        states, module_names = self._states_in_tree()
        _check_no_shared_originals(states)
        if ctx is not None and ctx.pending_reduces and any(
            g.assigned_values() for s in states for g in s.groups if not g.summoned
        ):
            ctx.drain_reduces()  # reductions in flight deliver to the parameters they were issued for
        _take_over_assignments(states, module_names)
        _name_params(states, module_names)  # parameters split off or moved by the take-over
        if ctx is None:
            ctx = IterationContext(states, self.streams)
        else:
            ctx.forget(left=[state for state in ctx.states if state not in states])
        ctx.states = states
        for state in states:
            state.ctx = ctx
            # One set of communication streams per root: more would only add synchronisation.
            state.streams = self.streams
            for group in state.groups:
                group.streams = self.streams
            state.is_root = state is self
            if state.reshard_after_forward_arg is None:
                # Like FSDP2: the root's parameters are needed first in backward, keep them.
                state.reshard_after_forward = not state.is_root
        ctx.registrations_seen = registrations.count
        for state in states:
            for group in state.groups:
                group.registrations_seen = registrations.count
        return ctx

    def _states_in_tree(self) -> tuple[list[HookState], dict[nn.Module, str]]:
        """The states in this root's module tree, their groups and parameters named from the root."""
        module_names = {module: name for name, module in self.modules[0].named_modules()}
        states: list[HookState] = []
        for module, name in module_names.items():
            state = state_of(module)
            if state is None or state in states:
                continue
            states.append(state)
            for group in state.groups:
                group.label = name
        _name_params(states, module_names)
        return states, module_names

    # ---- forward -------------------------------------------------------------

    def _pre_forward_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.summoned:
            return args, kwargs
        if in_backward():
            # Activation-checkpoint recomputation. Non-reentrant: the group is already unsharded for backward.
            # Reentrant (torch.utils.checkpoint(use_reentrant=True), as Hugging Face's gradient checkpointing
            # uses by default): the first forward ran without grad, so no backward hook was registered, and
            # the gradients come from a nested backward; the end of the outer backward reduces them.
            groups = self.groups
            for group in groups:
                group.unshard()
            if groups and self.ctx is not None and torch.is_grad_enabled() and not self.calls_awaiting_backward:
                self.training_state = TrainingState.PRE_BACKWARD
                self.ctx.queue_end_of_backward()
            return self._cast_inputs(*self._root_inputs(args, kwargs))  # what the forward saw
        transformed = torch._C._are_functorch_transforms_active()
        with _outside_functorch(transformed):
            ctx = self.ctx if self.ctx is not None else self.lazy_init()
            if self.is_root:
                if ctx.needs_recovery():
                    ctx.recover()
                if ctx.registrations_seen != registrations.count:
                    self._check_tree(ctx)
                ctx.monitor.root_forward()
                ctx.start_forward()
                self.streams.shards_written(ctx.post_optim_event)  # the optimizer step (or the given event) came last
                ctx.post_optim_event = None
            elif not ctx.in_root_forward:  # a submodule's forward on its own
                ctx.submodule_depth += 1
                self._own_calls += 1
                if ctx.submodule_depth == 1:
                    ctx.monitor.submodule_forward()
            self.training_state = TrainingState.FORWARD
            ctx.record_pre_forward(self)
            groups = self.groups
            if groups:
                with profiled("pre_forward", self.label):
                    # Copy this group's all-gather out (freeing its output) before the next one allocates:
                    # at most one all-gather output is live beside the unsharded groups ([Note: Prefetch]).
                    for group in groups:
                        group.unshard()
                    targets: Iterable[HookState] | None = self.forward_prefetch
                    if targets is None:  # implicit: the modules after this one in the last root forward
                        targets = ctx.forward_next.get(self, ()) if self.is_root or ctx.in_root_forward else ()
                    self._prefetch(targets, backward=False)
        if self.is_root:
            args, kwargs = self._root_inputs(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled() and not transformed:  # ([Note: torch.func transforms])
            self.calls_awaiting_backward += 1
            args, kwargs = self._wrap_inputs_for_post_backward(args, kwargs)
        return args, kwargs

    def _root_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The root moves its inputs to its device (a recomputation gets the inputs saved before the move)."""
        if self.is_root and self.device.type != "cpu":
            return map_tensors(lambda t: t.to(self.device, non_blocking=True), (args, kwargs))
        return args, kwargs

    def _cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        return output if self.mp_policy.output_dtype is None else cast_floats(output, self.mp_policy.output_dtype)

    def _post_forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.summoned:
            return output
        if in_backward():
            return self._cast_output(output)
        ctx = self.ctx
        assert ctx is not None
        transformed = torch._C._are_functorch_transforms_active()
        if self.reshard_after_forward and self._last_module_to_run(module) and not ctx.graph_kept:
            with _outside_functorch(transformed):
                for group in self.groups:
                    group.reshard_post_forward()
        output = self._cast_output(output)
        if transformed and torch.is_grad_enabled():  # ([Note: torch.func transforms])
            output, needs_backward = map_tensors(lambda t: _PreBackward.apply(self, t) if t.is_floating_point()
                                                 or t.is_complex() else t, output), True
        else:
            needs_backward = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        if self._own_calls:
            self._own_needs_backward = needs_backward
        with _outside_functorch(transformed):
            ctx.record_post_forward(self)
            if self.is_root:
                ctx.end_forward()
                ctx.unsharded_left = True
                if not needs_backward or not module.training:
                    # Inference (no_grad, or eval mode): leave every group sharded. An eval-mode
                    # forward that is back-propagated anyway all-gathers again in backward.
                    ctx.reshard_all()
        return output

    def _forward_done(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After every forward, also one that raised (an always-called hook): the root's forward is over, or one of
        this state's counted forwards run on their own; the outermost of those ends its part of the checks."""
        ctx = self.ctx
        if ctx is None or in_backward():
            return
        if self.is_root:
            ctx.in_root_forward = False
        if self._own_calls:
            self._own_calls -= 1
            ctx.submodule_depth -= 1
            needs_backward, self._own_needs_backward = self._own_needs_backward, True  # (True: it raised)
            if not ctx.submodule_depth:
                ctx.monitor.submodule_forward(needs_backward)

    def _last_module_to_run(self, module: nn.Module) -> bool:
        """List groups are resharded once every module of the group ran in this forward."""
        if len(self.modules) == 1:
            return True
        self._modules_to_run.discard(module)
        return not self._modules_to_run

    def _prefetch(self, targets: Iterable[HookState], backward: bool) -> None:
        for target in targets:
            if (backward and not target.unshard_in_backward) or target.ctx is not self.ctx:
                continue  # (a module set as a target that has left the model since: nothing would free it)
            for group in target.groups:
                if group.state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD):
                    with profiled("prefetch", target.label):
                        group.unshard(async_op=True)

    def _wrap_inputs_for_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not kwargs and all(type(x) is torch.Tensor for x in args):  # the common case, without pytree
            positions = [i for i, x in enumerate(args) if x.requires_grad]
            if not positions:
                return args, kwargs
            wrapped = self._through_post_backward([args[i] for i in positions])
            if len(positions) == len(args):
                return tuple(wrapped), kwargs
            new_args = list(args)
            for i, tensor in zip(positions, wrapped):
                new_args[i] = tensor
            return tuple(new_args), kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions:
            return args, kwargs
        for i, tensor in zip(positions, self._through_post_backward([flat[i] for i in positions])):
            flat[i] = tensor
        new_args, new_kwargs = tree_unflatten(flat, spec)
        return new_args, new_kwargs

    def _through_post_backward(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` through one ``_PostBackward``; a tensor passed twice comes back as one alias, so the module
        sees what it would unwrapped (``nn.MultiheadAttention`` checks ``query is key`` for self-attention)."""
        unique = {id(t): t for t in tensors}
        if len(unique) == len(tensors):
            return list(_PostBackward.apply(self, *tensors))
        aliases = dict(zip(unique, _PostBackward.apply(self, *unique.values())))
        return [aliases[id(t)] for t in tensors]

    # [Note: Outputs that are views]
    # A hook on an output tensor sits on the autograd node that made it. When the output is a
    # view (`y.view(...)`, `y[:, ::2]`, `y.t()`) and the caller changes it in place
    # (`h += x`), autograd rebases the view's history onto its base, and the view's old node
    # is no longer on any path from the loss: its hook never fires, the group is not
    # all-gathered for backward, and backward reads freed parameters. The base's node stays
    # on the path (the in-place change is recorded on top of it), so the hook also watches
    # each view's base when autograd made it; with mode="any" it still fires once, on
    # whichever gradient comes first.
    def _register_pre_backward(self, output: Any) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if not tensors:
            return False
        bases = [t._base for t in tensors if t._base is not None and t._base.grad_fn is not None]
        if bases:
            tensors = list({id(t): t for t in tensors + bases}.values())
        register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        return True

    # ---- backward ------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        assert self.ctx is not None
        self.ctx.queue_end_of_backward()
        self.training_state = TrainingState.PRE_BACKWARD
        groups = self.groups
        if not groups or not self.unshard_in_backward:
            return
        with profiled("pre_backward", self.label):
            self.ctx.release_finished_inputs()
            for group in groups:
                group.unshard()
            self._prefetch(self._backward_targets(BackwardPrefetchMode.PRE), backward=True)

    def _backward_targets(self, mode: BackwardPrefetchMode) -> list[HookState]:
        """The groups to all-gather at this point (``mode``) of this group's backward."""
        assert self.ctx is not None
        if self.backward_prefetch is not None:  # explicit: always before this group's gradients
            return self.backward_prefetch if mode is BackwardPrefetchMode.PRE else []
        if mode is not self.ctx.backward_prefetch_mode:
            return []
        return self.ctx.backward_next.get(self, [])

    def call_backward_done(self) -> None:
        """One module call's backward finished; the group is reduced after the last call's."""
        self.calls_awaiting_backward -= 1
        if self.calls_awaiting_backward <= 0:
            self.post_backward()

    def post_backward(self, in_backward_pass: bool = True) -> None:
        """Reshard and issue the reduction of this group's gradients.

        ``in_backward_pass=False`` (the end-of-backward callback) skips prefetching:
        no group runs after it. When the group's modules took part in backward (here, or
        its output gradients arrived), the reduction is issued even if no parameter of
        the group got a gradient on this rank: its peers' did (see ``GradReducer.reduce``).
        """
        assert self.ctx is not None
        ran_backward = in_backward_pass or self.training_state is TrainingState.PRE_BACKWARD
        self.ctx.queue_end_of_backward()
        self.calls_awaiting_backward = 0
        groups = self.groups
        if not groups:
            self.training_state = TrainingState.IDLE
            return
        if in_backward_pass and self.ctx.graph_kept:
            # [Note: Double backward]: gradients may still arrive through the kept graph; reduce at the end.
            self.training_state = TrainingState.PRE_BACKWARD
            return
        self.training_state = TrainingState.POST_BACKWARD
        with profiled("post_backward", self.label):
            if self.reshard_after_backward and not torch.is_grad_enabled():
                for group in groups:
                    group.reshard()
            if in_backward_pass:
                self._prefetch(self._backward_targets(BackwardPrefetchMode.POST), backward=True)
            for group in groups:
                self._reduce(group, ran_backward)
        self.training_state = TrainingState.IDLE

    def _reduce(self, group: ParamGroup, ran_backward: bool) -> None:
        assert self.ctx is not None
        reducer = group.reducer
        if reducer.settings.requires_gradient_sync:
            self.ctx.make_room_for_reduce(reducer.settings.max_inputs_in_flight)
            pending = reducer.reduce(ran_backward=ran_backward)
            if pending is not None:
                self.ctx.add_reduce(pending)
        else:
            reducer.accumulate_unsharded()

    def reduce_outside_backward(self, group: ParamGroup) -> None:
        """Reduce what backwards without gradient sync accumulated in ``group``, with no backward running
        ([Note: Pipeline schedules]); ``ctx.settle_reductions()`` assigns the result."""
        if self.ctx is None:
            return  # never ran: nothing accumulated
        with profiled("post_backward", self.label):
            if self.reshard_after_backward:
                group.reshard()
            # Every rank's schedule reduces every group of the stage, so all ranks take part, gradient or not.
            self._reduce(group, ran_backward=True)


_SUBCLASSED = (list, tuple, set, dict)  # containers whose subclasses pytree does not know


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``: pytree containers (lists, tuples, namedtuples, dicts, registered classes such
    as Hugging Face's ``ModelOutput``) and, beyond what pytree knows, the fields of plain dataclasses and the items
    of sets and of subclasses of lists, tuples, sets and dicts (which FSDP2's casts reach too)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found: list[torch.Tensor] = []
    pending = [tree]
    seen: set[int] = set()
    while pending:
        leaves, _ = tree_flatten(pending.pop())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif id(leaf) in seen or isinstance(leaf, type):
                continue
            elif dataclasses.is_dataclass(leaf):
                seen.add(id(leaf))
                pending.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
            elif isinstance(leaf, _SUBCLASSED):
                seen.add(id(leaf))
                pending.extend(leaf.values() if isinstance(leaf, dict) else leaf)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor in it (as :func:`tensors_in` finds them): pytree containers
    rebuilt as pytree does; a plain dataclass in which ``fn`` changed a tensor as a new instance through
    ``dataclasses.replace`` (its ``__post_init__`` runs again, as in FSDP2's casts), its ``init=False`` fields
    set afterwards; a set or a list, tuple or set subclass as its own type, a dict subclass as a plain dict (an
    ``OrderedDict`` subclass as its own type), as FSDP2's casts rebuild them; any of these in which nothing changed
    kept as it is."""

    def unchanged(before: Any, after: Any) -> bool:
        return all(a is b for a, b in zip(tensors_in(before), tensors_in(after)))

    def container(x: Any) -> Any:  # a set, or a subclass pytree does not know
        if isinstance(x, dict):
            items = {k: map_tensors(fn, v) for k, v in x.items()}
            if unchanged(list(x.values()), list(items.values())):
                return x
            if not isinstance(x, collections.OrderedDict):
                return items  # a plain dict, as FSDP2 rebuilds a dict subclass
            ordered = type(x)()
            ordered.update(items)
            return ordered
        elements = [map_tensors(fn, v) for v in x]
        return x if unchanged(list(x), elements) else type(x)(elements)

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if not dataclasses.is_dataclass(x):  # (a dataclass first: also when it subclasses a dict, as FSDP2)
            return container(x) if isinstance(x, _SUBCLASSED) else x
        if isinstance(x, type):
            return x
        fields = [f for f in dataclasses.fields(x) if hasattr(x, f.name)]
        values = {f.name: getattr(x, f.name) for f in fields}
        mapped = {name: map_tensors(fn, value) for name, value in values.items()}
        if all(a is b for name in values for a, b in zip(tensors_in(values[name]), tensors_in(mapped[name]))):
            return x
        new = dataclasses.replace(x, **{f.name: mapped[f.name] for f in fields if f.init})
        for f in fields:
            if not f.init:
                object.__setattr__(new, f.name, mapped[f.name])
        return new

    return tree_map(leaf, tree)


def _name_params(states: list[HookState], module_names: dict[nn.Module, str]) -> None:
    """Name each group's parameters from the root, by the first module that uses them."""
    for state in states:
        for p in (p for group in state.groups for p in group.params):
            prefix = module_names.get(p.sites[0].module, "")
            p.fqn = f"{prefix}.{p.sites[0].name}" if prefix else p.sites[0].name


def take_over_changes(states: list[HookState]) -> None:
    """Take over what was assigned to the modules of ``states`` since their roots last looked, before
    something outside a forward registers parameters over it (an explicit unshard, summon_full_params, EMA,
    load_state_dict); see [Note: Changes after the first forward]. Not inside forward or backward (an explicit
    prefetch): the root's next forward does it."""
    for state in states:
        ctx = state.ctx
        if ctx is None or ctx.registrations_seen == registrations.count or in_backward():
            continue
        root = next(s for s in ctx.states if s.is_root)
        if root.training_state is TrainingState.IDLE and not ctx.end_of_backward_queued:
            root._check_tree(ctx)


def _take_over_assignments(states: list[HookState], module_names: dict[nn.Module, str]) -> None:
    """Manage what was assigned to the modules since ``fully_shard`` (or the root's last check): re-assigned
    parameters, ties, and warn about parameters no group manages."""
    groups = [group for state in states for group in state.groups]
    _reshard_keeping_assignments(groups)
    # A value adopted by one group may free the object it replaced for another (``b.w = a.w; a.w = new``):
    # adopt until no group takes anything more, then tie what is registered in more than one group.
    while any([group.adopt_reassigned() for group in groups]):
        pass
    _take_over_late_ties(states, module_names)
    for group in (group for state in states for group in state.groups):
        group.relink()  # also after conversions that bypassed FSDPModule._apply (a submodule's to())
    _warn_unmanaged(states, module_names)
    _check_foreign_params(states, module_names)


def _reshard_keeping_assignments(groups: list[ParamGroup]) -> None:
    """Taking over works on sharded groups: where something was assigned since, reshard every group (which
    leaves the assigned values where they are). A tie made while a group was unsharded (``head.weight =
    tok.weight`` after a forward without backward, or between a forward and its backward) names the unsharded
    parameter, which stays registered there when the group reshards: it becomes the sharded one."""
    if not any(group.assigned_values() for group in groups if not group.summoned):
        return
    for group in groups:
        if not group.summoned:
            group.reshard()
    _unsharded_to_sharded(groups)


def _unsharded_to_sharded(groups: list[ParamGroup]) -> None:
    """Where a module holds a resharded group's unsharded parameter (assigned to it while the group was
    unsharded), register that parameter's sharded face instead."""
    sharded_of = {id(p.unsharded): p.sharded for group in groups if group.state is ShardedState.SHARDED
                  for p in group.params}
    for group in groups:
        for site, value in group.assigned_values():
            if id(value) in sharded_of:
                site.module._parameters[site.name] = sharded_of[id(value)]


def _take_over_late_ties(states: list[HookState], module_names: dict[nn.Module, str]) -> None:
    """Ties made after every ``fully_shard`` call (``model.head.weight = model.tok.weight``, one group's sharded
    parameter assigned to a module of another): the nearest group enclosing every module that uses the
    parameter takes it over, as ``fully_shard`` does for ties made before ([Note: Tied parameters across
    groups] in api.py). The assigned parameter object stays the parameter; the one it replaced leaves its group
    once no module uses it. Every module is first given to the parameter it holds, so parameters exchanged
    between modules (``a.weight, b.weight = b.weight, a.weight``) are exchanged, not tied; anything that cannot
    be taken over raises before anything changed.
    """
    moves = []  # (the parameter a module held, that site, the parameter it holds now, that parameter's group)
    for state in states:
        for replaced in (p for group in state.groups for p in group.params):
            for site in replaced.sites:
                value = site.module._parameters.get(site.name)
                owner = group_of(value) if value is not None and value is not replaced.sharded else None
                if owner is not None:  # another group's sharded parameter, or one of this group's
                    moves.append((replaced, site, next(p for p in owner.params if p.sharded is value), owner))
    if not moves:
        return
    plans: list[tuple[Any, ParamGroup, list[Any], HookState, ParamGroup | None]] = []
    for tied, owner in dict.fromkeys((tied, owner) for _, _, tied, owner in moves):
        sites = [s for s in tied.sites if all(s is not site for _, site, _, _ in moves)]
        sites += [site for _, site, other, _ in moves if other is tied]
        nearest = _nearest_enclosing_state(states, module_names, [s.module for s in sites])
        enclosing = nearest.group_on(tied.mesh_info.mesh) if nearest is not None else None
        if enclosing is None and nearest is not None and nearest.group is None and nearest.make_group is not None:
            plans.append((tied, owner, sites, nearest, None))  # a group on the call's mesh, formed below
            continue
        if enclosing is None or tied.tp is not None:
            replaced = next(r for r, _, other, _ in moves if other is tied)
            raise ValueError(
                f"{replaced.fqn!r} was tied after fully_shard to {tied.fqn!r}, a parameter already managed by "
                "another FSDP group, and no fully_shard group on the same mesh encloses every module using "
                "it, so two copies would train: make the tie before fully_shard, or call fully_shard on a "
                "common ancestor of the modules"
            )
        if enclosing is not owner:
            enclosing.check_can_add(tied)
        assert nearest is not None
        plans.append((tied, owner, sites, nearest, enclosing))
    for replaced, site, _, _ in moves:
        replaced.sites.remove(site)
    for tied, owner, sites, nearest, enclosing in plans:
        new_modules = [s.module for s in sites if all(s is not old for old in tied.sites)]
        tied.sites = sites
        if enclosing is None:
            assert nearest.make_group is not None
            nearest.group = enclosing = _new_group(nearest.make_group, tied)
            enclosing.reducer.settings = nearest.settings_without_group
            owner.reducer.hand_over(tied, enclosing.reducer)
            owner.remove([tied])
        elif enclosing is owner:
            if owner.on_new_sites is not None:
                owner.on_new_sites(new_modules)
        else:
            enclosing.add(tied)
            owner.reducer.hand_over(tied, enclosing.reducer)
            owner.remove([tied])
    for state in states:
        for group in state.groups:
            leaving = [p for p in group.params if not p.sites]  # no module uses it any more
            if leaving:
                group.remove(leaving)
            if not group.params:
                state.drop_group(group)


def _new_group(make_group: Callable[[list[Any], list[torch.Tensor]], ParamGroup], tied: Any) -> ParamGroup:
    """A group for a state that had none, formed around ``tied`` (which keeps its parameter object)."""
    before = tied.sharded
    grad, unreduced = before.grad, tied.unsharded.grad  # accumulated so far (a tie between micro-batches)
    group = make_group([tied], [before])
    if group.mesh_info.mesh != tied.mesh_info.mesh:
        raise ValueError(
            f"{tied.fqn!r} was tied after fully_shard across groups, and the fully_shard call enclosing its users "
            "shards on another mesh: make the tie before fully_shard, or shard both on the same mesh"
        )
    torch.utils.swap_tensors(before, tied.sharded)  # the object optimizers hold now views the new flat shard
    tied.sharded = before
    before.grad = grad
    if unreduced is not None and unreduced.dtype == tied.unsharded.dtype:
        tied.unsharded.grad = unreduced
    group.remove([])  # registers the owner and relinks with the swapped object
    tied.register(before)  # the group registered the object it made, which now holds the old values
    return group


def _nearest_enclosing_state(
    states: list[HookState], module_names: dict[nn.Module, str], users: list[nn.Module]
) -> HookState | None:
    """The deepest state whose modules contain every module of ``users``."""
    user_names = [module_names.get(m) for m in users]
    if any(name is None for name in user_names):
        return None
    best: tuple[int, HookState] | None = None
    for state in states:
        for member in state.modules:
            prefix = module_names.get(member)
            if prefix is None:
                continue
            if all(prefix == "" or n == prefix or n.startswith(prefix + ".") for n in user_names if n is not None):
                depth = prefix.count(".") + (prefix != "")
                if best is None or depth > best[0]:
                    best = (depth, state)
    return best[1] if best is not None else None


def _warn_unmanaged(states: list[HookState], module_names: dict[nn.Module, str]) -> None:
    """Warn about trainable parameters registered after ``fully_shard`` (``module.lora = nn.Parameter(...)``):
    no group shards them and nothing reduces their gradients, so each rank would train its own copy."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ignored = frozenset().union(*(state.ignored_params for state in states))
    unsharded = {p.unsharded for state in states for group in state.groups for p in group.params}
    names = [f"{prefix}.{name}" if prefix else name
             for module, prefix in module_names.items() for name, p in module.named_parameters(recurse=False)
             if p.requires_grad and not isinstance(p, DTensor) and p not in ignored and p not in unsharded]
    if names:
        warnings.warn(
            f"parameters registered after fully_shard are neither sharded nor reduced across ranks, so each rank "
            f"trains its own copy: {', '.join(names)}; register them before calling fully_shard, or pass them "
            "as ignored_params and synchronise them yourself",
            stacklevel=2,
        )


def _check_foreign_params(states: list[HookState], module_names: dict[nn.Module, str]) -> None:
    """Raise if a module of this tree holds a parameter that a fully_shard call outside the tree shards: a module
    shared with a sibling call and no call on a common ancestor to take it ([Note: Tied parameters across
    groups] in api.py); its forward here would meet the sharded parameter, or the other call's unsharded one, which
    that call reduces and frees on its own schedule."""
    ours = {id(t) for state in states for group in state.groups for p in group.params for t in (p.sharded, p.unsharded)}
    for module, prefix in module_names.items():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in ours and (
                    group_of(param) is not None or unsharded_owner(param) is not None):
                fqn = f"{prefix}.{name}" if prefix else name
                raise ShardedElsewhereError(
                    f"parameter {fqn!r} is sharded by a fully_shard call outside this root's module tree (its "
                    "module is shared with another fully_shard call), which gathers and frees it on its own schedule: call "
                    "fully_shard on a common ancestor of the modules sharing it before the first forward, or shard "
                    "the shared module on its own first (fully_shard(shared), then the others)"
                )


def _check_no_shared_originals(states: list[HookState]) -> None:
    """Raise if an original parameter was sharded by two groups (a tie across ``fully_shard`` calls).

    Each group would train its own copy and the tie would silently break.
    """
    for state in states:
        for p in (p for group in state.groups for p in group.params):
            first = p.shared_with
            if first is not None:
                raise ValueError(
                    f"Parameter {p.fqn!r} is shared with {first.fqn!r}, a parameter already managed by another "
                    "fully_shard group, so the two groups would train two copies of it. Shard every module using "
                    "a tied parameter in one fully_shard call (a common ancestor, or a list of the modules)"
                )


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return map_tensors(cast, tree)
