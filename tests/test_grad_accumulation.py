"""Gradient accumulation across micro-batches: no sync, no all-reduce (HSDP), kept unsharded, not last backward."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FSDPModule, MixedPrecisionPolicy, fully_shard
from fullshard.group import ShardedState
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import full_params, random_batches, regression_batch, run_parity, sgd_momentum, token_batch
from tests.test_runtime_cases import SideBlock


def two_micro_batches(mode: str, world_size: int, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Back-propagate the first micro-batch here (without sync on the sharded model) and return the second's loss.

    The reference scales the first loss by 1/world_size itself, as ``train`` does for the returned one.
    """
    first, second = tokens[:2], tokens[2:]
    if not isinstance(model, FSDPModule):
        (lm_loss(model, first) / world_size).backward()
        return lm_loss(model, second)
    if mode == "synced":
        pass  # both backwards reduce; the second adds into the sharded gradients of the first
    elif mode == "no_all_reduce":
        model.set_requires_all_reduce(False)
    elif mode in ("not_last_backward", "never_last_backward"):
        model.set_is_last_backward(False)
    else:
        model.set_requires_gradient_sync(False)
    if mode == "keep_unsharded":
        model.set_reshard_after_backward(False)
    lm_loss(model, first).backward()
    if mode == "no_all_reduce":
        assert all(p.grad is None for p in model.parameters()), "partial sums must not show as gradients"
    if mode in ("synced", "not_last_backward", "never_last_backward"):
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"a backward that reduced must assign its gradients: {missing}"
    model.set_requires_gradient_sync(True)
    model.set_requires_all_reduce(True)
    if mode != "never_last_backward":  # then every backward of every step runs with the flag False
        model.set_is_last_backward(True)
    if mode != "keep_unsharded":
        return lm_loss(model, second)
    assert all(state_of(b).group.state is ShardedState.UNSHARDED for b in model.blocks)
    model.set_reshard_after_backward(True)
    rec = CommRecorder(model)
    loss = lm_loss(model, second)
    rec.close()
    assert rec.count("ag") == 0, f"blocks were kept unsharded, yet {rec.events}"
    return loss


def shard_for(mode: str, model: nn.Module) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if mode == "no_all_reduce" else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode == "bf16" else None
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def bf16_reference(loss_fn, model, tokens):  # type: ignore[no-untyped-def]
    from tests.test_mixed_precision import reference_casts

    return reference_casts(loss_fn, torch.bfloat16, None)(model, tokens)


def _accumulate(rank: int, world_size: int, mode: str) -> None:
    loss_fn = functools.partial(two_micro_batches, mode, world_size)
    tol = {}
    if mode == "bf16":
        loss_fn = functools.partial(bf16_reference, loss_fn)
        tol = {"rtol": 2e-2, "atol": 2e-2}
    run_parity(rank, world_size, Transformer, functools.partial(shard_for, mode), token_batch, loss_fn, steps=3, **tol)


@pytest.mark.parametrize(
    ("mode", "world_size"),
    [("no_sync", 2), ("keep_unsharded", 2), ("bf16", 2), ("not_last_backward", 2), ("never_last_backward", 2),
     ("no_all_reduce", 4), ("synced", 2)],
)
def test_accumulation_parity(mode: str, world_size: int) -> None:
    run_ranks(world_size, _accumulate, mode)


def _no_sync_is_silent(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Transformer()
    shard_for("no_sync", model)
    model.set_requires_gradient_sync(False)
    rec = CommRecorder(model)
    lm_loss(model, torch.randint(0, 37, (2, 10))).backward()
    assert rec.count("rs") == 0 and rec.count("ar") == 0, rec.events
    assert all(p.grad is None for p in model.parameters())


def test_no_sync_backward_issues_no_reduction() -> None:
    run_ranks(2, _no_sync_is_silent)


class _TiedAfter(nn.Module):
    """pre and post sharded apart and tied after every fully_shard call: the root, which holds no parameter of its
    own, forms a group for the tied weight at lazy init."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.post = nn.Linear(6, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.mid(self.pre(x))))


def _sync_set_before_lazy_init(rank: int, world_size: int) -> None:
    """set_requires_gradient_sync(False) before the first forward also holds for the group the root forms at lazy
    init (it was lost: the root group reduce-scattered in every no-sync backward, and on an HSDP mesh ranks that
    had run a forward before the call all-reduced in another order than those that had not)."""
    torch.manual_seed(0)
    ref = _TiedAfter()
    ref.post.weight = ref.pre.weight
    torch.manual_seed(0)
    model = _TiedAfter()
    for module in (model.pre, model.mid, model.post, model):
        fully_shard(module)
    model.post.weight = model.pre.weight
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randn(3, 6, generator=gen) for _ in range(world_size)] for _ in range(2)]
    rec = CommRecorder(model)
    model.set_requires_gradient_sync(False)
    model(batches[0][rank]).square().mean().backward()
    assert rec.count("rs") == 0, rec.events
    model.set_requires_gradient_sync(True)
    model(batches[1][rank]).square().mean().backward()
    assert rec.count("rs") == 2, rec.events  # mid's group and the root's (pre's and post's are empty)
    rec.close()
    for micro in batches:
        sum(ref(x).square().mean() for x in micro).div(world_size).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad, msg=name)


def test_gradient_sync_set_before_lazy_init_holds_for_a_group_formed_there() -> None:
    run_ranks(2, _sync_set_before_lazy_init)


def _first_gradient_in_a_later_micro_batch(rank: int, world_size: int) -> None:
    """bf16 compute, fp32 reduction: a no-sync backward accumulates in fp32, so a parameter whose first
    gradient comes in the synced micro-batch (a layer skipped before) is reduced beside fp32 sums."""
    gen = torch.Generator().manual_seed(1)
    micro = [torch.randn(3, 7, generator=gen) + rank for _ in range(2)]
    grads = []
    for sync_first in (False, True):
        torch.manual_seed(0)
        model = SideBlock()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        model.set_requires_gradient_sync(sync_first)
        model(micro[0], use_side=False).float().square().mean().backward()
        model.set_requires_gradient_sync(True)
        model(micro[1], use_side=True).float().square().mean().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_first_gradient_in_a_later_micro_batch_with_fp32_reduction() -> None:
    run_ranks(2, _first_gradient_in_a_later_micro_batch)


class _Branch(nn.Module):
    """``branch`` (sharded on its own) runs only when asked: the same decision on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.branch, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.first(x)
        return self.last(self.branch(h) if use_branch else h)


def _branch_pair(mixed: bool) -> tuple[nn.Module, nn.Module]:
    """The unsharded reference and a copy with every module sharded (bf16 compute, fp32 reduce when ``mixed``)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    torch.manual_seed(0)
    ref = _Branch()
    torch.manual_seed(0)
    model = _Branch()
    for module in (model.first, model.branch, model.last, model):
        fully_shard(module, **({"mp_policy": policy} if policy else {}))
    return ref, model


def _branch_only_without_sync(rank: int, world_size: int, mixed: bool) -> None:
    """A group whose modules ran only in the micro-batch without sync is reduced at the end of the synced one
    (its gradients were left unreduced: the step trained it with none, and a later synced backward through it
    would have added this step's into another's)."""
    ref, model = _branch_pair(mixed)
    gen = torch.Generator().manual_seed(1)
    tol = {"rtol": 2e-2, "atol": 2e-2} if mixed else {}
    for step, branch_in in enumerate((0, 0, 1)):  # the micro-batch that runs the branch
        micro = [[torch.randn(2, 4, generator=gen) for _ in range(2)] for _ in range(world_size)]
        for i, x in enumerate(micro[rank]):
            model.set_requires_gradient_sync(i == 1)
            model(x, use_branch=i == branch_in).float().square().mean().backward()
        ref.zero_grad()
        for rank_micro in micro:
            for i, x in enumerate(rank_micro):
                (ref(x, use_branch=i == branch_in).square().mean() / world_size).backward()
        expected = {name: p.grad for name, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            assert p.grad is not None, f"step {step}: {name} has no gradient"
            torch.testing.assert_close(p.grad.full_tensor(), expected[name], msg=f"step {step}: {name}", **tol)
        model.zero_grad()


@pytest.mark.parametrize("mixed", [False, True])
def test_group_run_only_without_sync_is_reduced(mixed: bool) -> None:
    run_ranks(2, _branch_only_without_sync, mixed)


def _reset_drops_accumulated(rank: int, world_size: int, mixed: bool) -> None:
    """``zero_grad()`` between micro-batches without sync reaches the sharded gradients only, not the unsharded
    ones accumulated so far (as on FSDP2); ``reset_iter_state()`` drops those, so the step is the next
    micro-batch's alone."""
    ref, model = _branch_pair(mixed)
    gen = torch.Generator().manual_seed(1)
    micro = [[torch.randn(2, 4, generator=gen) for _ in range(2)] for _ in range(world_size)]
    for drop in (model.zero_grad, model.reset_iter_state):
        model.set_requires_gradient_sync(False)
        model(micro[rank][0], use_branch=True).float().square().mean().backward()
        drop()
        model.set_requires_gradient_sync(True)
        model(micro[rank][1], use_branch=True).float().square().mean().backward()
        ref.zero_grad()
        kept = [0, 1] if drop == model.zero_grad else [1]
        for rank_micro in micro:
            for i in kept:
                (ref(rank_micro[i], use_branch=True).square().mean() / world_size).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref.get_parameter(name).grad, msg=f"{drop.__name__}: {name}",
                                       **({"rtol": 2e-2, "atol": 2e-2} if mixed else {}))
        model.zero_grad()


@pytest.mark.parametrize("mixed", [False, True])
def test_reset_iter_state_drops_gradients_accumulated_without_sync(mixed: bool) -> None:
    run_ranks(2, _reset_drops_accumulated, mixed)


def _uneven_micro_batch_counts(rank: int, world_size: int) -> None:
    """Ranks running different numbers of micro-batches (dynamic batching), where the parameters stay unsharded
    between them (``reshard_after_forward=False``, ``set_reshard_after_backward`` on the last only), so the extra
    ones issue no collectives: trains as the unsharded model on all micro-batches of all ranks, with no false
    divergence alarm (each rank's sum of micro-batch losses, averaged over the ranks)."""
    torch.manual_seed(0)
    ref, model = MLP(), MLP()
    model.load_state_dict(ref.state_dict())
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt, ref_opt = sgd_momentum(model.parameters()), sgd_momentum(ref.parameters())
    counts = [[3, 1], [1, 4], [2, 2]]  # [step][rank]
    batches = random_batches(len(counts), 4 * world_size, regression_batch)
    for step, per_rank in enumerate(counts):
        for r, n in enumerate(per_rank):
            for m in range(n):
                (mse_loss(ref, batches[step][4 * r + m]) / world_size).backward()
        for m in range(per_rank[rank]):
            last = m == per_rank[rank] - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            mse_loss(model, batches[step][4 * rank + m]).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    torch.testing.assert_close(full_params(model), {n: p.detach() for n, p in ref.named_parameters()})


def test_ranks_run_different_numbers_of_micro_batches() -> None:
    run_ranks(2, _uneven_micro_batch_counts)
