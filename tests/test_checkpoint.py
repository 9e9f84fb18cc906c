"""Checkpoints through torch.distributed.checkpoint: reshard across world sizes, survive interrupted saves,
refuse other models, convert to and from one full file."""

from __future__ import annotations

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
