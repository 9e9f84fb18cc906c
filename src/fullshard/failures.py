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

[Note: Divergence check]
Ranks that run different code issue different collectives: a block run twice
on one rank, a module skipped on another. When the mismatched collectives
differ in size, the transport fails (gloo aborts the receiving rank; NCCL
hangs until its watchdog fires). When they have the same size (same-shaped
blocks), they succeed and silently mix the data of different parameters.
Every rank keeps the list of collectives it issued in the current iteration
(kind, group, element count; the list restarts at each root forward) and a
CRC-32 of it. Comparisons run on a gloo backend of their own per rank set,
built at lazy init (also in NCCL jobs: it needs no device work or sync, and it
completes when mismatched NCCL collectives hang on the device):

- At the end of each backward, the ranks of the root's shard group all-gather
  (end, count, CRC of the list). This catches a difference on NCCL before the
  optimizer step can use mixed gradients. A list found identical is *known*
  (the last ``KNOWN_SCHEDULES`` distinct ones are kept, the same on every rank).
- On gloo groups, a rank compares a collective with its peers before issuing
  it, in a 24-byte all-gather (before, index, CRC of the entry), unless every
  known schedule it has followed so far this iteration has this collective
  next: so in the first iteration every collective is compared, and later
  only where the known schedules branch (with and without gradient sync: at
  the first reduce-scatter) or where a rank's code departs from all of them.
  Steady state compares nothing or once per backward (a check per collective
  is a host round trip, about 0.4 ms on a loaded CPU machine; on every
  collective it cost 15% of the bench GPT's step). A rank that departs never
  issues the differing collective, so nothing is mixed and gloo never sees a
  size mismatch (which aborts the receiving rank). When all ranks depart
  alike (an evaluation pass, a schedule change decided on every rank) their
  checks pair and pass. When one rank departs alone, it waits in its check
  while its peers wait in the real collective: the store comparison below
  names both. The rows of both checks have one size, so a check before an
  extra collective pairs with a peer's end check and the difference shows.
  Ranks that follow the same known schedules compare at the same places, and
  every place two known schedules differ is compared, so two ranks cannot
  follow different ones unchecked.

On a difference the ranks exchange their lists and every rank raises the same
``DivergenceError`` naming the first collective that differs. The message is
also posted in the store (the first verdict of a check wins, so two ranks
that find it at once still agree): ranks outside the comparing group (the
other groups of an HSDP mesh) find it in their next wait and raise it too, and
the rank that posted waits up to a few seconds for every rank to have read it
(the store may live in its process).

A rank waiting on the host in a collective its peer never reaches (the peer
finished the iteration with fewer collectives and runs other code) looks in
the store between one-second slices of the wait: before its end check each
rank posts its count there, and a long wait posts which collective it waits
in. When a peer finished with fewer collectives or waits in another one, the
rank posts the verdict and raises; the peer reads it in its own wait.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

HEARTBEAT_S = 1.0
POLL_S = 1.0  # host waits longer than this look for failures between slices
# Store keys, per torchrun attempt (torchrun keeps its store across restarts).
_PREFIX = f"fullshard/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
_KEY = _PREFIX + "heartbeat/"
_AT_CHECK = _PREFIX + "at-check/"  # + "<check>/<rank>": "<count> <crc>", posted before each check
_VERDICT = _PREFIX + "verdict/"  # + "<check>": the DivergenceError message (the first posted wins)
_WAITING = _PREFIX + "waiting/"  # + "<check>/<rank>": "<index> <collective>" while a host wait is long
_checks = 0  # divergence checks this process has started
_check_groups: dict[tuple[int, ...], CheckGroup] = {}
_waiting: tuple[int, str, float] | None = None  # the host wait in progress: (index, collective, since)
_wait_published = False  # ... and it is posted in the store (removed when it ends)
_timeout_s = 300.0
_issued = 0  # fullshard collectives this process has issued
_heartbeat: threading.Thread | None = None
_schedule: list[str] = []  # this iteration's fullshard collectives, see [Note: Divergence check]
_schedule_crc = 0
_raised: set[str] = set()  # DivergenceError messages this process raised (a posted one is news only once)
_prechecked: dict[dist.ProcessGroup, CheckGroup] = {}  # gloo groups whose collectives may be compared first
KNOWN_SCHEDULES = 4
_known: list[tuple[str, ...]] = []  # distinct schedules end checks found identical on every rank, newest last
_candidates: list[tuple[str, ...]] = []  # the known schedules this iteration has followed so far
_BEFORE, _END = 0, 1  # what a check compares: the next collective, or the whole iteration


class DivergenceError(RuntimeError):
    """Ranks issued different fullshard collectives in one iteration (different code ran on them)."""


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


def issued(kind: str, label: str, numel: int, group: dist.ProcessGroup | None = None) -> int:
    """Count one fullshard collective (published by the heartbeat) and add it to this iteration's schedule;
    return its index there. Call it before issuing the collective on ``group``: on gloo groups the ranks
    compare it first and raise ``DivergenceError`` when it differs ([Note: Divergence check])."""
    global _issued, _schedule_crc, _candidates
    _issued += 1
    entry = f"{kind} of group {label!r} ({numel} elements)"
    _schedule.append(entry)
    data = entry.encode()
    _schedule_crc = zlib.crc32(data, _schedule_crc)
    index = len(_schedule) - 1
    check = _prechecked.get(group) if group is not None else None
    if check is not None:
        following = [known for known in _candidates if index < len(known) and known[index] == entry]
        if len(following) != len(_candidates) or not following:  # the known schedules branch here, or none is left
            _compare(check, (_BEFORE, index, zlib.crc32(data)), list(_schedule), index, f"the check before the {entry}")
        _candidates = following
    return index


def new_iteration() -> None:
    global _schedule_crc, _candidates
    _schedule.clear()
    _schedule_crc = 0
    _candidates = list(_known)


@dataclass(frozen=True)
class CheckGroup:
    """The ranks of a shard group and a gloo backend of their own for the divergence check."""

    group: dist.ProcessGroup  # the shard group it mirrors (for diagnostics)
    ranks: tuple[int, ...]
    backend: Any  # ProcessGroupGloo


def check_group(group: dist.ProcessGroup | None) -> CheckGroup | None:
    """A gloo backend over the ranks of ``group`` for the divergence check alone (one per rank set).

    gloo also under NCCL: the check compares what the host issued, so it needs no device work and no
    device sync, and it completes even when mismatched NCCL collectives hang on the device. Built on the
    default store under a key of its own per restart (torchrun keeps its store across restarts, where
    ``dist.new_group`` finds the previous attempt's addresses). Collective over the ranks of ``group``
    (at lazy init, which every rank runs at its first forward).
    """
    store = _store()
    if store is None or group is None or dist.get_backend(group) == "fake" or dist.get_world_size(group) == 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _check_groups:
        prefix = f"{_PREFIX}check-group/{zlib.crc32(str(ranks).encode()):08x}/"
        backend = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), ranks.index(dist.get_rank()), len(ranks),
                                        datetime.timedelta(seconds=_timeout_s))
        _check_groups[ranks] = CheckGroup(group, ranks, backend)
    return _check_groups[ranks]


def _all_gather(check: CheckGroup, values: torch.Tensor, what: str, index: int) -> torch.Tensor:
    out = torch.empty(len(check.ranks) * values.numel(), dtype=values.dtype)
    wait(check.backend._allgather_base(out, values), what, check.group, index)
    return out.view(len(check.ranks), -1)


def check_groups(groups: list[dist.ProcessGroup | None]) -> CheckGroup | None:
    """Build the check backends of ``groups`` (collective over each group's ranks: lazy init, which every rank
    runs at its first forward); collectives on the gloo ones may be compared before they go out ([Note:
    Divergence check]). Returns the first group's, where the end of backward compares the schedules."""
    unique = {id(g): g for g in groups if g is not None and dist.get_backend(g) != "fake"}
    # One creation order on every rank (sorted rank sets), so creations that wait on each other never cycle.
    for g in sorted(unique.values(), key=lambda g: tuple(dist.get_process_group_ranks(g))):
        check = check_group(g)
        if check is not None and dist.get_backend(g) == "gloo":
            _prechecked[g] = check
    return check_group(groups[0]) if groups else None


def check_schedule(check: CheckGroup) -> None:
    """Collective over the check group's ranks: raise ``DivergenceError`` on every rank if this
    iteration's collectives differ between ranks."""
    global _checks
    entries, crc = list(_schedule), _schedule_crc
    new_iteration()
    number, _checks = _checks, _checks + 1
    store = _store()
    if store is not None:
        store.set(f"{_AT_CHECK}{number}/{dist.get_rank()}", f"{len(entries)} {crc}")
    _compare(check, (_END, len(entries), crc), entries, -1, "the divergence check")
    verified = tuple(entries)
    if verified in _known:
        _known.remove(verified)
    _known.append(verified)
    del _known[:-KNOWN_SCHEDULES]


def _compare(check: CheckGroup, row: tuple[int, int, int], entries: list[str], index: int, what: str) -> None:
    """All-gather ``row`` (what this rank is about to do) over the check group; when the ranks' rows differ,
    exchange the schedules (padded to the longest) so every rank raises the same ``DivergenceError``."""
    values = _all_gather(check, torch.tensor(row, dtype=torch.int64), what, index).tolist()
    if all(v == values[0] for v in values):
        return
    _known.clear()
    new_iteration()
    data = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
    sizes = _all_gather(check, torch.tensor([data.numel()]), what, -1).view(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = _all_gather(check, padded, what, -1)
    schedules = [json.loads(bytes(row[:n].tolist()).decode()) for row, n in zip(rows, sizes)]
    raise diverged(_difference(list(check.ranks), schedules, before=any(v[0] == _BEFORE for v in values)), index)


def _difference(ranks: list[int], schedules: list[list[str]], before: bool) -> str:
    first = next((i for i in range(max(map(len, schedules))) if len({tuple(s[i:i + 1]) for s in schedules}) > 1), 0)
    seen: dict[str, list[int]] = {}
    for rank, schedule in zip(ranks, schedules):
        seen.setdefault(schedule[first] if first < len(schedule) else "nothing", []).append(rank)
    what = "; ".join(f"{entry} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for entry, r in seen.items())
    counts = ", ".join(f"rank {rank}: {len(s)}" for rank, s in zip(ranks, schedules))
    when = ("found before the collective went out: no data was mixed" if before else
            "data of different parameters may have been mixed; raised before the optimizer step")
    return (
        f"fullshard: ranks ran different code in this iteration, so their collectives no longer match ("
        f"{when}): collective #{first + 1} was "
        f"{what}. Collectives this iteration: {counts}. Run the same modules the same number of times on every rank "
        f"(conditional compute must be decided identically on all ranks, e.g. from a broadcast value)."
    )


class _Watch:
    """One long host wait's view of the store ([Note: Divergence check]); ``index`` -1: the check itself."""

    def __init__(self, group: dist.ProcessGroup | None, index: int) -> None:
        self.store = _store()
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.index = index
        self.check = _checks - 1 if index < 0 else _checks
        self.suspects: set[tuple[int, str]] = set()

    def look(self) -> None:
        """Raise the posted verdict, or post one if a peer finished with fewer collectives or waits in another."""
        store = self.store
        if store is None:
            return
        verdict = _posted_verdict(self.index)
        if verdict is not None:
            raise diverged(verdict, self.index)
        if self.index < 0:
            return
        me, mine = dist.get_rank(), _schedule[self.index]
        _publish_wait(store, self.index, mine)
        found: set[tuple[int, str]] = set()
        for rank in self.ranks:
            if rank == me:
                continue
            done_key, waiting_key = f"{_AT_CHECK}{self.check}/{rank}", f"{_WAITING}{self.check}/{rank}"
            if store.check([done_key]) and int(store.get(done_key).decode().split()[0]) <= self.index:
                count = int(store.get(done_key).decode().split()[0])
                self._raise(f"rank {rank} finished its backward after {count} collectives, while rank "
                                         f"{me} waits in #{self.index + 1}, {mine}")
            if store.check([waiting_key]):
                text, entry = store.get(waiting_key).decode().split(" ", 1)
                index = int(text)
                # A peer legitimately waits in an earlier collective of the same list (a third rank is slow);
                # one past this rank's list is for that peer to judge.
                if index < len(_schedule) and _schedule[index] != entry:
                    found.add((rank, f"#{index + 1}, {entry}" + ("" if index == self.index else
                                                                   f" (rank {me} issued {_schedule[index]} there)")))
        # A peer's wait may have just ended (its key not yet removed): believe what two looks agree on.
        agreed = found & self.suspects
        self.suspects = found
        if agreed:
            rank, theirs = min(agreed)
            self._raise(f"rank {me} waits in collective #{self.index + 1}, {mine}, while rank {rank} "
                                     f"waits in {theirs}")

    def _raise(self, what: str) -> None:
        message = (
            f"fullshard: ranks ran different code in this iteration, so their collectives no longer match: {what}. "
            f"Run the same modules the same number of times on every rank (conditional compute must be decided "
            f"identically on all ranks, e.g. from a broadcast value)."
        )
        raise diverged(message, self.index)


def _verdict_key(index: int) -> str:
    """The verdict of this iteration's check (``index`` -1: the check in progress, already counted)."""
    return f"{_VERDICT}{_checks - 1 if index < 0 else _checks}"


def diverged(message: str, index: int) -> DivergenceError:
    """The error to raise; posted in the store, where the waits of ranks that did not take part in the
    comparison (other groups of an HSDP mesh, peers of a rank that left) find it and raise it too. When two
    ranks find a difference at once, the first posted wins: every rank raises the same message."""
    store = _store()
    if store is not None:
        try:
            message = store.compare_set(_verdict_key(index), "", message).decode()
            # Wait (bounded) until every rank has it too: the store may live in this process (rank 0 of a
            # local launch), and ranks that are still computing read it at their next wait.
            seen = f"{_PREFIX}seen/{zlib.crc32(message.encode()):08x}/"
            store.set(f"{seen}{dist.get_rank()}", "1")
            everyone = [f"{seen}{rank}" for rank in range(dist.get_world_size())]
            deadline = time.monotonic() + 2.5 * POLL_S
            while not store.check(everyone) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # the store is gone: the job is ending
            pass
    _raised.add(message)
    return DivergenceError(message)


def _posted_verdict(index: int) -> str | None:
    store = _store()
    try:
        key = _verdict_key(index)
        message = store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:  # the store is gone
        return None
    return None if message in _raised else message


def _publish_wait(store: Any, index: int, collective: str) -> None:
    global _wait_published
    _wait_published = True
    store.set(f"{_WAITING}{_checks}/{dist.get_rank()}", f"{index} {collective}")


def _unpublish_wait() -> None:
    global _wait_published
    store = _store() if _wait_published else None
    _wait_published = False
    if store is None:
        return
    try:
        store.delete_key(f"{_WAITING}{_checks}/{dist.get_rank()}")
    except Exception:  # the store is gone: the job is ending
        pass


def _store() -> Any:
    if not dist.is_initialized() or dist.get_backend() in ("fake", "threaded"):  # test backends: no store to use
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
        published = None
        while True:
            count += 1
            try:
                store.set(key, f"{count} {_issued}")
                # A wait that ignores its timeout (gloo's reduce-scatter) cannot look itself: say where it is.
                waiting = _waiting
                if waiting is not None and waiting != published and time.monotonic() - waiting[2] > POLL_S:
                    _publish_wait(store, waiting[0], waiting[1])
                    published = waiting
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


def wait(work: dist.Work, what: str, group: dist.ProcessGroup | None, index: int) -> None:
    """``work.wait()`` bounded by the collective timeout; failures become ``RankFailureError`` naming the rank,
    and collectives that do not match across ranks ``DivergenceError`` (see the Notes). ``index``: the
    collective's place in this iteration's schedule (-1: the divergence check)."""
    global _waiting
    if dist.get_backend(group) != "gloo":  # other host-blocking backends (test ones) may not take a timeout
        work.wait()
        return
    deadline = time.monotonic() + _timeout_s
    watch: _Watch | None = None
    if index >= 0 and index < len(_schedule):
        _waiting = (index, _schedule[index], time.monotonic())
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, min(POLL_S, left))))
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower() or left <= POLL_S:
                    raise
            watch = watch or _Watch(group, index)
            watch.look()
    except RuntimeError as err:
        if isinstance(err, DivergenceError):
            raise
        verdict = _posted_verdict(index)  # posted before the peer's error, so before its connections closed
        if verdict is not None:  # a peer found the divergence, raised it and left
            raise diverged(verdict, index) from err
        timed_out = "timed out" in str(err).lower()
        dead, behind, sentence = diagnose(group)
        cause = f"did not complete within {_timeout_s:g} s" if timed_out else "failed"
        raise RankFailureError(f"fullshard: {what} on rank {dist.get_rank()} {cause}: {sentence}",
                               tuple(dead or behind)) from err
    finally:
        _waiting = None
        _unpublish_wait()
