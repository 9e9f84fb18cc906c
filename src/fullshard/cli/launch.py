"""Run a function on every rank: under torchrun from its environment, else on local gloo ranks over loopback.

A rank that raises ``UserError`` (bad input) reports one line; the launcher
prints the first such line and the command exits with status 2, without a
traceback. Any other exception keeps its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class UserError(Exception):
    """Bad input: reported as one line, exit status 2."""


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
    for proc in procs:
        proc.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if messages:
        kind, text = sorted(messages)[0]
        if kind == "user":
            raise UserError(text)
        raise RuntimeError(f"a rank failed:\n{text}")
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"ranks exited with codes {failed}")


def _init_from_env(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")


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
        errors.put(("user", str(err)))
    except BaseException:
        errors.put(("crash", traceback.format_exc()))
        code = 1
    # Leave without interpreter finalisation: destroying the process group's and the
    # store's C++ threads during shutdown can abort ("terminate called without an
    # active exception") after the work is done. Everything this rank reports is
    # already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
