"""Failing loudly and fast: collective timeouts, and naming the rank that died or fell behind.

[Note: Failure detection]
A rank that dies (killed, crashed) closes its connections: gloo peers waiting
on it fail at once, NCCL peers when the watchdog notices. A rank that stops
taking part but stays alive (a deadlock, a rank waiting on input, a rank that
skipped a module) leaves its peers waiting. fullshard bounds that wait and
says who is at fault:

- Every wait for a fullshard collective on the host (CPU tensors: gloo) gives
  up after ``collective_timeout()`` seconds (default 300, set with
  ``set_collective_timeout``). On accelerators the waits are stream-level and
  never block the host; there the process group's own timeout
  (``init_process_group(timeout=...)``, and NCCL's watchdog) bounds a hang.
- Each process publishes a heartbeat in the process group's store from a
  daemon thread every ``HEARTBEAT_S`` seconds: a counter and how many fullshard
  collectives it has issued. Nothing on the training path touches the store.
- When a collective fails or times out, the rank compares the heartbeats over
  a few intervals: a rank whose heartbeat stopped is *dead*; a live rank that
  issued fewer collectives is *behind* (stuck, or running other code). The
  ``RankFailureError`` names them (``.ranks``), with the transport's message as
  its cause.

Without a store (torch's fake process group), the error only says that a peer
failed.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

HEARTBEAT_S = 1.0
_KEY = "fullshard/heartbeat/"
_timeout_s = 300.0
_issued = 0  # fullshard collectives this process has issued
_heartbeat: threading.Thread | None = None


class RankFailureError(RuntimeError):
    """A peer rank died, or stopped taking part in fullshard's collectives; ``ranks`` names it (when known)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


def set_collective_timeout(seconds: float) -> None:
    """How long a rank waits for a fullshard collective on the host (gloo) before raising ``RankFailureError``."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"set_collective_timeout: seconds must be a number, got {type(seconds).__name__}")
    if not seconds > 0:
        raise ValueError(f"set_collective_timeout: seconds must be positive, got {seconds}")
    global _timeout_s
    _timeout_s = float(seconds)


def collective_timeout() -> float:
    return _timeout_s


def issued() -> None:
    """Count one fullshard collective (published by the heartbeat)."""
    global _issued
    _issued += 1


def _store() -> Any:
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def start_heartbeat() -> None:
    """Publish this rank's heartbeat from a daemon thread (once per process; no-op without a store)."""
    global _heartbeat
    if _heartbeat is not None and _heartbeat.is_alive():
        return
    store = _store()
    if store is None:
        return
    key = f"{_KEY}{dist.get_rank()}"

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                store.set(key, f"{count} {_issued}")
            except Exception:  # the store is gone: the job is ending
                return
            time.sleep(HEARTBEAT_S)

    _heartbeat = threading.Thread(target=beat, name="fullshard-heartbeat", daemon=True)
    _heartbeat.start()


def _read(store: Any, ranks: list[int]) -> dict[int, tuple[int, int] | None]:
    beats: dict[int, tuple[int, int] | None] = {}
    for rank in ranks:
        try:
            if store.check([f"{_KEY}{rank}"]):
                count, done = store.get(f"{_KEY}{rank}").decode().split()
                beats[rank] = (int(count), int(done))
            else:
                beats[rank] = None
        except Exception:
            beats[rank] = None
    return beats


def diagnose(group: dist.ProcessGroup | None) -> tuple[list[int], list[int], str]:
    """(dead ranks, ranks behind this one, a sentence) for the ranks of ``group``; takes about 3 heartbeats."""
    store = _store()
    if store is None or _heartbeat is None:
        return [], [], "a peer rank failed (no store to tell which)"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    others = [r for r in ranks if r != me]
    first = _read(store, others)
    time.sleep(2.5 * HEARTBEAT_S)
    second = _read(store, others)
    dead = [r for r in others if second[r] is None or first[r] is not None and second[r] == first[r]]
    behind = [r for r in others if r not in dead and (beat := second[r]) is not None and beat[1] < _issued]
    parts = []
    if dead:
        parts.append(f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} stopped (died or was killed)")
    if behind:
        parts.append(
            f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} issued fewer fullshard collectives "
            f"than rank {me} ({_issued}): stuck, or running other code"
        )
    if not parts:
        parts.append("every peer is alive and issued as many collectives: a collective outside fullshard is waiting")
    return dead, behind, "; ".join(parts)


def wait(work: dist.Work, what: str, group: dist.ProcessGroup | None) -> None:
    """``work.wait()`` bounded by the collective timeout; failures become ``RankFailureError`` naming the rank."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=_timeout_s))
    except RuntimeError as err:
        timed_out = "timed out" in str(err).lower()
        dead, behind, sentence = diagnose(group)
        cause = f"did not complete within {_timeout_s:g} s" if timed_out else "failed"
        raise RankFailureError(f"fullshard: {what} on rank {dist.get_rank()} {cause}: {sentence}",
                               tuple(dead or behind)) from err
