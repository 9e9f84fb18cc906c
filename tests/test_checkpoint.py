"""Checkpoints through torch.distributed.checkpoint: reshard across world sizes, survive interrupted saves,
refuse other models, convert to and from one full file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fullshard import checkpoint
from tests.harness import run_ranks
from tests.models import MLP, Transformer, lm_loss
from tests.parity import full_params, token_batch
from tests.test_parity import shard_transformer

CHUNKS = 4  # every step's global batch: 4 sequences, split evenly over 1, 2 or 4 ranks


def local_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    chunks = [token_batch(gen, rows=1) for _ in range(CHUNKS)]
    per_rank = CHUNKS // world_size
    return torch.cat(chunks[rank * per_rank : (rank + 1) * per_rank])


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Transformer()
    shard_transformer(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world_size: int) -> float:
    """One step on this rank's part of the global batch; returns the global mean loss."""
    loss = lm_loss(model, local_batch(step, rank, world_size))
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world_size


def app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _save_then_continue(rank: int, world_size: int, path: str) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    model, opt = build(seed=0)
    for step in range(2):
        train_step(model, opt, step, rank, world_size)
    saved_params = full_params(model)
    checkpoint.save(app_state(model, opt), path)
    losses = [train_step(model, opt, step, rank, world_size) for step in range(2, 4)]
    return losses, full_params(model), saved_params


def _load_then_continue(rank: int, world_size: int, path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, opt = build(seed=7)  # different initial values: everything must come from the checkpoint
    state = app_state(model, opt)
    checkpoint.load(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    losses = [train_step(model, opt, step, rank, world_size) for step in range(2, 4)]
    return losses, full_params(model)


@pytest.mark.parametrize(("save_ws", "load_ws"), [(2, 4), (2, 1), (4, 2)])
def test_reshard_checkpoint_and_continue(tmp_path: Path, save_ws: int, load_ws: int) -> None:
    path = str(tmp_path / "ckpt")
    losses, params, _ = run_ranks(save_ws, _save_then_continue, path)[0]
    resumed_losses, resumed_params = run_ranks(load_ws, _load_then_continue, path)[0]
    torch.testing.assert_close(resumed_losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed_params, params, rtol=1e-5, atol=1e-6)


# ---- consolidate / shard ---------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fullshard", *args], capture_output=True, text=True, timeout=120)


def test_consolidate_and_shard_commands(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    _, _, saved_params = run_ranks(2, _save_then_continue, ckpt)[0]
    out = tmp_path / "full.pt"
    done = run_cli("consolidate", ckpt, str(out))
    assert done.returncode == 0, done.stderr
    full = torch.load(out, weights_only=False)
    assert set(full) == {"model", "optim"}
    torch.testing.assert_close({k: full["model"][k] for k in saved_params}, saved_params, rtol=0, atol=0)
    assert "blocks.0.attn.qkv.weight" in full["optim"]["state"]

    back = tmp_path / "resharded"
    done = run_cli("shard", str(out), str(back))
    assert done.returncode == 0, done.stderr
    state = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()}}
    checkpoint.load(state, back)
    torch.testing.assert_close(state["model"], full["model"], rtol=0, atol=0)

    missing = run_cli("consolidate", str(tmp_path / "nope"), str(tmp_path / "x.pt"))
    assert missing.returncode == 2
    expected = f"fullshard consolidate: error: no complete checkpoint at {tmp_path / 'nope'}"
    assert missing.stderr.strip().splitlines() == [f"{expected} (a checkpoint directory holds a .metadata file)"]


# ---- safety ----------------------------------------------------------------------------------------


def test_interrupted_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path, started = tmp_path / "ckpt", tmp_path / "started"
    script = textwrap.dedent(f"""
        import time, torch
        from torch.distributed.checkpoint import filesystem
        from fullshard import checkpoint
        checkpoint.save({{"model": {{"w": torch.full((1000,), 1.0)}}}}, {str(path)!r})
        write = filesystem.FileSystemWriter.write_data
        def slow(self, *args, **kwargs):
            open({str(started)!r}, "w").close()
            time.sleep(120)
            return write(self, *args, **kwargs)
        filesystem.FileSystemWriter.write_data = slow
        checkpoint.save({{"model": {{"w": torch.full((1000,), 2.0)}}}}, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, "the saving process ended before the second save started"
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (tmp_path / "ckpt.partial").exists()
    state = {"model": {"w": torch.zeros(1000)}}
    assert checkpoint.load(state, path) == path
    assert torch.equal(state["model"]["w"], torch.full((1000,), 1.0))

    # Killed between the two renames: the old checkpoint is found as ckpt.previous.
    path.rename(tmp_path / "ckpt.previous")
    assert checkpoint.load(state, path) == tmp_path / "ckpt.previous"


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    checkpoint.save({"model": Transformer().state_dict()}, path)
    with pytest.raises(ValueError) as info:
        checkpoint.load({"model": Transformer(n_blocks=3).state_dict()}, path)
    assert "missing keys [model.blocks.2.attn.proj.bias, model.blocks.2.attn.proj.weight" in str(info.value)
    assert "unexpected keys []" in str(info.value)
    with pytest.raises(ValueError, match=r"missing keys \[model.layers.0.bias.*unexpected keys \[model.blocks.0.attn"):
        checkpoint.load({"model": MLP().state_dict()}, path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint at"):
        checkpoint.load({"model": MLP().state_dict()}, tmp_path / "absent")


# ---- damaged files -----------------------------------------------------------------------------------


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    state = {"model": Transformer().state_dict()}
    checkpoint.save(state, path)
    return path, state


def _data_file(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


def test_manifest_lists_every_file(tmp_path: Path) -> None:
    path, state = _saved(tmp_path)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
    assert sorted(manifest) == sorted(p.name for p in path.iterdir() if p.name != checkpoint.MANIFEST)
    assert all(entry["size"] == (path / name).stat().st_size for name, entry in manifest.items())
    assert checkpoint.verify(path) is True
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    checkpoint.load(loaded, path)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_file_is_named(tmp_path: Path, damage: str) -> None:
    path, state = _saved(tmp_path)
    victim = _data_file(path)
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
        expected = rf"{victim.name} has {len(data) // 2} bytes, the manifest says {len(data)} \(truncated"
    elif damage == "flip":
        middle = len(data) // 2
        victim.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
        expected = rf"{victim.name} has CRC-32 [0-9a-f]{{8}}, the manifest says [0-9a-f]{{8}} \(its bytes changed\)"
    else:
        victim.unlink()
        expected = rf"{victim.name} is missing"
    with pytest.raises(checkpoint.CheckpointDamagedError, match=rf"checkpoint {path} is damaged: {expected}"):
        checkpoint.load({"model": dict(state["model"])}, path)
    done = subprocess.run([sys.executable, "-m", "fullshard", "consolidate", str(path), str(tmp_path / "full.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(f"fullshard consolidate: error: checkpoint {path} is damaged: {victim.name}")
    assert not (tmp_path / "full.pt").exists()


def _verify_on_ranks(rank: int, world_size: int, path: str) -> str:
    try:
        checkpoint.verify(path)
    except checkpoint.CheckpointDamagedError as err:
        return str(err)
    return "intact"


def test_ranks_share_verification_and_agree(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    (path / "extra_0.distcp").write_bytes(b"x" * 10)  # files the manifest does not list are not checked
    assert run_ranks(2, _verify_on_ranks, str(path)) == ["intact", "intact"]
    names = sorted(json.loads((path / checkpoint.MANIFEST).read_text())["files"])
    victim = path / names[1]  # rank 1 reads this one
    victim.write_bytes(victim.read_bytes() + b"!")
    messages = run_ranks(2, _verify_on_ranks, str(path))
    assert messages[0] == messages[1] and f"is damaged: {victim.name} has" in messages[0]


def test_checkpoint_without_manifest_loads_unverified(tmp_path: Path) -> None:
    path, state = _saved(tmp_path)
    (path / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify(path) is False
    checkpoint.load({"model": dict(state["model"])}, path)
