"""A rank that dies or stops taking part: the others fail within a bounded time, naming it."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard import RankFailureError, fully_shard
from fullshard.cli import launch
from fullshard.group import ShardedState
from fullshard.runtime import state_of
from tests.harness import run_ranks
from tests.models import MLP, mse_loss
from tests.parity import regression_batch


def _step(model: torch.nn.Module, seed: int) -> None:
    mse_loss(model, regression_batch(torch.Generator().manual_seed(seed))).backward()


def _sharded_mlp(timeout: float) -> MLP:
    fullshard.set_collective_timeout(timeout)
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _worker(rank: int, world_size: int, out: str, mode: str) -> None:
    model = _sharded_mlp(3)
    _step(model, 0)  # every rank took part once: heartbeats are running
    time.sleep(1.5)
    if rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":  # done a step before the others (data of different lengths per rank), as a script ends
            torch.distributed.destroy_process_group()
            return
        time.sleep(120)  # alive, but not taking part
    start = time.monotonic()
    try:
        _step(model, 1)
    except RankFailureError as err:
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"message": str(err), "ranks": list(err.ranks), "seconds": time.monotonic() - start}))
        raise


@pytest.mark.parametrize("mode", ["kill", "stuck", "exit"])
def test_survivors_name_the_failed_rank(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "GRACE_S", 8.0)  # the survivors take about 3 s to name the rank
    start = time.monotonic()
    with pytest.raises(launch.RankFailed) as info:
        launch.run(_worker, 3, str(tmp_path), mode)
    took = time.monotonic() - start
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["ranks"] == [1]
    if mode == "kill":
        assert str(info.value) == "rank 1 was killed by SIGKILL"
        assert "rank 1 stopped (died or was killed)" in report["message"]
        assert report["seconds"] < 10
    elif mode == "exit":  # its process group destroyed, its process ended: it left that mark
        assert info.value.rank in (0, 2)
        assert re.search(r"rank 1 exited after issuing \d+ fullshard collectives \(rank 0: \d+\): the ranks ran "
                         r"different numbers of steps", report["message"]), report["message"]
        assert report["seconds"] < 10
    else:
        # Rank 0 gives up first (rank 2 waits on rank 0 in the next collective, or times out as well).
        assert info.value.rank in (0, 2)
        assert "did not complete within 3 s: rank 1 issued fewer fullshard collectives than rank 0" in report["message"]
        assert 3 <= report["seconds"] < 15
    assert took < 60, f"the group took {took:.0f} s to come down"


def test_collective_timeout_is_settable() -> None:
    before = fullshard.collective_timeout()
    assert before == 300
    fullshard.set_collective_timeout(12.5)
    try:
        assert fullshard.collective_timeout() == 12.5
    finally:
        fullshard.set_collective_timeout(before)


class Blocks(torch.nn.Module):
    """Three same-shaped blocks: mismatched collectives between them have equal sizes (they would mix silently)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x


def sharded_blocks(timeout: float, mesh: Any = None) -> Blocks:
    """Three same-shaped blocks, each its own group, and a collective timeout short enough for a test."""
    fullshard.set_collective_timeout(timeout)
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


ORDERS = {  # per rank: the blocks it runs
    "twice": [[0, 1, 1, 2], [0, 1, 2]],
    "skip": [[0, 1, 2], [0, 2]],
    "reordered": [[0, 1, 2], [0, 2, 1]],
}


def _diverge(rank: int, world_size: int, case: str) -> tuple[str, str, float]:
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    model(x, [0, 1, 2]).sum().backward()  # a matching iteration first
    start = time.monotonic()
    try:
        model(x, ORDERS[case][rank]).sum().backward()
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("case", sorted(ORDERS))
def test_diverged_ranks_raise_the_same_error(case: str) -> None:
    results = run_ranks(2, _diverge, case, timeout=90)
    assert [kind for kind, _, _ in results] == ["DivergenceError", "DivergenceError"], results
    assert results[0][1] == results[1][1]
    message = results[0][1]
    assert "ranks ran different code in this iteration" in message
    assert "of group 'blocks." in message
    assert all(seconds < 10 for _, _, seconds in results), results


class DataError(Exception):
    pass


def _abandoned_backward(rank: int, world_size: int) -> tuple[str, str, float]:
    """Rank 1's backward raises in a hook; it catches that and goes on to the next step, while rank 0 waits in
    the reduce-scatter rank 1 never issued (gloo's reduce-scatter ignores the wait timeout, so rank 0 cannot
    look; rank 1's end check reads rank 0's posted wait)."""
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    start = time.monotonic()
    fail = {"now": False}

    def raise_in_backward(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if fail["now"]:  # after blocks.2's reduce-scatter went out, before blocks.1's
            out.register_hook(lambda grad: (_ for _ in ()).throw(DataError("bad batch")))

    model.blocks[1].register_forward_hook(raise_in_backward)
    for step in range(3):
        fail["now"] = rank == 1 and step == 1
        try:
            # rank 1's next forward begins with the end check of the abandoned iteration
            model(x, [0, 1, 2]).sum().backward()
        except DataError:
            continue
        except fullshard.DivergenceError as err:
            return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_a_rank_that_abandons_a_backward_is_a_divergence() -> None:
    results = run_ranks(2, _abandoned_backward, timeout=90)
    assert [kind for kind, _, _ in results] == ["DivergenceError", "DivergenceError"], results
    assert results[0][1] == results[1][1]
    assert "rank 1 finished its iteration after" in results[0][1] and "while rank 0 waits in #" in results[0][1]
    assert all(seconds < 15 for _, _, seconds in results), results


class Uneven(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        return self.b(self.a(x)) if a_first else self.a(self.b(x))


def _mismatched_sizes(rank: int, world_size: int) -> tuple[str, str, float]:
    fullshard.set_collective_timeout(20)
    torch.manual_seed(0)
    model = Uneven()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    model(torch.randn(2, 8), True).sum().backward()
    start = time.monotonic()
    try:
        model(torch.randn(2, 8), rank == 0).sum().backward()  # rank 1 all-gathers b where rank 0 gathers a
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_collectives_of_different_sizes_raise_divergence_on_every_rank() -> None:
    """gloo would abort the rank receiving a message of the wrong size: the check before each collective
    finds the difference first, and every rank raises the same error."""
    results = run_ranks(2, _mismatched_sizes, timeout=90)
    assert [kind for kind, _, _ in results] == ["DivergenceError", "DivergenceError"], results
    assert results[0][1] == results[1][1]
    message = results[0][1]
    assert "all-gather of group 'a' (36 elements)" in message and "all-gather of group 'b' (32 elements)" in message
    assert all(seconds < 10 for _, _, seconds in results), results


def _forward_only(rank: int, world_size: int, trained: bool) -> tuple[str, str]:
    model = sharded_blocks(20)
    x = torch.randn(4, 8)
    if trained:  # the ranks have compared a whole iteration: collectives that follow it go out without a check
        model(x, [0, 1, 2]).sum().backward()
    try:
        with torch.no_grad():
            model(x, [0, 1, 2] if rank == 0 else [0, 2, 1])  # evaluation: no backward, no end-of-backward check
        model(x, [0, 1, 2]).sum().backward()  # training goes on
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.parametrize("trained", [False, True])
def test_forward_only_divergence_is_caught(trained: bool) -> None:
    results = run_ranks(2, _forward_only, trained, timeout=90)
    assert [kind for kind, _ in results] == ["DivergenceError", "DivergenceError"], results
    assert results[0][1] == results[1][1]
    assert "all-gather of group 'blocks." in results[0][1], results


def _hsdp_diverge(rank: int, world_size: int) -> tuple[str, str]:
    model = sharded_blocks(20, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    x = torch.randn(4, 8)
    model(x, [0, 1, 2]).sum().backward()
    try:
        model(x, [0, 1, 1, 2] if rank == 3 else [0, 1, 2]).sum().backward()
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err)
    return "no error", ""


def test_hsdp_divergence_of_one_rank_is_caught_on_every_rank() -> None:
    results = run_ranks(4, _hsdp_diverge, timeout=120)
    assert [kind for kind, _ in results] == ["DivergenceError"] * 4, results
    # Rank 3's shard group (2, 3) finds it before the all-gather; ranks 0 and 1 learn it in their next wait.
    assert len({message for _, message in results}) == 1, results
    message = results[0][1]
    assert "all-gather of group 'blocks.1' (36 elements)" in message and "rank 3" in message, message


def _checks_per_iteration(rank: int, world_size: int) -> list[int]:
    """How many collectives are compared before they go out, per backward, in plain training and then with
    gradient accumulation (two micro-batches without gradient sync, one with)."""
    from fullshard import failures

    compared = []
    real = failures.Monitor._compare

    def counting(monitor: Any, ticket: Any, row: tuple[int, int, int], *args: Any) -> None:
        if row[0] == failures._BEFORE:
            compared.append(row[1])
        real(monitor, ticket, row, *args)

    failures.Monitor._compare = counting  # type: ignore[method-assign]
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    counts = []
    for step in range(9):
        sync = step < 3 or step % 3 == 2
        model.set_requires_gradient_sync(sync)
        model(x, [0, 1, 2]).sum().backward()
        counts.append(len(compared))
        compared.clear()
    return counts


def test_steady_state_compares_only_where_known_schedules_branch() -> None:
    counts = run_ranks(2, _checks_per_iteration, timeout=90)
    assert counts[0] == counts[1]
    first, *rest = counts[0]
    assert first >= 9, counts  # every collective of the first iteration (3 blocks: all-gathers, reduce-scatters)
    assert rest[:2] == [0, 0], counts  # the same iteration again: nothing
    # Accumulating: a step's three micro-batches are one segment (end checks come at backwards with gradient sync
    # only). The first such step leaves the known iteration where its first micro-batch reduces nothing: from there
    # on it compares every collective. Then it is known too, and each step compares once, where the two branch.
    assert rest[2] == 1 and rest[3:5] == [6, 9], counts
    assert rest[5:] == [1, 0, 0], counts


def _slow_rank(rank: int, world_size: int) -> list[float]:
    model = sharded_blocks(30)
    x = torch.randn(4, 8) + rank
    losses = []
    for step in range(3):
        out = model(x, [0, 1, 2])
        if step == 1 and rank == 2:
            time.sleep(3.5)  # the others wait in their collectives for several looks
        loss = out.sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_a_slow_rank_is_not_a_divergence() -> None:
    results = run_ranks(3, _slow_rank, timeout=120)
    assert all(len(losses) == 3 for losses in results), results


def _timeout_raised_later(rank: int, world_size: int) -> list[float]:
    model = sharded_blocks(1.5)  # the checks' own backends are built under this timeout at the first forward
    x = torch.randn(4, 8) + rank
    losses = []
    for step in range(2):
        if step == 1:
            fullshard.set_collective_timeout(30)
            with torch.no_grad():
                model(x, [0, 1, 2])  # evaluation: its check runs at the next forward
            if rank == 0:
                time.sleep(3)  # e.g. writing a report on rank 0 alone: longer than the first timeout only
        loss = model(x, [0, 1, 2]).sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_a_timeout_raised_after_the_first_forward_holds() -> None:
    """``set_collective_timeout`` applies to the divergence checks' backends built before it too (they kept
    the first timeout, so the late rank's peer raised ``RankFailureError`` after 1.5 s)."""
    results = run_ranks(2, _timeout_raised_later, timeout=120)
    assert all(len(losses) == 2 for losses in results), results


def _sync_on_one_rank(rank: int, world_size: int, before: list[bool]) -> tuple[str, str]:
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    for sync in before:
        model.set_requires_gradient_sync(sync)
        model(x, [0, 1, 2]).sum().backward()
    model.set_requires_gradient_sync(rank == 1)  # rank 0 accumulates, rank 1 reduces
    try:
        model(x, [0, 1, 2]).sum().backward()
        model.set_requires_gradient_sync(True)
        model(x, [0, 1, 2]).sum().backward()
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.parametrize("before", [[True], [False, True]], ids=["after-synced", "after-accumulating"])
def test_gradient_sync_on_one_rank_only_is_a_divergence(before: list[bool]) -> None:
    results = run_ranks(2, _sync_on_one_rank, before, timeout=90)
    assert [kind for kind, _ in results] == ["DivergenceError", "DivergenceError"], results
    assert results[0][1] == results[1][1]
    assert "reduce-scatter of group 'blocks.2'" in results[0][1], results


def _replica_evaluates(rank: int, world_size: int, late: int) -> None:
    """HSDP 2x2: replica 0 (ranks 0 and 1) runs an extra no_grad evaluation with ``unshard()`` before one step,
    replica 1 does not (their all-gathers stay inside each shard group), and one rank is seconds late."""
    from torch import nn

    from tests.models import Transformer, lm_loss
    from tests.parity import assert_parity, random_batches, token_batch, train

    fullshard.set_collective_timeout(30)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    ref = Transformer()
    torch.manual_seed(0)
    model = Transformer()
    for layer in model.blocks:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = random_batches(4, world_size, token_batch)
    steps = iter(range(len(batches)))

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        step = next(steps)
        if step == 2 and rank == late:
            time.sleep(3)
        if step == 2 and mesh.get_local_rank("replicate") == 0:
            with torch.no_grad():
                m.unshard()
                m(batch[:, :-1])
        m.unshard()
        return lm_loss(m, batch)

    assert_parity(train(ref, batches, lm_loss, rank=None), train(model, batches, loss_fn, rank=rank), rank)


@pytest.mark.parametrize("late", [0, 3], ids=["late-in-evaluating-replica", "late-in-other-replica"])
def test_evaluation_on_one_hsdp_replica_is_not_a_divergence(late: int) -> None:
    """FSDP2 trains this with parity; the checks compare each shard group's and replicate group's collectives
    apart, so one replica's extra all-gathers are never compared with the other replica's."""
    run_ranks(4, _replica_evaluates, late, timeout=120)


def _store_keys(rank: int, world_size: int, hsdp: bool) -> list[int]:
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = sharded_blocks(30, mesh)
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(4, 8)
    counts = []
    for step in range(12):
        if step % 3 == 2:
            with torch.no_grad():
                model(x, [0, 1, 2])  # an evaluation pass between training steps
        model.set_requires_gradient_sync(step % 2 == 0)
        model(x, [0, 1, 2]).sum().backward()
        dist.barrier()
        counts.append(store.num_keys())
    return counts


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_store_keys_do_not_grow_with_steps(hsdp: bool) -> None:
    """Nothing is written per step: the heartbeat key and the check groups' rendezvous keys, set once."""
    counts = run_ranks(4 if hsdp else 2, _store_keys, hsdp, timeout=120)[0]
    assert len(set(counts[2:])) == 1, counts


def _inference_loop(rank: int, world_size: int) -> list[int]:
    from fullshard import failures

    before, ends = [], []
    real = failures.Monitor._compare

    def counting(monitor: Any, ticket: Any, row: tuple[int, int, int], *args: Any) -> None:
        (before if row[0] == failures._BEFORE else ends).append(row[1])
        real(monitor, ticket, row, *args)

    failures.Monitor._compare = counting  # type: ignore[method-assign]
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    counts = []
    with torch.no_grad():
        for _ in range(6):
            model(x, [0, 1, 2])
            counts.append(len(before))
            before.clear()
    return counts + [len(ends)]


def _submodule_loop(rank: int, world_size: int, grad: bool) -> list[int]:
    model = sharded_blocks(30)
    x = torch.randn(4, 8)
    model(x, [0, 1, 2]).sum().backward()
    tracks = [t for t in state_of(model).ctx.monitor.tracks.values() if t is not None]
    lengths = []
    for _ in range(6):  # a sharded submodule's forward on its own (an encoder's features, a get_*_features)
        with torch.set_grad_enabled(grad):
            out = model.blocks[1](x)
        if grad:
            out.sum().backward()
        lengths.append(max(len(t.entries) for t in tracks))
        # nothing prefetched for the blocks after it in the root's forward (they do not run here)
        assert [g.state for b in (0, 2) for g in state_of(model.blocks[b]).groups] == [ShardedState.SHARDED] * 2
    if not grad:  # a forward on its own that raises (caught) leaves nothing counted
        with pytest.raises(RuntimeError), torch.no_grad():
            model.blocks[1](torch.randn(4, 7))
        for _ in range(3):
            with torch.no_grad():
                model.blocks[1](x)
            lengths.append(max(len(t.entries) for t in tracks))
    from fullshard import failures

    ends = []
    real = failures.Monitor._end_check
    failures.Monitor._end_check = lambda monitor, track: (ends.append(1), real(monitor, track))[1]  # type: ignore
    try:
        for _ in range(3):  # a submodule run on the root's output, in the same backward: one end check per step
            model.blocks[2](model(x, [0, 1])).sum().backward()
    finally:
        failures.Monitor._end_check = real  # type: ignore[method-assign]
    return lengths + [len(ends)]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "trained"])
def test_submodule_loops_keep_one_forward_of_checks(grad: bool) -> None:
    """A loop over a sharded submodule's forward alone ends each one's list at the next, as root forwards do (an
    all-gather each), instead of growing it until a root forward; with backward each ends at its backward."""
    *lengths, ends = run_ranks(2, _submodule_loop, grad, timeout=60)[0]
    assert lengths == [0 if grad else 1] * (6 if grad else 9), lengths
    assert ends == (3 if grad else 4), ends  # (inference: the first root forward ends the last loop forward's list)


def test_forward_only_loops_reach_a_steady_state() -> None:
    """Inference: the first forward's all-gathers are compared one by one; from the second on, the forward
    that came before is compared whole at the next forward (one round trip) and its all-gathers go out as
    they are."""
    *per_forward, ends = run_ranks(2, _inference_loop, timeout=60)[0]
    assert per_forward[0] >= 3 and per_forward[1:] == [0] * 5, per_forward
    assert ends == 5, ends


def _new_mesh_later(rank: int, world_size: int) -> tuple[str, str]:
    model = sharded_blocks(20)
    x = torch.randn(4, 8)
    model(x, [0, 1, 2]).sum().backward()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for _ in range(2):  # join after training started, on rank sets no group had so far
        late = torch.nn.Linear(8, 8)
        fully_shard(late, mesh=mesh)
        model.blocks.append(late)
    model(x, [0, 1, 2, 3, 4]).sum().backward()
    try:  # the late blocks have one shape: swapped, collectives of one could pair with the other's
        model(x, [0, 1, 2, 4, 3] if rank == 3 else [0, 1, 2, 3, 4]).sum().backward()
    except fullshard.DivergenceError as err:
        return type(err).__name__, str(err)
    return "no error", ""


def test_divergence_in_a_group_on_a_new_mesh_is_caught() -> None:
    results = run_ranks(4, _new_mesh_later, timeout=120)
    assert [kind for kind, _ in results] == ["DivergenceError"] * 4, results
    assert len({message for _, message in results}) == 1, results
    message = results[0][1]
    assert "ranks ran different code in this iteration" in message and "of group 'blocks.4'" in message, message


def _new_mesh_skipped(rank: int, world_size: int) -> str:
    model = sharded_blocks(8)
    x = torch.randn(4, 8)
    model(x, [0, 1, 2]).sum().backward()
    late = torch.nn.Linear(8, 8)
    fully_shard(late, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    model.blocks.append(late)
    try:  # rank 3 never builds the new rank set's check: its peer there waits for it
        model(x, [0, 1, 2] if rank == 3 else [0, 1, 2, 3]).sum().backward()
    except (fullshard.RankFailureError, fullshard.DivergenceError) as err:
        return type(err).__name__
    return "no error"


def test_a_new_mesh_whose_peer_never_comes_is_a_rank_failure() -> None:
    assert set(run_ranks(4, _new_mesh_skipped, timeout=120)) <= {"RankFailureError", "DivergenceError"}


def _root_over_some_ranks(rank: int, world_size: int) -> list[float]:
    """Ranks 0 and 1 train a model sharded over their row of a (2, 2) mesh first, ranks 2 and 3 have none; then
    every rank trains one over all ranks: the roots' store keys agree on every rank they span (numbered per rank
    set), so nothing waits for keys a peer never writes."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "dp"))
    x = torch.randn(4, 8) + rank
    if rank < 2:
        sharded_blocks(20, mesh["dp"])(x, [0, 1, 2]).sum().backward()
    model = sharded_blocks(20)
    losses = []
    for _ in range(2):
        loss = model(x, [0, 1, 2]).sum()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_a_root_over_some_of_the_ranks_beside_one_over_all() -> None:
    results = run_ranks(4, _root_over_some_ranks, timeout=90)
    assert all(len(r) == 2 for r in results), results


def _one_group_never_synced(rank: int, world_size: int) -> list[int]:
    """A group whose gradient sync stays off (reduced by hand, local SGD) beside groups that reduce every step: the
    backwards that reduce still end the segments, so the lists stay one iteration long."""
    from fullshard import failures

    lengths = []
    real = failures.Monitor._end_check

    def recording(monitor: Any, track: Any) -> None:
        lengths.append(len(track.entries))
        real(monitor, track)

    failures.Monitor._end_check = recording  # type: ignore[method-assign]
    model = sharded_blocks(30)
    model.blocks[0].set_requires_gradient_sync(False, recurse=False)
    x = torch.randn(4, 8)
    for _ in range(4):
        model(x, [0, 1, 2]).sum().backward()
    return lengths


def test_a_group_never_synced_leaves_the_checks_per_step() -> None:
    lengths = run_ranks(2, _one_group_never_synced, timeout=90)
    assert lengths[0] == lengths[1] and len(lengths[0]) == 4 and len(set(lengths[0])) == 1, lengths



def _late_first_forward(rank: int, world_size: int) -> tuple[str, tuple[int, ...]] | None:
    model = _sharded_mlp(1)
    if rank == 1:  # still loading data, say, past the timeout: it never reaches the first forward here
        time.sleep(3)
        return None
    with pytest.raises(RankFailureError) as info:
        _step(model, 0)
    return str(info.value), info.value.ranks


def test_a_rank_late_to_the_first_forward_is_named() -> None:
    """The first forward sets up the divergence checks with every peer; one that does not come within the
    collective timeout is named by a RankFailureError (it was torch's DistStoreError, naming no rank)."""
    message, ranks = run_ranks(2, _late_first_forward)[0]
    assert ranks == (1,)
    assert message.startswith("fullshard: the first forward on rank 0 waited 1 s for the ranks [0, 1] to start "
                              "theirs: rank 1 did not"), message
