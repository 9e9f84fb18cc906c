"""``fullshard bench`` at a tiny size: every implementation reported, fullshard and FSDP2 agree on bytes and losses."""

from __future__ import annotations

import subprocess
import sys


def bench_tables(stdout: str) -> tuple[dict[str, list[str]], dict[str, list[float]]]:
    """``fullshard bench``'s two tables by implementation: the comparison's columns, and rank 0's phases
    (forward, backward, optimizer.step, CPU user, CPU system ms)."""
    lines = stdout.splitlines()
    split = next(i for i, line in enumerate(lines) if line.startswith("rank 0, median ms"))
    rows = {line.split()[0]: line.split() for line in lines[2:split]}
    phases = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[split + 2:] if line.strip()}
    return rows, phases


def check_phases(rows: dict[str, list[str]], phases: dict[str, list[float]]) -> None:
    assert set(phases) == set(rows)
    for name, (forward, backward, optimizer, user, system) in phases.items():
        assert min(forward, backward, optimizer) > 0 and user + system > 0
        # rank 0's part of the slowest rank's step; the four numbers are printed to 0.1 ms, so each is off by <= 0.05
        assert forward + backward + optimizer <= float(rows[name][1]) * 1.01 + 4 * 0.05


def test_bench_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fullshard", "bench", "--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16",
         "--steps", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    rows, phases = bench_tables(done.stdout)
    assert set(rows) == {"fullshard", "torch-fsdp2", "ddp"}
    assert rows["fullshard"][2] == "1.000"
    # columns: name, step ms, ratio, params B/rank, state MiB/rank, peak, sent MiB/step, max loss diff
    assert rows["fullshard"][3] == rows["torch-fsdp2"][3]  # the same shards
    assert int(rows["ddp"][3]) > int(rows["fullshard"][3])  # DDP keeps every parameter on every rank
    assert rows["fullshard"][6] == rows["torch-fsdp2"][6]  # the same bytes on the wire
    assert float(rows["torch-fsdp2"][7]) < 1e-5  # and the same losses
    check_phases(rows, phases)
