"""The harness reports what each rank did: results, tracebacks, and the stacks of hung ranks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor(float(rank))
    dist.all_reduce(t)
    return t.item()


def _rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("only on rank one")
    dist.barrier()  # rank 0 blocks here until the harness stops it


def _rank0_sleeps_forever(rank: int, world_size: int) -> None:
    if rank == 0:
        while True:
            time.sleep(0.05)


def test_results_come_back_by_rank() -> None:
    assert run_ranks(4, _sum_ranks) == [6.0, 6.0, 6.0, 6.0]


def test_failing_rank_traceback_is_reported() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _rank1_raises, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message and "KeyError: 'only on rank one'" in message
    # rank 0 either sees the peer's exit in its barrier or is stopped after the grace period
    assert "rank 0 raised" in message or "rank 0 stopped after another rank failed" in message


def test_hung_rank_times_out_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _rank0_sleeps_forever, timeout=3)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank 0 timed out after 3s" in message
    assert "_rank0_sleeps_forever" in message  # the hung rank's Python stack


def _rank1_crashes(rank: int, world_size: int) -> None:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV
    dist.barrier()


def test_crashed_rank_reports_exit_code_and_stack() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _rank1_crashes, timeout=60)
    message = str(info.value)
    assert "rank 1 exited without a result (exit code -11)" in message
    assert "_rank1_crashes" in message  # faulthandler's stack of the crash
