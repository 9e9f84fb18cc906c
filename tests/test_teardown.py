"""Clean teardown: background threads stop with the process group and at exit; no rank aborts or warns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
JOBS = 10


def test_short_jobs_exit_cleanly_every_time() -> None:
    """10 two-rank training jobs, half ending with destroy_process_group() and half without: every rank exits 0
    and writes nothing to stderr (no abort at exit, no leaked-resource warning)."""
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(JOBS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.exit_job", *(str(s.port) for s in stores)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", (done.returncode, done.stdout, done.stderr)
