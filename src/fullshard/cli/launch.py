"""Run a function on every rank: under torchrun from its environment, else on local gloo ranks over loopback.

A rank that raises ``UserError`` (bad input) reports one line; the launcher
prints the first such line and the command exits with status 2, without a
traceback. Any other exception keeps its traceback.

A rank that dies or fails brings the local group down: the others get
``GRACE_S`` seconds to exit on their own (they usually fail at once, in a
collective with it), then they are terminated, and ``RankFailed`` names the
first rank that failed and how.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fullshard import failures

GRACE_S = 10.0


class UserError(Exception):
    """Bad input: reported as one line, exit status 2."""


class RankFailed(RuntimeError):
    """A local rank died or raised; the message is one line naming it (its traceback went to stderr)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(worker: Callable[..., None], nproc: int, *args: Any, device_type: str = "cpu") -> None:
    """``worker(rank, world_size, *args)`` with the default process group initialised on every rank."""
    if under_launcher():
        _init_from_env(device_type)
        try:
            worker(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            _teardown()
        return
    ctx = mp.get_context("spawn")
    # Local ranks talk over loopback only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_local_rank, args=(rank, nproc, store.port, device_type, worker, args, errors))
        for rank in range(nproc)
    ]
    for proc in procs:
        proc.start()
    first_failed = _supervise(procs)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    user = sorted(text for kind, rank, text in messages if kind == "user")
    if user:
        raise UserError(user[0])
    if first_failed is not None:
        reports = {rank: text for kind, rank, text in messages}
        raise RankFailed(_describe(first_failed, procs[first_failed].exitcode, reports.get(first_failed)), first_failed)


def _supervise(procs: list[Any]) -> int | None:
    """Wait for every rank; after the first failure give the rest ``GRACE_S`` s, then stop them. The first failed rank."""
    first_failed: int | None = None
    deadline = None
    live = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while live:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp.connection.wait(list(live), timeout=timeout)
        if not ready:  # grace period over
            for rank in live.values():
                procs[rank].terminate()
            for rank in live.values():
                procs[rank].join(5)
                if procs[rank].exitcode is None:
                    procs[rank].kill()
                    procs[rank].join()
            break
        exited = [live.pop(sentinel) for sentinel in ready]
        for rank in exited:
            procs[rank].join()
        # Of ranks found dead together, one killed by a signal is the likelier cause.
        for rank in sorted(exited, key=lambda r: (procs[r].exitcode or 0) >= 0):
            if procs[rank].exitcode and first_failed is None:
                first_failed = rank
                deadline = time.monotonic() + GRACE_S
    return first_failed


def _describe(rank: int, code: int | None, report: str | None) -> str:
    if report is not None:
        last = report.strip().splitlines()[-1]
        return f"rank {rank} failed: {last} (its traceback is above)"
    if code is not None and code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with status {code}"


def _init_from_env(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device_type == "cuda" else "gloo"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    # A restarted torchrun worker shares the agent's store with the attempts before it, whose process-group keys
    # (peer addresses) are still there: a new group can read a dead peer's address and hang connecting to it.
    # Every attempt gets keys of its own.
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store = dist.PrefixStore(f"fullshard/attempt/{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _teardown() -> None:
    if dist.is_initialized():
        dist.barrier()  # tear gloo down on every rank together; a rank leaving early can abort another
        dist.destroy_process_group()


def _local_rank(
    rank: int, world_size: int, port: int, device_type: str, worker: Callable[..., None], args: tuple[Any, ...], errors: Any
) -> None:
    """One local rank: gloo on CPU, or NCCL with GPU ``rank`` when ``device_type`` is cuda."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank, world_size=world_size)
    code = 0
    try:
        worker(rank, world_size, *args)
        _teardown()
    except UserError as err:
        errors.put(("user", rank, str(err)))
    except BaseException:
        text = traceback.format_exc()
        print(f"[rank {rank}] {text}", file=sys.stderr, end="")
        errors.put(("crash", rank, text))
        code = 1
    # Leave without interpreter finalisation: destroying the process group's and the
    # store's C++ threads during shutdown can abort ("terminate called without an
    # active exception") after the work is done. Everything this rank reports is
    # already written.
    sys.stdout.flush()
    sys.stderr.flush()
    failures._at_exit()  # (what the interpreter's exit would do: peers still waiting read that this rank exited)
    os._exit(code)
