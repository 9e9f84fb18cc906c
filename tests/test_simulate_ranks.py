"""Simulated ranks (torch's fake process group) on CPU: ``benchmarks/simulate_ranks.py`` and ``fullshard bench
--simulate-ranks``.

The runs are tiny smoke runs: they check that every row and column is reported and that the numbers parse,
never how fast anything was. The profile categories are checked directly on operation chains seen in real
profiles of both implementations.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.test_cli_bench import bench_tables, check_phases

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "simulate_ranks.py"
RANKS = (4, 8)
IMPLEMENTATIONS = ("fullshard", "torch-fsdp2")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_ranks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


def markdown_table(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header starts with ``| <first_header> |``, as column -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    assert set(lines[start + 1].replace("|", "")) == {"-"}, lines[start + 1]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        rows.append(dict(zip(header, cells)))
    return rows


def test_simulate_ranks_table() -> None:
    module = load_script()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny", "--ranks", *map(str, RANKS),
         "--steps", "2", "--warmup", "1", "--profile-steps", "1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    rows = markdown_table(done.stdout, "ranks | implementation")
    assert [(int(r["ranks"]), r["implementation"]) for r in rows] == [(n, i) for n in RANKS for i in IMPLEMENTATIONS]
    for row in rows:
        assert float(row["step ms"]) > 0 and float(row["host ms"]) > 0
        assert row["resident MiB"] == row["peak MiB"] == "n/a"  # no allocator statistics on CPU
        split = {c: float(row[f"{c} ms"]) for c in module.CATEGORIES}
        assert abs(sum(split.values()) - float(row["total ms"])) <= 0.01 * len(split)  # rounding only
        # The rules found each implementation's all-gather copies, packing, collectives and optimizer.
        for kind in ("copy-in", "copy-out", "rs-copy-in", "collective", "optimizer", "other"):
            assert split[kind] > 0, (row["implementation"], kind, row)
    ratios = markdown_table(done.stdout, "ranks | fullshard/FSDP2 step")
    assert [int(r["ranks"]) for r in ratios] == list(RANKS)
    for row in ratios:
        assert float(row["fullshard/FSDP2 step"]) > 0 and float(row["fullshard/FSDP2 host"]) > 0
        assert row["fullshard/FSDP2 peak memory"] == "n/a"
        # Both train the same model on the same batches; FSDP2's gradients come out N times fullshard's (the fake
        # group ignores the AVG it asks for), which AdamW all but cancels: the bf16 losses (about 6.2, rounding
        # step 1/32) differ by a rounding step or two at most, far from any real difference in training.
        assert float(row["max loss difference"]) <= 0.1


def test_categories_of_real_operation_chains() -> None:
    category = load_script().category
    chains = {
        # fullshard: the copy-in casts on the way; copy-out and packing are one op each.
        ("aten::copy_", "fullshard::all_gather blocks.0", "fullshard::pre_forward blocks.0"): "copy-in",
        ("aten::empty", "fullshard::all_gather blocks.1", "fullshard::prefetch blocks.1"): "copy-in",
        ("aten::copy_", "aten::split_with_sizes_copy", "fullshard::pre_forward blocks.0"): "copy-out",
        ("aten::copy_", "aten::cat", "aten::_chunk_cat", "fullshard::reduce_scatter_copy_in blocks.0",
         "fullshard::post_backward blocks.0"): "rs-copy-in",
        ("aten::copy_", "c10d::_allgather_base_", "fullshard::all_gather blocks.0"): "collective",
        ("aten::_to_copy", "aten::to", "aten::div_", "fullshard::post_backward blocks.0"): "other",
        # FSDP2: the cast is a foreach copy of its own before the copy-in.
        ("aten::copy_", "aten::_foreach_copy_", "FSDP::all_gather (blocks.0)", "FSDP::pre_forward (blocks.0)"): "cast",
        ("aten::copy_", "aten::_foreach_copy_", "fsdp::all_gather_copy_in", "FSDP::all_gather (blocks.0)"): "copy-in",
        ("aten::copy_", "aten::split_with_sizes_copy", "fsdp::split_with_sizes_copy",
         "FSDP::all_gather_copy_out (blocks.0)"): "copy-out",
        ("FSDP::all_gather_copy_out (blocks.0)", "FSDP::pre_backward (blocks.0)"): "copy-out",
        ("aten::copy_", "aten::cat", "aten::_chunk_cat", "fsdp::chunk_cat", "FSDP::post_backward_reduce (blocks.0)"):
            "rs-copy-in",
        ("aten::copy_", "aten::_to_copy", "aten::to", "FSDP::post_backward_reduce (blocks.0)"): "cast",
        ("c10d::_reduce_scatter_base_", "FSDP::post_backward_reduce (blocks.0)"): "collective",
        # Both: the optimizer, by torch.optim's labels or the fused kernel; the model.
        ("aten::sqrt", "aten::_foreach_sqrt", "PythonSubclass", "Optimizer.step#AdamW.step"): "optimizer",
        ("aten::_to_copy", "aten::to", "aten::mul", "aten::_foreach_mul_", "Optimizer.step#AdamW.step"): "optimizer",
        ("aten::_fused_adamw_",): "optimizer",
        ("aten::mm", "AddmmBackward0", "autograd::engine::evaluate_function: AddmmBackward0"): "other",
    }
    assert {chain: category(list(chain)) for chain in chains} == chains


def test_bench_simulate_ranks() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fullshard", "bench", "--simulate-ranks", "8", "--layers", "1", "--dim", "32",
         "--heads", "2", "--seq-len", "16", "--steps", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "world size 8" in done.stdout.splitlines()[0]
    rows, phases = bench_tables(done.stdout)
    assert set(rows) == set(IMPLEMENTATIONS)  # DDP cannot run on the fake group: left out by default
    # columns: name, step ms, ratio, params B/rank, state MiB/rank, peak, sent MiB/step, max loss diff
    assert rows["fullshard"][3] == rows["torch-fsdp2"][3]  # shards of 1/8 of the model
    assert rows["fullshard"][6] == rows["torch-fsdp2"][6]  # bytes counted at world size 8
    assert float(rows["torch-fsdp2"][7]) < 1e-3  # fp32; not exact: the fake group ignores FSDP2's AVG (see above)
    check_phases(rows, phases)


def test_bench_simulate_ranks_refuses_ddp() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fullshard", "bench", "--simulate-ranks", "8", "--implementations", "fullshard", "ddp"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode != 0
    assert "--simulate-ranks does not run ddp" in done.stderr
