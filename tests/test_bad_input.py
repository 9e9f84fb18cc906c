"""Every public function and CLI flag, given a wrong type or value, fails with a clear error naming the argument,
and leaves nothing half-applied."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import Replicate

import fullshard
from fullshard import (
    EMA,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ModuleWrapPolicy,
    checkpoint,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    nonfinite_gradients,
    shard_model,
    summon_full_params,
)
from fullshard import optim as fs_optim
from tests.harness import run_ranks


def plain() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def sharded() -> nn.Module:
    model = plain()
    fully_shard(model[0])
    fully_shard(model)
    return model


def _child_after_a_step() -> nn.Module:
    model = sharded()
    model(torch.randn(2, 4)).sum().backward()
    return model[0]


def _shared_by_two_calls() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    fully_shard(model[0])
    fully_shard(model[1])  # no call on model to take the shared module: its first forward raises
    model(torch.randn(2, 2))


def _enter(context: Any) -> None:
    with context:
        pass


# (name, call, exception type(s), message pattern). A call gets nothing; it builds what it needs. Two types: the
# error is both, the first what fullshard documents, the second what torch's FSDP2 raises for the same mistake.
Kinds = type[Exception] | tuple[type[Exception], ...]
FULLY_SHARD: list[tuple[str, Callable[[nn.Module], Any], Kinds, str]] = [
    ("module", lambda m: fully_shard(3), (TypeError, AttributeError),
     "fully_shard expects an nn.Module or a list of them, got int"),
    ("no modules", lambda m: fully_shard([]), (ValueError, IndexError), "fully_shard got an empty list of modules"),
    ("mesh", lambda m: fully_shard(m, mesh="cpu"), (TypeError, AttributeError),
     "mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    ("reshard_after_forward type", lambda m: fully_shard(m, reshard_after_forward="yes"), ValueError,
     r"reshard_after_forward should be a bool or an int representing the group size to reshard to, not yes \(a "
     r"bool, an int or None: got str\)"),
    ("reshard_after_forward value", lambda m: fully_shard(m, reshard_after_forward=3), ValueError,
     "it should be a factor of 2, not 3"),
    ("shard_placement_fn", lambda m: fully_shard(m, shard_placement_fn=3), TypeError,
     "shard_placement_fn must be callable or None, got int"),
    ("shard_placement_fn result", lambda m: fully_shard(m, shard_placement_fn=lambda p: Replicate()), ValueError,
     r"Invalid shard_placement_fn result: R \(shard_placement_fn must return a Shard or None, got Replicate\(\) "
     r"for '0.weight'\)"),
    ("module listed twice", lambda m: fully_shard([m[0], m[2], m[0]]), AssertionError,
     r"fully_shard got the same Linear twice in its list of modules \(index 2\)"),
    ("mp_policy type", lambda m: fully_shard(m, mp_policy="bf16"), (TypeError, AttributeError),
     "mp_policy must be a MixedPrecisionPolicy"),
    ("mp_policy dtype", lambda m: fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype="bf16")),
     (ValueError, RuntimeError), "MixedPrecisionPolicy.param_dtype must be a floating-point"),
    ("mp_policy integer dtype", lambda m: fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8)),
     (ValueError, RuntimeError), "MixedPrecisionPolicy.param_dtype must be a floating-point torch.dtype or None, got "
     "torch.int8"),
    ("mp_policy integer reduce dtype", lambda m: fully_shard(m, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int64)),
     (ValueError, TypeError), "MixedPrecisionPolicy.reduce_dtype must be a floating-point torch.dtype or None, got "
     "torch.int64"),
    ("offload_policy", lambda m: fully_shard(m, offload_policy="cpu"), (TypeError, AttributeError),
     "offload_policy must be an OffloadPolicy, got str"),
    ("offload_policy class", lambda m: fully_shard(m, offload_policy=CPUOffloadPolicy), (TypeError, AttributeError),
     r"offload_policy must be an OffloadPolicy, got the class CPUOffloadPolicy \(an instance is needed: "
     r"CPUOffloadPolicy\(\)\)"),
    ("pin_memory", lambda m: fully_shard(m, offload_policy=CPUOffloadPolicy(pin_memory="yes")), TypeError,
     "CPUOffloadPolicy.pin_memory must be a bool, got str"),
    ("ignored_params", lambda m: fully_shard(m, ignored_params=3), TypeError,
     "ignored_params must be a set of parameters, got int"),
    ("ignored_params items", lambda m: fully_shard(m, ignored_params={"weight"}), TypeError,
     "ignored_params must be a set of parameters, got set"),
]

CALLS: list[tuple[str, Callable[[], Any], Kinds, str]] = [
    ("fully_shard on a child after its parent", lambda: fully_shard(sharded()[2]), (ValueError, TypeError),
     "parameter 'weight' is already sharded by the fully_shard call on 'Sequential', which encloses this call: apply "
     "fully_shard to submodules before their parents"),
    ("set_requires_gradient_sync", lambda: sharded().set_requires_gradient_sync("no"), TypeError,
     "set_requires_gradient_sync: requires_gradient_sync must be a bool, got str"),
    ("set_requires_all_reduce", lambda: sharded().set_requires_all_reduce(1), TypeError,
     "requires_all_reduce must be a bool, got int"),
    ("set_reshard_after_forward", lambda: sharded().set_reshard_after_forward("x"), ValueError,
     "reshard_after_forward should be a bool, got str"),
    ("set_reshard_after_backward", lambda: sharded().set_reshard_after_backward(None), TypeError,
     "reshard_after_backward must be a bool, got NoneType"),
    ("set_is_last_backward", lambda: sharded().set_is_last_backward("x"), TypeError, "is_last_backward must be a bool"),
    ("set_unshard_in_backward", lambda: sharded().set_unshard_in_backward(3), TypeError,
     "unshard_in_backward must be a bool"),
    ("set_gradient_divide_factor type", lambda: sharded().set_gradient_divide_factor("2"), TypeError,
     "set_gradient_divide_factor: factor must be a number, got str"),
    ("set_gradient_divide_factor zero", lambda: sharded().set_gradient_divide_factor(0), (ValueError, ZeroDivisionError),
     "set_gradient_divide_factor: factor must not be zero"),
    ("set_reduce_scatter_divide_factor", lambda: sharded().set_reduce_scatter_divide_factor(float("inf")), ValueError,
     "factor must be a finite number, got inf"),
    ("set_all_reduce_hook", lambda: sharded().set_all_reduce_hook(3), TypeError, "hook must be callable, got int"),
    ("set_post_optim_event", lambda: sharded().set_post_optim_event(3), TypeError,
     "event must be a torch.Event .*, got int"),
    ("set_reduce_scatter_unused_params", lambda: sharded().set_reduce_scatter_unused_params("x"), TypeError,
     "reduce_scatter_unused_params must be a bool"),
    ("set_reduce_scatter_max_input_buffers", lambda: sharded().set_reduce_scatter_max_input_buffers(0), ValueError,
     "max_input_buffers must be a positive int, got 0"),
    ("set_force_sum_reduction_for_comms", lambda: sharded().set_force_sum_reduction_for_comms("x"), TypeError,
     "enable must be a bool"),
    ("set_modules_to_forward_prefetch", lambda: sharded().set_modules_to_forward_prefetch([nn.Linear(2, 2)]), ValueError,
     "Expects FSDPModule but got Linear: expected modules passed to fully_shard"),
    ("set_modules_to_backward_prefetch", lambda: sharded().set_modules_to_backward_prefetch(3), TypeError,
     "expected a list of modules passed to fully_shard, got int"),
    ("set_modules_to_forward_prefetch str", lambda: sharded().set_modules_to_forward_prefetch("ab"), ValueError,
     "Expects FSDPModule but got str"),
    ("share_comm_ctx str", lambda: fullshard.share_comm_ctx("ab"), ValueError, "Expects FSDPModule but got str"),
    ("a module shared by two calls and no call enclosing both", _shared_by_two_calls, (ValueError, TypeError),
     "call fully_shard on a common ancestor of the modules sharing it before the first forward, or shard the shared "
     r"module on its own first \(fully_shard\(shared\), then the others\)"),
    ("reset_iter_state on a child", lambda: _child_after_a_step().reset_iter_state(), RuntimeError,
     "reset_iter_state must be called on the root module"),
    ("unshard", lambda: sharded().unshard(async_op="x"), TypeError, "unshard: async_op must be a bool, got str"),
    ("EMA decay", lambda: EMA(sharded(), 1.5), ValueError, r"EMA decay must be a number in \[0, 1\], got 1.5"),
    ("clip_grad_norm_ model", lambda: clip_grad_norm_(3, 1.0), TypeError, "clip_grad_norm_ expects an nn.Module, got int"),
    ("clip_grad_norm_ max_norm type", lambda: clip_grad_norm_(sharded(), "1"), TypeError,
     "max_norm must be a number, got str"),
    ("clip_grad_norm_ max_norm value", lambda: clip_grad_norm_(sharded(), -1.0), ValueError,
     "max_norm must be at least 0"),
    ("clip_grad_norm_ norm_type", lambda: clip_grad_norm_(sharded(), 1.0, norm_type=None), TypeError,
     "norm_type must be a number or 'inf'"),
    ("nonfinite_gradients", lambda: nonfinite_gradients("model"), TypeError, "nonfinite_gradients expects an nn.Module"),
    ("summon_full_params", lambda: _enter(summon_full_params(3)), TypeError, "summon_full_params expects an nn.Module"),
    ("no_sync", lambda: _enter(no_sync(3)), TypeError, "no_sync expects an nn.Module"),
    ("full_state_dict", lambda: fullshard.full_state_dict(3), TypeError, "full_state_dict expects an nn.Module"),
    ("shard_model model", lambda: shard_model(3), TypeError, "shard_model expects an nn.Module, got int"),
    ("shard_model strategy", lambda: shard_model(plain(), sharding_strategy="FULL_SHARD"), TypeError,
     "sharding_strategy must be a fullshard.ShardingStrategy"),
    ("shard_model policy", lambda: shard_model(plain(), auto_wrap_policy=3), TypeError,
     "auto_wrap_policy must be a policy or a callable"),
    ("ModuleWrapPolicy", lambda: ModuleWrapPolicy(nn.Linear), TypeError, "expects a set of module classes"),
    ("ModuleWrapPolicy items", lambda: ModuleWrapPolicy({"Linear"}), TypeError, "expects nn.Module subclasses"),
    ("optim.AdamW lr", lambda: fs_optim.AdamW(sharded().parameters(), lr=-1.0), ValueError, "Invalid learning rate"),
    ("optim.SGD momentum", lambda: fs_optim.SGD(sharded().parameters(), lr=0.1, momentum=-1), ValueError,
     "Invalid momentum value"),
    ("checkpoint.save state", lambda: checkpoint.save(3, "ckpt"), TypeError, "checkpoint.save: state must be a dict"),
    ("checkpoint.load path", lambda: checkpoint.load({}, 3), TypeError,
     "checkpoint.load: path must be a str or os.PathLike, got int"),
    ("full_optim_state_dict optim", lambda: fullshard.full_optim_state_dict(sharded(), "adam"), TypeError,
     "full_optim_state_dict: optim must be a torch.optim.Optimizer, got str"),
    ("full_optim_state_dict rank0_only", lambda: fullshard.full_optim_state_dict(
        sharded(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), rank0_only="yes"), TypeError,
     "full_optim_state_dict: rank0_only must be a bool, got str"),
    ("load_full_optim_state_dict full_osd", lambda: fullshard.load_full_optim_state_dict(
        (m := sharded()), torch.optim.SGD(m.parameters(), lr=0.1), [1, 2]), TypeError,
     "load_full_optim_state_dict: full_osd must be a dict from full_optim_state_dict"),
    ("rekey_optim_state_dict osd", lambda: fullshard.rekey_optim_state_dict(
        3, sharded(), fullshard.OptimStateKeyType.PARAM_NAME), TypeError,
     "rekey_optim_state_dict: osd must be an optimizer state dict"),
    ("rekey_optim_state_dict key_type", lambda: fullshard.rekey_optim_state_dict(
        {"state": {}, "param_groups": []}, sharded(), "names"), TypeError, "key_type must be an OptimStateKeyType"),
    ("full_state_dict rank0_only", lambda: fullshard.full_state_dict(sharded(), rank0_only="x"), TypeError,
     "full_state_dict: rank0_only must be a bool, got str"),
    ("EMA model", lambda: EMA("model", 0.9), TypeError, "EMA expects an nn.Module, got str"),
    ("CustomPolicy", lambda: fullshard.CustomPolicy(3), TypeError, "CustomPolicy expects a callable"),
    ("register_comm_hook hook", lambda: fullshard.register_comm_hook(sharded(), None, 3), TypeError,
     "register_comm_hook: hook must be callable, got int"),
    ("register_fsdp_forward_method", lambda: fullshard.register_fsdp_forward_method(sharded(), "nope"), ValueError,
     "does not have a method nope"),
    ("share_comm_ctx", lambda: fullshard.share_comm_ctx([nn.Linear(2, 2)]), ValueError,
     "Expects FSDPModule but got Linear"),
    ("fully_shard over torch's FSDP1", lambda: fully_shard(nn.Sequential(FullyShardedDataParallel(
        nn.Linear(2, 2), device_id=torch.device("cpu")))), (ValueError, TypeError),
     r"fully_shard got a Sequential and its submodule '0' is wrapped by torch's FSDP1 \(FullyShardedDataParallel\)"),
    ("comm_policy", lambda: fully_shard(nn.Linear(2, 2), comm_policy=3), TypeError,
     "comm_policy must be a QuantizedCommPolicy or None, got int"),
    ("optim.Muon lr", lambda: fs_optim.Muon(sharded().parameters(), lr=-1.0), ValueError, "Learning rate should be >= 0"),
    ("checkpoint.verify path", lambda: checkpoint.verify(3), TypeError,
     "checkpoint.verify: path must be a str or os.PathLike, got int"),
    ("clip_grad_norm_ norm_type str", lambda: clip_grad_norm_(sharded(), 1.0, norm_type="fro"), ValueError,
     "clip_grad_norm_: norm_type must be a number or 'inf', got 'fro'"),
    ("set_collective_timeout type", lambda: fullshard.set_collective_timeout("60"), TypeError,
     "seconds must be a number, got str"),
    ("set_collective_timeout value", lambda: fullshard.set_collective_timeout(-1), ValueError,
     "seconds must be positive, got -1"),
]


def _snapshot(model: nn.Module) -> list[Any]:
    return [type(model)] + [(name, id(p), p.detach().clone()) for name, p in model.named_parameters()] + [
        (len(m._forward_pre_hooks), len(m._forward_hooks), type(m)) for m in model.modules()]


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b) or a[0] is not b[0]:
        return False
    return all(x == y if not isinstance(x, tuple) or len(x) != 3 or not isinstance(x[2], torch.Tensor)
               else x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a[1:], b[1:]))


def _fully_shard_cases(rank: int, world_size: int) -> list[str]:
    problems = []
    for name, call, kind, pattern in FULLY_SHARD:
        model = plain()
        before = _snapshot(model)
        try:
            call(model)
            problems.append(f"{name}: no error")
        except Exception as err:  # noqa: BLE001 - the wrong type is the finding
            problems.extend(_mismatch(name, err, kind, pattern))
        if not _same(before, _snapshot(model)):
            problems.append(f"{name}: the module changed")
        fully_shard(model)  # still usable
        model(torch.randn(2, 4)).sum().backward()
    return problems


def _call_cases(rank: int, world_size: int) -> list[str]:
    problems = []
    for name, call, kind, pattern in CALLS:
        try:
            call()
            problems.append(f"{name}: no error")
        except Exception as err:  # noqa: BLE001
            problems.extend(_mismatch(name, err, kind, pattern))
    with pytest.warns(DeprecationWarning, match="use set_gradient_divide_factor"):  # FSDP2's older name warns too
        sharded().set_reduce_scatter_divide_factor(2.0)
    return problems


def _mismatch(name: str, err: Exception, kind: Kinds, pattern: str) -> list[str]:
    """What is wrong with ``err`` for a case expecting ``kind`` (every one of them) and a message matching ``pattern``."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not all(isinstance(err, k) for k in kinds):
        return [f"{name}: {type(err).__name__} is not a {' and a '.join(k.__name__ for k in kinds)}: {err}"]
    if not re.search(pattern, str(err)):
        return [f"{name}: message {str(err)!r} does not match {pattern!r}"]
    return []


def _syncs_skipped(rank: int, world_size: int) -> list[bool]:
    """Whether a backward after ``set_requires_gradient_sync(flag)`` left every sharded gradient unset, per flag."""
    skipped = []
    for flag in (False, np.False_, True, np.True_):
        model = sharded()
        model.set_requires_gradient_sync(flag)
        model(torch.randn(2, 4) + rank).sum().backward()
        skipped.append(all(p.grad is None for p in model.parameters()))
    return skipped


def test_numpy_bools_are_bools() -> None:
    """The setters take numpy's bools as bools (an index computed with numpy gives one); ints and None stay errors."""
    assert run_ranks(2, _syncs_skipped) == [[True, True, False, False]] * 2


@pytest.mark.parametrize("cases", [_fully_shard_cases, _call_cases])
def test_library_arguments(cases: Callable[[int, int], list[str]]) -> None:
    assert run_ranks(2, cases) == [[], []]


TRAIN_FLAGS = [
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--batch-size", "-4"], "--batch-size must be at least 1, got -4"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--lr", "-0.1"], "--lr must be a positive number, got -0.1"),
    (["--min-lr-ratio", "2"], r"--min-lr-ratio must be in \[0, 1\], got 2.0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--weight-decay", "-1"], "--weight-decay must be at least 0"),
    (["--clip", "-1"], "--clip must be at least 0"),
    (["--stop-at", "-3"], "--stop-at must be at least 0"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--device", "tpu"], "--device must be cpu or cuda, got 'tpu'"),
    (["--sharding", "ZERO9"], "--sharding must be one of"),
    (["--reshard-after-forward", "maybe"], "--reshard-after-forward must be auto, true or false"),
    (["--ema", "1.5"], r"--ema must be a decay in \[0, 1\)"),
    (["--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
    (["--dim", "30", "--heads", "4"], "dim 30 is not divisible by n_heads 4"),
    (["--layers", "0"], "every size must be positive"),
    (["--data", "/nonexistent/text"], "data path /nonexistent/text does not exist"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--eval-batches", "0"], "--eval-batches must be at least 1, got 0"),
    (["--optimizer", "lion"], "--optimizer must be adamw or muon, got 'lion'"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
    (["--skip-nonfinite", "3"], "unrecognized arguments: 3"),
    (["--hf-model", "gpt9"], r"--hf-model: unknown model type 'gpt9' \(a transformers model_type"),
]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run the ``fullshard`` command in this process (bad input is rejected before any rank starts)."""
    from fullshard.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flags,message", TRAIN_FLAGS, ids=[" ".join(f) for f, _ in TRAIN_FLAGS])
def test_train_flags(flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if "--hf-model" in flags:
        pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    data = tmp_path / "text.txt"
    data.write_text("some text to train on " * 200)
    code, last = _cli(capsys, "train", "--data", str(data), "--out", str(tmp_path / "run"), "--layers", "1", "--dim", "16",
                      "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--no-progress", *flags)
    assert code == 2
    assert re.match(r"fullshard( train)?: error: ", last) and re.search(message, last), last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_replicate_that_does_not_divide_the_world(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text("some text to train on " * 200)
    done = subprocess.run([sys.executable, "-m", "fullshard", "train", "--data", str(data), "--out", str(tmp_path / "run"),
                           "--layers", "1", "--dim", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
                           "--replicate", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "fullshard train: error: --replicate 3 needs a sharding strategy and a world size (2)")


@pytest.mark.parametrize("args,message", [
    (["bench", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["bench", "--implementations", "deepspeed"], "argument --implementations: invalid choice: 'deepspeed'"),
    (["consolidate", "/nonexistent/ckpt", "out.pt"], "no complete checkpoint at /nonexistent/ckpt"),
    (["shard", "/nonexistent/full.pt", "ckpt"], "no such file: /nonexistent/full.pt"),
])
def test_other_commands(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, last = _cli(capsys, *args)
    assert code == 2
    assert last.startswith(f"fullshard {args[0]}: error: ") and re.search(message, last), last
