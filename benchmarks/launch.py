"""Start a benchmark's ranks: under torchrun use its environment, otherwise spawn local gloo ranks on loopback."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launch(worker: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``worker(rank, world_size, *args)`` on every rank, with the process group initialised."""
    if "RANK" in os.environ:
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, worker, args)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_run, args=(world_size, store.port, worker, args), nprocs=world_size)


def device_for(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _run(rank: int, world_size: int, port: int | None, worker: Callable[..., None], args: tuple[Any, ...]) -> None:
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if port is None:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    finally:
        dist.barrier()  # tear gloo down on every rank together; a rank leaving early can abort the other
        dist.destroy_process_group()
