"""``fullshard bench`` at a tiny size: every implementation reported, fullshard and FSDP2 agree on bytes and losses."""

from __future__ import annotations

import subprocess
import sys


def test_bench_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fullshard", "bench", "--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16",
         "--steps", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"fullshard", "torch-fsdp2", "ddp"}
    assert rows["fullshard"][2] == "1.000"
    # columns: name, step ms, ratio, params B/rank, state MiB/rank, peak, sent MiB/step, max loss diff
    assert rows["fullshard"][3] == rows["torch-fsdp2"][3]  # the same shards
    assert int(rows["ddp"][3]) > int(rows["fullshard"][3])  # DDP keeps every parameter on every rank
    assert rows["fullshard"][6] == rows["torch-fsdp2"][6]  # the same bytes on the wire
    assert float(rows["torch-fsdp2"][7]) < 1e-5  # and the same losses
