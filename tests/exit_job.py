"""Short training jobs that end as user scripts do (run by tests/test_teardown.py).

    python -m tests.exit_job PORT [PORT ...]

One two-rank job per port (a TCPStore server the caller runs). Torch and fullshard are imported once here;
each rank is a fork that trains three steps and leaves through ``sys.exit``, so it goes through the whole
interpreter shutdown (atexit handlers, finalisation of the process group, the store and fullshard's threads)
exactly as a script launched by torchrun does. Odd jobs call ``destroy_process_group()`` first (fullshard's
heartbeat must stop with it); even jobs exit with the process group still up. Prints one line per rank that
did not exit 0 and exits 1 if any did; a clean run prints nothing, on stdout or stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from fullshard import failures, fully_shard
from tests.models import MLP, mse_loss
from tests.parity import regression_batch

WORLD_SIZE = 2


def rank_main(rank: int, port: int, destroy: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        mse_loss(model, regression_batch(torch.Generator().manual_seed(step))).backward()
        opt.step()
        opt.zero_grad()
    assert failures._heartbeat.running
    if destroy:
        dist.destroy_process_group()
        deadline = time.monotonic() + 3 * failures.HEARTBEAT_S
        while failures._heartbeat.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not failures._heartbeat.running, "the heartbeat outlived destroy_process_group()"


def main(ports: list[int]) -> int:
    torch.set_num_threads(1)
    failed = 0
    for job, port in enumerate(ports):
        children = {}
        for rank in range(WORLD_SIZE):
            pid = os.fork()
            if pid == 0:
                rank_main(rank, port, destroy=job % 2 == 1)
                sys.exit(0)  # through the normal interpreter shutdown
            children[pid] = rank
        for pid, rank in children.items():
            _, status = os.waitpid(pid, 0)
            if status:
                code = os.waitstatus_to_exitcode(status)
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                print(f"job {job} rank {rank}: {how}")
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(p) for p in sys.argv[1:]]))
