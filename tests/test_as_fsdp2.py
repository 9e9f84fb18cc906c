"""``fullshard.use_as_fsdp2()`` and ``python -m fullshard.as_fsdp2``: code written for torch's FSDP2 runs on
fullshard without an edit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed._composable.fsdp as composable_fsdp
import torch.distributed.fsdp as torch_fsdp

import fullshard
from fullshard.policy import validate_mp_policy, validate_offload_policy
from fullshard.swap import NAMES

TORCH_FULLY_SHARD, TORCH_FSDP_MODULE = torch_fsdp.fully_shard, torch_fsdp.FSDPModule
# Other test modules hold torch's names (they compare against torch's FSDP2): the warning names them.
EARLY_IMPORTERS = "ignore:these modules imported torch's FSDP2 names"

# A training script written for torch's FSDP2, as frameworks write them: the names come from torch.
FSDP2_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
fully_shard(model[0], mp_policy=MixedPrecisionPolicy())
composable_fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()
assert isinstance(model, FSDPModule)
print(f"rank {dist.get_rank()}: {type(model).__mro__[1].__module__} {sys.argv[1:]}")
dist.destroy_process_group()
"""


@pytest.mark.filterwarnings(EARLY_IMPORTERS)
def test_names_point_at_fullshard_and_back() -> None:
    with fullshard.use_as_fsdp2(announce=False) as swap:
        for module in (torch_fsdp, composable_fsdp):
            for name in NAMES:
                if hasattr(module, name) and hasattr(fullshard, name):
                    assert getattr(module, name) is getattr(fullshard, name), (module.__name__, name)
        from torch.distributed.fsdp import fully_shard

        assert fully_shard is fullshard.fully_shard
        assert swap.replaced
        again = fullshard.use_as_fsdp2(announce=False)  # idempotent: nothing left to replace
        assert not again.replaced
        again.restore()
    assert torch_fsdp.fully_shard is TORCH_FULLY_SHARD
    assert composable_fsdp.fully_shard is TORCH_FULLY_SHARD


@pytest.mark.filterwarnings(EARLY_IMPORTERS)
def test_torch_policies_stay_accepted_while_swapped() -> None:
    # Made with torch's classes (before the swap, or by code holding them): still converted while torch's names
    # point at fullshard's classes.
    mixed = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload, none = torch_fsdp.CPUOffloadPolicy(pin_memory=False), torch_fsdp.OffloadPolicy()
    with fullshard.use_as_fsdp2(announce=False):
        assert torch_fsdp.MixedPrecisionPolicy is fullshard.MixedPrecisionPolicy
        assert validate_mp_policy(mixed) == fullshard.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        assert validate_offload_policy(offload) == fullshard.CPUOffloadPolicy(pin_memory=False)
        assert type(validate_offload_policy(none)) is fullshard.OffloadPolicy


@pytest.mark.filterwarnings(EARLY_IMPORTERS)
def test_pipelining_imported_first_is_swapped_too() -> None:
    from torch.distributed.pipelining import schedules, stage

    assert stage.FSDPModule is TORCH_FSDP_MODULE
    with fullshard.use_as_fsdp2(announce=False):
        # both classes: stages sharded by torch's FSDP2 (or its replicate()) stay recognised
        assert stage.FSDPModule == (fullshard.FSDPModule, TORCH_FSDP_MODULE) == schedules.FSDPModule
        assert stage.fully_shard is fullshard.fully_shard
    assert stage.FSDPModule is TORCH_FSDP_MODULE and schedules.FSDPModule is TORCH_FSDP_MODULE


def test_modules_that_imported_torchs_names_first_are_named() -> None:
    early = types.ModuleType("early_framework")
    early.fully_shard = TORCH_FULLY_SHARD  # type: ignore[attr-defined]
    sys.modules["early_framework"] = early
    try:
        with pytest.warns(UserWarning, match=r"keep torch's FSDP2: .*early_framework \(fully_shard\)"):
            fullshard.use_as_fsdp2(announce=False).restore()
    finally:
        del sys.modules["early_framework"]
    with pytest.raises(TypeError, match="announce must be a bool"):
        fullshard.use_as_fsdp2(announce="yes")  # type: ignore[arg-type]


def _env() -> dict[str, str]:
    src = str(Path(fullshard.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def test_launcher_under_torchrun_runs_a_script_and_a_module(tmp_path: Path) -> None:
    (tmp_path / "fsdp2_train.py").write_text(FSDP2_SCRIPT)
    for target in (["-m", "fsdp2_train"], [str(tmp_path / "fsdp2_train.py")]):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "fullshard.as_fsdp2", *target, "--lr", "3"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert sorted(re.findall(r"rank \d: [^\]]*\]", done.stdout)) == [
            "rank 0: fullshard.api ['--lr', '3']", "rank 1: fullshard.api ['--lr', '3']"]
        # Said once, on rank 0 only.
        assert done.stderr.count("now point at fullshard") == 1, done.stderr
        assert "fully_shard" in done.stderr and "Warning" not in done.stderr, done.stderr


def test_launcher_usage_errors(tmp_path: Path) -> None:
    for args, message in (([], "usage: python -m fullshard.as_fsdp2"), (["-m"], "-m needs a module name"),
                          (["missing.py"], "no such script: missing.py")):
        done = subprocess.run([sys.executable, "-m", "fullshard.as_fsdp2", *args], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr
