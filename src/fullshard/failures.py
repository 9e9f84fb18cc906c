"""Failing loudly and fast: collective timeouts, naming the rank that died or fell behind, divergence.

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
- Each process publishes a heartbeat in the process group's store from one
  daemon thread every ``HEARTBEAT_S`` seconds: a counter and how many fullshard
  collectives it has issued, one key per rank, overwritten. The thread stops
  when the default process group is destroyed and at interpreter exit.
- When the process group is destroyed and at interpreter exit (a script that
  returned, or ended on an uncaught exception) the heartbeat's last value says
  so, with the collectives issued.
- When a collective fails or times out, the rank compares the heartbeats over
  a few intervals: a rank whose process *exited* left that mark (typically the
  ranks ran different numbers of steps: data of different lengths); a rank
  whose heartbeat stopped without it is *dead* (killed, crashed); a live rank
  that issued fewer collectives is *behind* (stuck, or running other code). The
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

Each root owns one ``Monitor``. It keeps a *track* per rank set that
fullshard communicates over (a shard group, a replicate group, a post-forward
group): the collectives issued on it (kind, group, element count) since the
track's last *end check*, and a CRC-32 of that list. Tracks are separate
because their ranks differ: on an HSDP mesh one replica may run an
evaluation pass (all-gathers inside its shard group) that the other does not,
which is correct and must not be compared across replicas. Every comparison
runs on a gloo backend of the track's own, built at lazy init (also in NCCL
jobs: it needs no device work and completes when mismatched NCCL collectives
hang on the device); a rank set that appears later (a module on another mesh
taken over after training started) gets its track at its first collective,
which every rank of the set is about to issue.

- *End checks*: at the end of each backward that reduced, or that ran with
  gradient sync on for every group (a backward without sync that reduced
  nothing joins the next segment: ranks may run different numbers of those
  where they issue no collectives), every track that issued
  collectives since its last check compares (end, count, CRC) over its ranks
  in one 24-byte-per-rank all-gather; a forward with no backward (evaluation,
  inference) is checked the same way at the next root forward. So an
  iteration costs one host round trip per track (one for FSDP, two for HSDP),
  found before the optimizer step can use mixed gradients. A list found
  identical is *known* (the last ``KNOWN_SCHEDULES`` distinct ones per track,
  the same on every rank of it).
- *Checks before a collective* (gloo tracks only): a rank compares a
  collective with its peers before issuing it, in the same 24-byte row
  (before, index, CRC of the entry), unless every known list it has followed
  so far since the track's last check has this collective next. So the first
  iteration compares every collective, and later ones only where known lists
  branch (with and without gradient sync: at the first reduce-scatter) or
  where a rank departs from all of them. A rank that departs never issues the
  differing collective, so nothing is mixed and gloo never sees a size
  mismatch. When every rank departs alike, the checks pair and pass. When one
  rank departs alone, it waits in its check while its peers wait in the real
  collective: the store comparison below names both. Checks and end checks
  have one row size, so a check that pairs with a peer's end check shows the
  difference too.

On a difference the ranks exchange their lists and every rank raises the same
``DivergenceError`` naming the first collective that differs. The message is
posted under one store key per monitor (the first posted wins, so two ranks
that find it at once still agree): ranks outside the comparing track (the
other shard groups of an HSDP mesh) find it in their next long wait and raise
it too, and the rank that posted waits up to a few seconds for every rank to
have read it (the store may live in its process).

A rank waiting on the host longer than ``POLL_S`` looks in the store between
slices of the wait. Before each end check a rank posts, under one key per rank
and track, the check's number and its collective count; a long wait posts
which collective it waits in (emptied when the wait ends; a look reads every
peer's keys in one store operation). When a peer finished the same segment
with fewer collectives, or waits in another collective at the same place, the rank posts the verdict and raises; the peer
reads it in its own wait. A rank waiting in an end check raises the same way
when a peer waits in a collective past the end of its segment (it abandoned a
backward by catching its exception, say): that peer may be blocked in gloo's
reduce-scatter, which cannot look, and the heartbeat posts its wait for it.
The store therefore holds a fixed number of keys per rank for the whole job:
the heartbeat, and per track the last end check and the wait in progress.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import os
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.distributed as dist

HEARTBEAT_S = 1.0
POLL_S = 1.0  # host waits longer than this look for failures between slices
KNOWN_SCHEDULES = 16
_BEFORE, _END = 0, 1  # what a row compares: the next collective, or the whole segment
_timeout_s = 300.0  # a process-wide setting, like init_process_group's timeout
# The roots over one set of ranks (their meshes' ranks) are initialised in one order on each of those ranks, so
# numbering them per set makes their store keys agree, also where some ranks build more roots (a model over half
# of the ranks beside one over all of them).
_monitor_numbers: dict[tuple[int, ...], itertools.count[int]] = {}
# Likewise the tracks over one rank set (a module taken over later may add a track over ranks beyond the scope).
_track_numbers: dict[tuple[int, ...], itertools.count[int]] = {}


def group_name(label: str) -> str:
    """How messages name a group: its module's qualified name (the root's is empty)."""
    return f"group {label!r}" if label else "the root's group"


class DivergenceError(RuntimeError):
    """Ranks issued different fullshard collectives in one iteration (different code ran on them)."""


class RankFailureError(RuntimeError):
    """A peer rank died, or stopped taking part in fullshard's collectives; ``ranks`` names it (when known)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


def set_collective_timeout(seconds: float) -> None:
    """How long a rank waits for a fullshard collective on the host (gloo) before raising ``RankFailureError``;
    may change at any time (waits and divergence checks from then on take it)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"set_collective_timeout: seconds must be a number, got {type(seconds).__name__}")
    if not seconds > 0:
        raise ValueError(f"set_collective_timeout: seconds must be positive, got {seconds}")
    global _timeout_s
    _timeout_s = float(seconds)
    for monitor in list(_heartbeat._monitors):  # check backends built under the old timeout take the new one
        monitor.set_timeout(_timeout_s)


def collective_timeout() -> float:
    return _timeout_s


def _prefix() -> str:
    # Per torchrun attempt: torchrun keeps its store across restarts.
    return f"fullshard/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _store() -> Any:
    if not dist.is_initialized() or dist.get_backend() in ("fake", "threaded"):  # test backends: no store to use
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


@dataclass(eq=False)
class Track:
    """The collectives issued over one rank set since its last end check ([Note: Divergence check])."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup  # a fullshard group over these ranks (for the wait's backend and diagnostics)
    backend: Any  # the gloo backend the comparisons run on
    precheck: bool  # the group is gloo: compare before a collective goes out
    key: str  # store prefix of this track's keys
    entries: list[str] = field(default_factory=list)
    crc: int = 0
    reduced: bool = False  # the segment holds a reduce-scatter or an all-reduce
    checks: int = 0  # end checks done; numbers the current segment
    known: list[tuple[str, ...]] = field(default_factory=list)  # verified lists, newest last
    candidates: list[tuple[str, ...]] = field(default_factory=list)  # known lists this segment has followed

    def restart(self) -> None:
        self.entries = []
        self.crc = 0
        self.reduced = False
        self.candidates = list(self.known)


@dataclass(frozen=True)
class Ticket:
    """What a host wait is for, so a long one can say it in the store and look at the peers'."""

    monitor: Monitor
    track: Track
    kind: Literal["collective", "before", "end"]  # a collective, the check before it, an end check
    index: int  # the collective's place in the segment; for an end check, the segment's length


class Monitor:
    """One root's divergence checks and host-wait watch ([Note: Divergence check]); no-op without a store."""

    def __init__(self, groups: list[dist.ProcessGroup | None], scope: tuple[int, ...]) -> None:
        """``scope``: every rank of the root's meshes (the same on each of them)."""
        self.store = _store()
        unique = {id(g): g for g in groups if g is not None and dist.get_backend(g) != "fake"}
        self.scope = scope
        self.number = next(_monitor_numbers.setdefault(scope, itertools.count()))
        self.key = f"{_prefix()}m{zlib.crc32(str(scope).encode()):08x}-{self.number}/"
        self.tracks: dict[dist.ProcessGroup, Track | None] = {}
        self.forward_open = False  # a root forward ran since the last end of backward
        self.submodule_open = False  # so did a submodule's forward on its own, without backward
        self.waiting: tuple[Ticket, float] | None = None  # the host wait in progress, since when
        self.published: set[Track] = set()  # tracks with a wait posted in the store (removed when it ends)
        self.raised: set[str] = set()  # verdicts this monitor raised (a posted one is news only once)
        if self.store is None:
            return
        by_ranks: dict[tuple[int, ...], Track] = {}
        # One creation order on every rank (sorted rank sets), so creations that wait on each other never cycle.
        for g in sorted(unique.values(), key=lambda g: tuple(dist.get_process_group_ranks(g))):
            ranks = tuple(dist.get_process_group_ranks(g))
            if len(ranks) == 1:
                continue
            # Two groups over one rank set share a track (their collectives interleave alike on every rank),
            # which compares before a collective when any of them is gloo.
            if ranks not in by_ranks:
                by_ranks[ranks] = self._new_track(ranks, g)
            by_ranks[ranks].precheck |= dist.get_backend(g) == "gloo"
        for g in unique.values():
            ranks = tuple(dist.get_process_group_ranks(g))
            if ranks in by_ranks:
                self.tracks[g] = by_ranks[ranks]
        _heartbeat.watch(self)

    def _new_track(self, ranks: tuple[int, ...], group: dist.ProcessGroup) -> Track:
        """A track over ``ranks``, with a gloo backend of its own (every rank of the set builds it at once)."""
        key = f"{_prefix()}t{zlib.crc32(str(ranks).encode()):08x}-{next(_track_numbers.setdefault(ranks, itertools.count()))}/"
        # This rank's end-check and wait keys exist from the start (a wait that ends empties its key), so a look
        # reads every peer's in one store operation; the backend's rendezvous below waits for every peer's too.
        self.store.set(f"{key}done/{dist.get_rank()}", "-1 -1")
        self.store.set(f"{key}wait/{dist.get_rank()}", "")
        try:
            backend = dist.ProcessGroupGloo(dist.PrefixStore(key + "pg/", self.store), ranks.index(dist.get_rank()),
                                            len(ranks), datetime.timedelta(seconds=_timeout_s))
        except dist.DistError as err:  # DistStoreError: a peer did not come within the timeout
            try:
                late = [r for r in ranks if not self.store.check([f"{key}done/{r}"])]
            except Exception:  # noqa: BLE001 - the store is gone too: say what is known
                late = []
            who = f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}" if late else "a peer"
            raise RankFailureError(
                f"fullshard: the first forward on rank {dist.get_rank()} waited {_timeout_s:g} s for the ranks "
                f"{list(ranks)} to start theirs: {who} did not (stuck or slower before it, running other code, or "
                "dead); fullshard.set_collective_timeout(seconds) sets how long to wait",
                tuple(late),
            ) from err
        return Track(ranks, group, backend, dist.get_backend(group) == "gloo", key)

    def set_timeout(self, seconds: float) -> None:
        """The check backends' own timeout, for the operations they issue from now on."""
        for track in {t for t in self.tracks.values() if t is not None}:
            track.backend.set_timeout(datetime.timedelta(seconds=seconds))

    def close(self) -> None:
        """Drop the check backends (this root was replaced by an enclosing one, or the process group is going)."""
        for track in {t for t in self.tracks.values() if t is not None}:
            try:
                track.backend.shutdown()
            except RuntimeError:
                pass
        self.tracks = {}

    # ---- recording -------------------------------------------------------------------------------------

    def issued(self, kind: str, label: str, numel: int, group: dist.ProcessGroup | None) -> Ticket | None:
        """Add one collective to its track; on gloo compare it with the peers first where the known lists do
        not say it comes next. Call before issuing it on ``group``."""
        _heartbeat.issued += 1
        if group is None or self.store is None:
            return None
        if group not in self.tracks:  # a group made after lazy init (a separate reduce-scatter group, a module
            # on another mesh taken over after training started)
            ranks = tuple(dist.get_process_group_ranks(group))
            track = next((t for t in self.tracks.values() if t is not None and t.ranks == ranks), None)
            if track is None and len(ranks) > 1 and dist.get_backend(group) != "fake":
                # Its first collective: every rank of the set is here before issuing it, so it can build the track
                try:
                    track = self._new_track(ranks, group)
                except RuntimeError as err:  # a peer never came: it died, or runs other code
                    dead, behind, sentence = diagnose(group)
                    raise RankFailureError(f"fullshard: the check of the first {kind} of {group_name(label)} on rank "
                                           f"{dist.get_rank()} found no peers within {_timeout_s:g} s: {sentence}",
                                           tuple(dead or behind)) from err
            self.tracks[group] = track
        track = self.tracks[group]
        if track is None:
            return None
        entry = f"{kind} of {group_name(label)} ({numel} elements)"
        data = entry.encode()
        track.entries.append(entry)
        track.crc = zlib.crc32(data, track.crc)
        track.reduced |= kind in ("reduce-scatter", "all-reduce")
        index = len(track.entries) - 1
        if track.precheck:
            following = [known for known in track.candidates if index < len(known) and known[index] == entry]
            if len(following) != len(track.candidates) or not following:  # known lists branch, or none is left
                self._compare(Ticket(self, track, "before", index), (_BEFORE, index, zlib.crc32(data)),
                              f"the check before the {entry}")
            track.candidates = following
        return Ticket(self, track, "collective", index)

    def root_forward(self) -> None:
        """The root's pre-forward: a forward since the last end check ran without backward, so end its segments."""
        if self.forward_open or self.submodule_open:
            self._end_segments()
        self.forward_open, self.submodule_open = True, False

    def submodule_forward(self, needs_backward: bool | None = None) -> None:
        """A sharded submodule's forward run on its own (not inside the root's forward or a backward), at its
        pre-forward (``needs_backward`` None) and post-forward: one that no backward follows (inference) ends at
        the next forward, as the root's do, so a loop of them keeps one forward's list."""
        if needs_backward is None:
            if self.submodule_open:  # (not a root forward's: a head run on the root's output joins its backward)
                self._end_segments()
            self.submodule_open = False
        elif not needs_backward:
            self.submodule_open = True

    def end_backward(self, synced: bool = True) -> None:
        """The end of a backward; ``synced``: no group of the root had gradient sync switched off. A backward
        without sync that reduced nothing (ranks may run different numbers of those: micro-batches whose unsharded
        parameters stay issue no collectives at all) does not end the segments: they go on to the next backward.
        (Decided from the settings and the lists, which agree on every rank that runs the same code.)"""
        if synced or any(t is not None and t.reduced for t in self.tracks.values()):
            self._end_segments()
            self.submodule_open = False
        self.forward_open = False

    def _end_segments(self) -> None:
        for track in dict.fromkeys(self.tracks.values()):
            if track is not None and track.entries:
                self._end_check(track)

    def _end_check(self, track: Track) -> None:
        """Collective over the track's ranks: raise ``DivergenceError`` on every one of them if their lists
        differ; otherwise the list is known and a new segment starts."""
        entries, crc = track.entries, track.crc
        self._compare(Ticket(self, track, "end", len(entries)), (_END, len(entries), crc), "the divergence check")
        verified = tuple(entries)
        if verified in track.known:
            track.known.remove(verified)
        track.known.append(verified)
        del track.known[:-KNOWN_SCHEDULES]
        track.checks += 1
        track.restart()

    # ---- comparing -------------------------------------------------------------------------------------

    def _all_gather(self, ticket: Ticket, values: torch.Tensor, what: str) -> torch.Tensor:
        track = ticket.track
        out = torch.empty(len(track.ranks) * values.numel(), dtype=values.dtype)
        wait(track.backend._allgather_base(out, values), what, track.group, ticket, gloo=True)
        return out.view(len(track.ranks), -1)

    def _compare(self, ticket: Ticket, row: tuple[int, int, int], what: str) -> None:
        """All-gather ``row`` (what this rank is about to do) over the track; when the ranks' rows differ,
        exchange the lists (padded to the longest) so every rank raises the same ``DivergenceError``."""
        track = ticket.track
        values = self._all_gather(ticket, torch.tensor(row, dtype=torch.int64), what).tolist()
        if all(v == values[0] for v in values):
            return
        entries = list(track.entries)
        track.known.clear()
        track.restart()
        data = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        exchange = Ticket(self, track, "end", -1)  # the peers compare with nothing while the lists go round
        sizes = self._all_gather(exchange, torch.tensor([data.numel()]), what).view(-1).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        rows = self._all_gather(exchange, padded, what)
        lists = [json.loads(bytes(r[:n].tolist()).decode()) for r, n in zip(rows, sizes)]
        raise self.diverged(_difference(list(track.ranks), lists, before=any(v[0] == _BEFORE for v in values)))

    # ---- verdicts --------------------------------------------------------------------------------------

    def diverged(self, message: str) -> DivergenceError:
        """The error to raise; posted in the store, where the waits of ranks that did not take part in the
        comparison (other groups of an HSDP mesh, peers of a rank that left) find it and raise it too. When
        two ranks find a difference at once, the first posted wins: every rank raises the same message."""
        store = self.store
        if store is not None:
            try:
                key = f"{self.key}verdict"
                posted = store.compare_set(key, "", message).decode()
                if posted in self.raised:  # an earlier divergence's, which every rank raised or moved past
                    posted = store.compare_set(key, posted, message).decode()
                message = posted
                # Wait (bounded) until every rank has it too: the store may live in this process (rank 0 of a
                # local launch), and ranks that are still computing read it at their next wait.
                seen, crc = f"{self.key}seen/", f"{zlib.crc32(message.encode())}"
                store.set(f"{seen}{dist.get_rank()}", crc)
                everyone = [f"{seen}{rank}" for rank in self.scope]
                deadline = time.monotonic() + 2.5 * POLL_S
                while time.monotonic() < deadline:
                    if store.check(everyone) and all(v.decode() == crc for v in store.multi_get(everyone)):
                        store.compare_set(key, message, "")  # every rank has it: the next divergence posts anew
                        break
                    time.sleep(0.05)
            except Exception:  # the store is gone: the job is ending
                pass
        self.raised.add(message)
        for track in dict.fromkeys(self.tracks.values()):  # a caller that catches it starts comparing afresh
            if track is not None:
                track.known.clear()
                track.restart()
        return DivergenceError(message)

    def posted_verdict(self) -> str | None:
        try:
            key = f"{self.key}verdict"
            message = self.store.get(key).decode() if self.store is not None and self.store.check([key]) else None
        except Exception:  # the store is gone
            return None
        return None if not message or message in self.raised else message

    def publish_wait(self, ticket: Ticket) -> None:
        """Say in the store where this rank waits: in collective #index (or the check before it), or in the
        end check of a segment of ``index`` collectives."""
        track, rank = ticket.track, dist.get_rank()
        if ticket.kind == "end":
            if ticket.index >= 0:
                self.store.set(f"{track.key}done/{rank}", f"{track.checks} {ticket.index}")
            return
        self.published.add(track)
        self.store.set(f"{track.key}wait/{rank}", f"{track.checks} {ticket.index} {track.entries[ticket.index]}")

    def unpublish_wait(self, track: Track) -> None:
        if track not in self.published:
            return
        self.published.discard(track)
        try:
            self.store.set(f"{track.key}wait/{dist.get_rank()}", "")
        except Exception:  # the store is gone: the job is ending
            pass

    def look(self, ticket: Ticket, suspects: set[tuple[int, str]]) -> set[tuple[int, str]]:
        """One look at the store during a long wait: raise the posted verdict, or post one when a peer finished
        this segment with fewer collectives or waits in another collective at the same place. Returns the
        differences seen, for the next look to confirm."""
        verdict = self.posted_verdict()
        if verdict is not None:
            raise self.diverged(verdict)
        if self.store is None:
            return set()
        self.publish_wait(ticket)
        track, index, store, me = ticket.track, ticket.index, self.store, dist.get_rank()
        if ticket.kind == "end":
            if index >= 0:  # this rank ended its segment: a peer waiting in a later collective of it diverged
                self._peer_past_end(track, index)
            return set()
        mine = track.entries[index]
        found: set[tuple[int, str]] = set()
        peers = [rank for rank in track.ranks if rank != me]
        keys = [f"{track.key}{what}/{rank}" for what in ("done", "wait") for rank in peers]
        if not store.check(keys):  # a peer has not built this track yet (TORCH_GLOO_LAZY_INIT: no rendezvous)
            return set()
        values = [v.decode() for v in store.multi_get(keys)]
        for rank, done, waiting in zip(peers, values[:len(peers)], values[len(peers):]):
            checks, count = map(int, done.split())
            if checks == track.checks and count <= index:
                self._raise(f"rank {rank} finished its iteration after {count} collectives, while rank {me} "
                            f"waits in #{index + 1}, {mine}")
            if waiting:
                checks_text, index_text, entry = waiting.split(" ", 2)
                theirs = int(index_text)
                # A peer legitimately waits in an earlier collective of the same list (a third rank is slow);
                # one past this rank's list is for that peer to judge.
                if int(checks_text) == track.checks and theirs < len(track.entries) and track.entries[theirs] != entry:
                    found.add((rank, f"#{theirs + 1}, {entry}" + ("" if theirs == index else
                                                                  f" (rank {me} issued {track.entries[theirs]} there)")))
        # A peer's wait may have just ended (its key not yet removed): believe what two looks agree on.
        agreed = found & suspects
        if agreed:
            peer, where = min(agreed)
            self._raise(f"rank {me} waits in collective #{index + 1}, {mine}, while rank {peer} waits in {where}")
        return found

    def _peer_past_end(self, track: Track, count: int) -> None:
        """Raise when a peer waits in collective ``count`` or later of the segment this rank ended with ``count``
        (e.g. this rank abandoned a backward by catching its exception; the peer, blocked in a reduce-scatter,
        cannot look itself: its wait was posted for it)."""
        me = dist.get_rank()
        peers = [rank for rank in track.ranks if rank != me]
        keys = [f"{track.key}wait/{rank}" for rank in peers]
        for rank, waiting in zip(peers, self.store.multi_get(keys) if self.store.check(keys) else []):
            if not waiting:
                continue
            checks_text, index_text, entry = waiting.decode().split(" ", 2)
            if int(checks_text) == track.checks and int(index_text) >= count:
                self._raise(f"rank {me} finished its iteration after {count} collectives, while rank {rank} waits "
                            f"in #{int(index_text) + 1}, {entry}")

    def _raise(self, what: str) -> None:
        raise self.diverged(
            f"fullshard: ranks ran different code in this iteration, so their collectives no longer match: {what}. "
            f"Run the same modules the same number of times on every rank (conditional compute must be decided "
            f"identically on all ranks, e.g. from a broadcast value)."
        )


def _difference(ranks: list[int], lists: list[list[str]], before: bool) -> str:
    first = next((i for i in range(max(map(len, lists))) if len({tuple(s[i:i + 1]) for s in lists}) > 1), 0)
    seen: dict[str, list[int]] = {}
    for rank, entries in zip(ranks, lists):
        seen.setdefault(entries[first] if first < len(entries) else "nothing", []).append(rank)
    what = "; ".join(f"{entry} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for entry, r in seen.items())
    counts = ", ".join(f"rank {rank}: {len(s)}" for rank, s in zip(ranks, lists))
    when = ("found before the collective went out: no data was mixed" if before else
            "data of different parameters may have been mixed; raised before the optimizer step")
    return (
        f"fullshard: ranks ran different code in this iteration, so their collectives no longer match ("
        f"{when}): collective #{first + 1} was "
        f"{what}. Collectives this iteration: {counts}. Run the same modules the same number of times on every rank "
        f"(conditional compute must be decided identically on all ranks, e.g. from a broadcast value)."
    )


class Beat(NamedTuple):
    """A rank's heartbeat as read from the store."""

    beats: int  # beats so far (-1 once it exited)
    issued: int  # fullshard collectives it issued
    exited: bool  # its process exited (its last beat said so)


class Heartbeat:
    """This process's heartbeat in the store: one daemon thread, one key per rank ([Note: Failure detection]).

    Per process, not per root: a rank's liveness is its process's. It also posts the long waits of every
    live monitor, since a wait that ignores its timeout (gloo's reduce-scatter) cannot look itself.
    """

    def __init__(self) -> None:
        self.issued = 0  # fullshard collectives this process has issued
        self._rank = 0
        self._thread: threading.Thread | None = None
        self._store: Any = None  # the store the thread writes to
        self._stop = threading.Event()
        self._monitors: weakref.WeakSet[Monitor] = weakref.WeakSet()

    def watch(self, monitor: Monitor) -> None:
        self._monitors.add(monitor)
        store = monitor.store
        if self.running and self._store is store:
            return
        self._stop.set()  # a thread of an earlier process group ends at its next beat
        self._store, self._rank = store, dist.get_rank()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(store, self._stop, self._rank),
                                         name="fullshard-heartbeat", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _beat(self, store: Any, stop: threading.Event, rank: int) -> None:
        key, count = f"{_prefix()}heartbeat/{rank}", 0
        published: dict[Monitor, tuple[Ticket, float]] = {}
        while not stop.is_set():
            if not dist.is_initialized() or _store() is not store:  # destroy_process_group(): stop with it
                self._mark_exit(store, rank)  # this rank is done with the job
                return
            count += 1
            try:
                store.set(key, f"{count} {self.issued}")
                for monitor in list(self._monitors):
                    waiting = monitor.waiting
                    if waiting is not None and waiting is not published.get(monitor) and \
                            time.monotonic() - waiting[1] > POLL_S:
                        monitor.publish_wait(waiting[0])
                        published[monitor] = waiting
            except Exception:  # the store is gone: the job is ending
                return
            stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        """Stop the thread and wait for it (at interpreter exit: no thread may touch the store while it goes)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_S)
        self._thread = None

    def leave(self) -> None:
        """At interpreter exit: stop, and leave the mark of a process that exited (peers waiting on this rank say
        so instead of "died"), as the thread does when the process group is destroyed. A store set is one message,
        sent without waiting for a reply."""
        self.stop()
        if self._store is not None:
            self._mark_exit(self._store, self._rank)

    def _mark_exit(self, store: Any, rank: int) -> None:
        try:
            store.set(f"{_prefix()}heartbeat/{rank}", f"exit {self.issued}")
        except Exception:  # the store is gone (its host exited first): nobody is left to read it
            pass

    def read(self, store: Any, ranks: list[int]) -> dict[int, Beat | None]:
        beats: dict[int, Beat | None] = {}
        for rank in ranks:
            try:
                key = f"{_prefix()}heartbeat/{rank}"
                if store.check([key]):
                    count, done = store.get(key).decode().split()
                    beats[rank] = Beat(-1, int(done), True) if count == "exit" else Beat(int(count), int(done), False)
                else:
                    beats[rank] = None
            except Exception:
                beats[rank] = None
        return beats


_heartbeat = Heartbeat()  # one per process: see its docstring


def _at_exit() -> None:
    """At interpreter exit; a process that leaves through ``os._exit`` (as ``fullshard train``'s ranks) calls it
    first."""
    _heartbeat.leave()
    for monitor in list(_heartbeat._monitors):
        monitor.close()


atexit.register(_at_exit)


def diagnose(group: dist.ProcessGroup | None) -> tuple[list[int], list[int], str]:
    """(ranks that exited or died, ranks behind this one, a sentence) for the ranks of ``group``; takes about 3 heartbeats."""
    store = _store()
    if store is None or not _heartbeat.running:
        return [], [], "a peer rank failed (no store to tell which)"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    others = [r for r in ranks if r != me]
    first = _heartbeat.read(store, others)
    time.sleep(2.5 * HEARTBEAT_S)
    second = _heartbeat.read(store, others)
    exited = [r for r in others if (beat := second[r]) is not None and beat.exited]
    dead = [r for r in others if r not in exited and (second[r] is None or first[r] is not None and second[r] == first[r])]
    behind = [r for r in others if r not in dead + exited and (beat := second[r]) is not None
              and beat.issued < _heartbeat.issued]
    parts = []
    for r in exited:
        done = cast(Beat, second[r]).issued
        parts.append(
            f"rank {r} exited after issuing {done} fullshard collectives (rank {me}: {_heartbeat.issued}): the ranks "
            f"ran different numbers of steps (e.g. data of different lengths per rank), or rank {r} ended on an "
            f"error (see its output)"
        )
    if dead:
        parts.append(f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} stopped (died or was killed)")
    if behind:
        parts.append(
            f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} issued fewer fullshard collectives "
            f"than rank {me} ({_heartbeat.issued}): stuck, or running other code"
        )
    if not parts:
        parts.append("every peer is alive and issued as many collectives: a collective outside fullshard is waiting")
    return exited + dead, behind, "; ".join(parts)


def wait(work: dist.Work, what: str, group: dist.ProcessGroup | None, ticket: Ticket | None, gloo: bool = False) -> None:
    """``work.wait()`` bounded by the collective timeout; failures become ``RankFailureError`` naming the rank,
    and collectives that do not match across ranks ``DivergenceError`` (see the Notes). ``gloo``: ``work`` is a
    gloo collective whatever ``group``'s backend (the checks' own backends, also in NCCL jobs)."""
    if not gloo and dist.get_backend(group) != "gloo":  # other host-blocking backends (test ones) may take no timeout
        work.wait()
        return
    deadline = time.monotonic() + _timeout_s
    monitor = ticket.monitor if ticket is not None and ticket.monitor.store is not None else None
    if monitor is not None and ticket is not None:
        monitor.waiting = (ticket, time.monotonic())
    suspects: set[tuple[int, str]] = set()
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(0.001, min(POLL_S, left))))
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower() or left <= POLL_S:
                    raise
            if monitor is not None and ticket is not None:
                suspects = monitor.look(ticket, suspects)
    except RuntimeError as err:
        if isinstance(err, DivergenceError):
            raise
        verdict = monitor.posted_verdict() if monitor is not None else None
        if verdict is not None and monitor is not None:  # a peer found the divergence, raised it and left
            raise monitor.diverged(verdict) from err
        timed_out = "timed out" in str(err).lower()
        dead, behind, sentence = diagnose(group)
        cause = f"did not complete within {_timeout_s:g} s" if timed_out else "failed"
        raise RankFailureError(f"fullshard: {what} on rank {dist.get_rank()} {cause}: {sentence}",
                               tuple(dead or behind)) from err
    finally:
        if monitor is not None and ticket is not None:
            monitor.waiting = None
            monitor.unpublish_wait(ticket.track)
