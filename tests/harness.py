"""Run a test body on N gloo ranks, each in its own process.

- Processes are forked from a forkserver that has already imported torch and
  fullshard, so a rank starts in tens of milliseconds.
- Rendezvous goes through a TCPStore that the parent opens on 127.0.0.1 with a
  port the OS picks (port 0): no guessing, no retry. Gloo is bound to the
  loopback interface.
- Every rank's return value comes back to the caller; every failing rank's
  traceback is reported. When a rank fails, the others get a grace period (they
  are usually blocked in a collective with it) and are then stopped.
- Nothing hangs: past the deadline the live ranks dump their Python stacks
  (faulthandler on SIGUSR1) into the failure message and are killed.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
GRACE_AFTER_FAILURE_S = 5.0

_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        # torch._dynamo too: fully_shard wraps its hooks with torch.compiler.disable, which imports it (1-3 s)
        _context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "fullshard"])
    return _context


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's report."""


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...], conn: Any, stack_file: str
) -> None:
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks too
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            result = fn(rank, world_size, *args)
            # Plain pickle copies tensors by value; multiprocessing's pickler would share
            # their storage through file descriptors that die with this process.
            conn.send_bytes(pickle.dumps(("ok", result)))
        except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            conn.close()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results by rank.

    ``fn`` must be importable by name (a module-level function of a test file).
    """
    ctx = _mp_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmpdir = tempfile.mkdtemp(prefix="fullshard-ranks-")
    procs, conns, stack_files = [], [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        stack_file = os.path.join(tmpdir, f"rank{rank}.stacks")
        proc = ctx.Process(target=_rank_main, args=(fn, rank, world_size, store.port, args, send, stack_file), daemon=True)
        proc.start()
        send.close()
        procs.append(proc)
        conns.append(recv)
        stack_files.append(stack_file)

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    open_conns = dict(enumerate(conns))
    try:
        while open_conns:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + GRACE_AFTER_FAILURE_S)
            if now >= deadline:
                break
            ready = multiprocessing.connection.wait(list(open_conns.values()), timeout=min(1.0, deadline - now))
            for conn in ready:
                rank = next(r for r, c in open_conns.items() if c is conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(1.0)
                    status, payload = "error", f"rank {rank} exited without a result (exit code {procs[rank].exitcode})"
                    with open(stack_files[rank]) as f:
                        crash = f.read()
                    if crash:
                        payload += f"; its stacks:\n{crash}"
                del open_conns[rank]
                (results if status == "ok" else errors)[rank] = payload
        hung = sorted(open_conns)
        stacks = _dump_stacks(procs, hung, stack_files)
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store
        shutil.rmtree(tmpdir, ignore_errors=True)

    if errors or hung:
        parts = [f"--- rank {r} raised:\n{errors[r]}" for r in sorted(errors)]
        reason = "stopped after another rank failed" if errors else f"timed out after {timeout:.0f}s"
        parts += [f"--- rank {r} {reason}; its stacks:\n{stacks.get(r, '(none)')}" for r in hung]
        raise RankFailure(f"{fn.__name__} failed at world size {world_size}\n" + "\n".join(parts))
    return [results[r] for r in range(world_size)]


def _dump_stacks(procs: list[Any], ranks: list[int], stack_files: list[str]) -> dict[int, str]:
    for rank in ranks:
        if procs[rank].is_alive() and procs[rank].pid is not None:
            os.kill(procs[rank].pid, signal.SIGUSR1)
    if ranks:
        time.sleep(0.5)
    out = {}
    for rank in ranks:
        try:
            with open(stack_files[rank]) as f:
                out[rank] = f.read() or "(no stacks written)"
        except OSError:
            out[rank] = "(no stacks written)"
    return out
