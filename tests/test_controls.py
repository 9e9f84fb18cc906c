"""FSDPModule's run-time controls: unshard_in_backward, divide factor, all-reduce hook, reshard_after_forward,
extra forward methods."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard import FSDPModule, fully_shard, register_fsdp_forward_method
from fullshard.collectives import ProcessGroupAllGather, ProcessGroupAllocated, ProcessGroupReduceScatter
from fullshard.runtime import state_of, states_in
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import full_grads, random_batches, regression_batch, run_parity, token_batch
from tests.test_parity import shard_mlp, shard_transformer


class EmbedThenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 6)
        self.mlp = MLP((6, 13, 37))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(tokens))


def embed_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 37), tokens[:, 1:].reshape(-1))


def shard_embedding_no_backward_gather(model: nn.Module) -> None:
    fully_shard(model.emb)
    for layer in model.mlp.layers:
        fully_shard(layer)
    fully_shard(model)
    model.emb.set_unshard_in_backward(False)


def _unshard_in_backward(rank: int, world_size: int) -> None:
    _, model = run_parity(rank, world_size, EmbedThenMLP, shard_embedding_no_backward_gather, token_batch, embed_loss)
    rec = CommRecorder(model)
    embed_loss(model, random_batches(1, world_size, token_batch)[0][rank]).backward()
    rec.close()
    backward = rec.events[rec.events.index(("fwd", "mlp.layers.1")) + 1 :]
    assert ("ag", "emb") not in backward, rec.events
    assert rec.count("ag") == 3 + 2, rec.events  # forward: emb and 2 layers (root has none); backward: the 2 layers


def test_unshard_in_backward_false() -> None:
    run_ranks(2, _unshard_in_backward)


def _divide_factor_and_hook(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    model = MLP()
    shard_mlp(model)
    calls: list[int] = []
    hook_stream = torch.cpu.Stream()

    def double(reduced: torch.Tensor) -> None:
        assert torch.cpu.current_stream() is hook_stream  # the stream given, current inside (as with FSDP2)
        calls.append(reduced.numel())
        reduced.mul_(2)

    for layer in model.layers:
        layer.set_gradient_divide_factor(1.0)  # sum instead of mean
    model.layers[0].set_all_reduce_hook(double, stream=hook_stream)
    model.set_post_optim_event(torch.cpu.current_stream().record_event())  # None on CPU: the default order
    batches = random_batches(1, world_size, regression_batch)[0]
    (sum(mse_loss(ref, b) for b in batches) / world_size).backward()
    mse_loss(model, batches[rank]).backward()
    grads, ref_grads = full_grads(model), full_grads(ref)
    assert calls == [state_of(model.layers[0]).group.layout.shard_numel]  # the gradients alone, no flag columns
    for name, ref_grad in ref_grads.items():
        scale = world_size * (2 if name.startswith("layers.0.") else 1)
        torch.testing.assert_close(grads[name], ref_grad * scale, msg=lambda m: f"{name}: {m}")


def test_gradient_divide_factor_and_all_reduce_hook() -> None:
    run_ranks(2, _divide_factor_and_hook)


def _reshard_after_forward_at_runtime(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    tokens = random_batches(2, world_size, token_batch)
    model.set_reshard_after_forward(False)  # every block keeps its parameters until backward
    rec = CommRecorder(model)
    lm_loss(model, tokens[0][rank]).backward()
    assert rec.count("ag") == 3, rec.take()  # forward only
    rec.take()
    model.set_reshard_after_forward(True)  # the root too
    out = model(tokens[1][rank][:, :-1])
    assert all(isinstance(p, DTensor) for p in model.parameters())
    out.sum().backward()
    rec.close()
    assert rec.count("ag") == 3 + 3, rec.events
    with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
        model.set_reshard_after_forward(2)  # type: ignore[arg-type]


def test_set_reshard_after_forward() -> None:
    run_ranks(2, _reshard_after_forward_at_runtime)


class WithGenerate(MLP):
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[-1](torch.relu(self.layers[-2](torch.relu(self.layers[0](x))))).argmax(-1)


def _forward_method(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = WithGenerate()
    torch.manual_seed(0)
    model = WithGenerate()
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")
    x = torch.randn(4, 7)
    torch.testing.assert_close(model.generate(x), ref.generate(x))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(ValueError, match="does not have a method nope"):
        register_fsdp_forward_method(model, "nope")
    # A parameter's or submodule's name is an assignment nn.Module refuses (TypeError, as FSDP2): nothing changes
    lin = fully_shard(nn.Linear(2, 2))
    for owner, name in ((model, "layers"), (lin, "weight")):
        before = getattr(owner, name)
        with pytest.raises(TypeError, match=f"cannot assign .* '{name}'"):
            register_fsdp_forward_method(owner, name)
        assert getattr(owner, name) is before
    plain = WithGenerate()
    register_fsdp_forward_method(plain, "generate")  # not sharded: nothing to do
    assert not isinstance(plain, FSDPModule)
    # The instance's method is wrapped, as in FSDP2: one assigned to the module, or one it alone has.
    torch.manual_seed(0)
    wrapped_model = WithGenerate()
    fully_shard(wrapped_model)
    original = wrapped_model.generate
    wrapped_model.generate = lambda x: original(x) + 10  # type: ignore[method-assign]
    register_fsdp_forward_method(wrapped_model, "generate")
    torch.testing.assert_close(wrapped_model.generate(x), ref.generate(x) + 10)
    wrapped_model.logits = types.MethodType(lambda self, x: self.layers[0](x), wrapped_model)  # type: ignore[attr-defined]
    register_fsdp_forward_method(wrapped_model, "logits")
    logits = wrapped_model.logits(x)  # type: ignore[operator]
    torch.testing.assert_close(logits, ref.layers[0](x))
    logits.sum().backward()  # the root kept its parameters for backward, as in FSDP2
    assert all(isinstance(p, DTensor) for p in wrapped_model.parameters())
    assert wrapped_model.layers[0].weight.grad is not None


def test_register_fsdp_forward_method() -> None:
    run_ranks(2, _forward_method)


# ---- mixture of experts: ranks use different parameters of one group ------------------------------


class TwoExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(7, 3), nn.Linear(7, 3)])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](x)


def routed_batches():  # type: ignore[no-untyped-def]
    """``make_batch`` for random_batches: the k-th batch made (rank k % world_size) is routed to expert k % 2."""
    counter = iter(range(10**6))

    def make(gen: torch.Generator):  # type: ignore[no-untyped-def]
        x, y = regression_batch(gen)
        return x, y, next(counter) % 2

    return make


def routed_loss(model: nn.Module, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, y, expert = batch
    return nn.functional.mse_loss(model(x, expert), y)


def shard_experts(model: nn.Module) -> None:
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)


def _unused_params(rank: int, world_size: int) -> None:
    trace, _ = run_parity(rank, world_size, TwoExperts, shard_experts, routed_batches(), routed_loss)
    assert all(g is not None for g in trace.grads[0].values())  # zeros were reduced for the unused expert


def test_reduce_scatter_unused_params() -> None:
    run_ranks(2, _unused_params)


def shard_with_comm_options(model: nn.Module) -> None:
    shard_transformer(model)
    model.set_reduce_scatter_max_input_buffers(3)
    model.set_separate_reduce_scatter_group()
    model.blocks[0].set_force_sum_reduction_for_comms(True)
    model._set_unshard_async_op(True)  # FSDP2's private switch: accepted, training unchanged (parity below)
    model.blocks[1].set_allocate_memory_from_process_group_for_comm(True)  # gloo has no allocator: the default one


def _comm_options(rank: int, world_size: int) -> None:
    allocated: list[tuple[int, ...]] = []
    allocate = ProcessGroupAllocated.allocate

    def counted(self: ProcessGroupAllocated, size: tuple[int, ...], **kw: Any) -> torch.Tensor:
        allocated.append(tuple(size))
        return allocate(self, size, **kw)

    ProcessGroupAllocated.allocate = counted  # type: ignore[method-assign]
    _, model = run_parity(rank, world_size, Transformer, shard_with_comm_options, token_batch, lm_loss)
    ProcessGroupAllocated.allocate = allocate  # type: ignore[method-assign]
    group = state_of(model.blocks[1]).group
    assert isinstance(group.all_gather_comm, ProcessGroupAllGather)
    assert isinstance(group.reducer.settings.custom_comm, ProcessGroupReduceScatter)
    # all-gather outputs, reduce-scatter inputs and outputs: 1-D sizes, as FSDP2 asks for them
    assert allocated and all(len(size) == 1 for size in allocated)
    assert state_of(model.blocks[0]).group.all_gather_comm is None  # that module's groups only
    model.blocks[1].set_allocate_memory_from_process_group_for_comm(False)
    assert group.all_gather_comm is None and group.reducer.settings.custom_comm is None
    group = state_of(model.blocks[0]).group
    settings = group.reducer.settings
    assert settings.reduce_scatter_group is not None and settings.reduce_scatter_group != group.mesh_info.shard_group
    assert settings.force_sum_reduction and not state_of(model.blocks[1]).group.reducer.settings.force_sum_reduction
    assert all(s.group.reducer.settings.max_inputs_in_flight == 3 for s in states_in(model))
    model.blocks[0].set_reduce_scatter_max_input_buffers(2, recurse=False)  # this group only
    assert [s.group.reducer.settings.max_inputs_in_flight for s in states_in(model)] == [3, 2, 3]
    with pytest.raises(TypeError, match="max_input_buffers must be an int, got bool"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="max_input_buffers must be a positive int, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="_set_unshard_async_op: async_op must be a bool"):
        model._set_unshard_async_op(1)
    model.blocks[1].set_custom_reduce_scatter(_OwnReduceScatter())
    with pytest.raises(AssertionError, match="when reduce scatter comm is custom: _OwnReduceScatter"):
        model.blocks[1].set_allocate_memory_from_process_group_for_comm(True)
    for method in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        with pytest.raises(TypeError, match=f"{method}: comm must be a torch.distributed.fsdp"):
            getattr(model, method)(object())


class _OwnReduceScatter:
    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def test_comm_options() -> None:
    run_ranks(2, _comm_options)


def _symm_mem(rank: int, world_size: int) -> None:
    """``set_symm_mem_for_comm`` as FSDP2 checks it: beside the process group's allocator or a custom comm an
    ``AssertionError``; where torch has no NCCL symmetric memory (this CPU build) torch's own ``RuntimeError``, as
    FSDP2 raises; where it has, a warning, and the buffers and values are those of the default."""
    from torch.distributed import _symmetric_memory as symm_mem

    torch.manual_seed(0)
    model = Transformer()
    shard_transformer(model)
    model.blocks[1].set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(AssertionError, match=r"set_symm_mem\(\) when all gather comm is custom: ProcessGroupAllGather"):
        model.blocks[1].set_symm_mem_for_comm()
    model.blocks[1].set_allocate_memory_from_process_group_for_comm(False)
    model.blocks[0].set_custom_reduce_scatter(_OwnReduceScatter())
    try:
        symm_mem.set_backend("NCCL")
    except RuntimeError as torch_error:
        with pytest.raises(RuntimeError) as ours:
            model.blocks[1].set_symm_mem_for_comm()
        assert str(ours.value) == str(torch_error) and not isinstance(ours.value, AssertionError)
    backends: list[str] = []
    set_backend = symm_mem.set_backend
    symm_mem.set_backend = backends.append  # type: ignore[assignment]  # a torch that has it
    try:
        with pytest.raises(AssertionError, match="when reduce scatter comm is custom: _OwnReduceScatter"):
            model.blocks[0].set_symm_mem_for_comm()

        def shard(m: nn.Module) -> None:
            shard_transformer(m)
            with pytest.warns(UserWarning, match="does not allocate its collective buffers from symmetric memory"):
                m.set_symm_mem_for_comm()

        _, sharded = run_parity(rank, world_size, Transformer, shard, token_batch, lm_loss)
    finally:
        symm_mem.set_backend = set_backend
    assert backends == ["NCCL", "NCCL"]  # blocks[0]'s group, then the root's (the check comes after, as FSDP2)
    assert all(s.group.all_gather_comm is None for s in states_in(sharded))


def test_symm_mem_for_comm() -> None:
    run_ranks(2, _symm_mem)
