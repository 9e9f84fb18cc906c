"""One fully_shard group with parameters of several dtypes: bf16 weights beside fp32 norms."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import mse_loss
from tests.parity import assert_parity, random_batches, regression_batch, run_parity, train

BF16 = torch.bfloat16
BF16_TOL = {"rtol": 2e-2, "atol": 1e-2}


class MixedNet(nn.Module):
    """bf16 linear layers around an fp32 LayerNorm, as in mixed-precision checkpoints; casts at the seams."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13).to(BF16)
        self.norm = nn.LayerNorm(13)
        self.out = nn.Linear(13, 3).to(BF16)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x.to(BF16)).float())
        return (self.out(h.to(BF16)).double() * self.scale).float()


def _no_policy(rank: int, world_size: int) -> None:
    def shard(model: nn.Module) -> None:
        fully_shard(model)

    _, model = run_parity(rank, world_size, MixedNet, shard, regression_batch, mse_loss, steps=4, **BF16_TOL)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {"inp.weight": BF16, "inp.bias": BF16, "norm.weight": torch.float32, "norm.bias": torch.float32,
                      "out.weight": BF16, "out.bias": BF16, "scale": torch.float64}
    rec = CommRecorder(model)
    batch = random_batches(1, world_size, regression_batch)[0][rank]
    mse_loss(model, batch).backward()
    assert rec.count("ag") == 1 and rec.count("rs") == 1, rec.events  # one group, one all-gather, one reduce-scatter
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and p.to_local().dtype == p.dtype, name
    assert state_of(model).group.mixed


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_group_of_three_dtypes_trains_with_parity(world_size: int) -> None:
    run_ranks(world_size, _no_policy)


def _with_policy(rank: int, world_size: int) -> None:
    """With param_dtype every parameter computes in bf16: one mixed group trains exactly like one group per dtype."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)

    def one_group(model: nn.Module) -> None:
        fully_shard(model, mp_policy=policy)

    def grouped(model: nn.Module) -> None:
        fully_shard([model.inp, model.out], mp_policy=policy)  # bf16
        fully_shard(model.norm, mp_policy=policy)  # fp32
        fully_shard(model, mp_policy=policy)  # fp64 scale

    class Net(MixedNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # everything arrives in bf16
            h = self.norm(self.inp(x.to(BF16)))
            return (self.out(h) * self.scale).float()

    torch.manual_seed(0)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    one_group(a)
    grouped(b)
    for step, batch in enumerate(random_batches(3, world_size, regression_batch)):
        for model in (a, b):
            mse_loss(model, batch[rank]).backward()
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad.full_tensor(), pb.grad.full_tensor(), rtol=0, atol=0,
                                       msg=lambda m: f"step {step} {name}: {m}")
            with torch.no_grad():
                pa -= 0.1 * pa.grad
                pb -= 0.1 * pb.grad
            pa.grad = pb.grad = None


def test_mixed_group_with_param_dtype_equals_one_group_per_dtype() -> None:
    run_ranks(2, _with_policy)


def _state_dict_offload_and_meta(rank: int, world_size: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fullshard import CPUOffloadPolicy

    torch.manual_seed(0)
    ref = MixedNet()
    with torch.device("meta"):
        model = MixedNet()
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    model.to_empty(device="cpu")  # relinks the byte buffer on real memory
    set_model_state_dict(model, ref.state_dict())  # full tensors in, sharded per dtype
    state = get_model_state_dict(model)
    for name, value in ref.state_dict().items():
        assert state[name].dtype == value.dtype, name
        torch.testing.assert_close(state[name].full_tensor(), value, rtol=0, atol=0, msg=name)
    batch = random_batches(1, world_size, regression_batch)[0]
    mse_loss(model, batch[rank]).backward()
    (sum(mse_loss(ref, b) for b in batch) / world_size).backward()
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.to_local().device.type == "cpu" and p.grad.dtype == ref_p.dtype, name
        torch.testing.assert_close(p.grad.full_tensor(), ref_p.grad, msg=lambda m: f"{name}: {m}", **BF16_TOL)


def test_state_dict_offload_and_meta_init() -> None:
    run_ranks(2, _state_dict_offload_and_meta)


def _assigned_then_loaded(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = MixedNet()
    torch.manual_seed(0)
    model = MixedNet()
    fully_shard(model)
    with torch.no_grad():
        model.scale = nn.Parameter(model.scale * 3)  # a float64 DTensor in the group's byte buffer
        ref.scale.mul_(1.5)
    scale = model.scale
    model.load_state_dict(ref.state_dict())  # before the first forward: loads into the assigned object
    assert model.scale is scale and scale.dtype == torch.float64
    batches = random_batches(3, world_size, regression_batch)
    assert_parity(train(ref, batches, mse_loss, rank=None), train(model, batches, mse_loss, rank=rank), rank, **BF16_TOL)
    assert model.scale is scale and scale.to_local().dtype == torch.float64


def test_parameter_assigned_after_fully_shard_then_loaded() -> None:
    run_ranks(2, _assigned_then_loaded)


class Dequantize(nn.Module):
    """A frozen float8 weight (quantized, scaled back in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter((torch.randn(12, 12) * 4).to(torch.float8_e4m3fn), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ (self.q.to(h.dtype) / 4)


class Float8Frozen(nn.Module):
    """A frozen float8 weight beside trainable fp32 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 12)
        self.dq = Dequantize()
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dq(torch.relu(self.inp(x))))


def _float8_frozen(rank: int, world_size: int, bf16: bool, alone: bool) -> None:
    def shard(model: nn.Module) -> None:
        policy = MixedPrecisionPolicy(param_dtype=BF16) if bf16 else MixedPrecisionPolicy()
        if alone:
            fully_shard(model.dq, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    tol = BF16_TOL if bf16 else {}
    _, model = run_parity(rank, world_size, Float8Frozen, shard, regression_batch, mse_loss, steps=3, **tol)
    q = model.dq.q
    assert q.dtype == torch.float8_e4m3fn and q.grad is None and state_of(model.dq if alone else model).group.mixed != alone
    torch.manual_seed(0)
    rows = Float8Frozen().dq.q.chunk(world_size)[rank]  # (compared as bytes: gloo does not gather float8)
    assert torch.equal(q.to_local().view(torch.uint8), rows.view(torch.uint8))


@pytest.mark.parametrize(("bf16", "alone"), [(False, False), (True, False), (False, True)],
                         ids=["fp32", "bf16-compute", "float8-group"])
def test_frozen_float8_parameter_beside_trainable_ones(bf16: bool, alone: bool) -> None:
    """torch's promotion refuses float8, which a mixed group's reduce dtype used to come from; gloo has no float8
    type, so a group of float8 alone all-gathers bytes."""
    run_ranks(2, _float8_frozen, bf16, alone)


class Spectral(nn.Module):
    """A complex weight (as in Fourier layers and state-space models)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 7, dtype=torch.complex64) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.w.dtype) @ self.w.T


class Head(nn.Module):
    """A complex gain, a frozen integer permutation and a real linear layer: one group of three dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.perm = nn.Parameter(torch.randperm(6), requires_grad=False)
        self.lin = nn.Linear(6, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        feats = (z[:, self.perm] * self.gain).abs()
        return self.lin(feats.to(self.lin.weight.dtype))


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.spectral = Spectral()
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.spectral(x)).float()


def _complex(rank: int, world_size: int, reduce_dtype: torch.dtype | None, accumulate: bool, quantized: bool) -> None:
    """Under a param_dtype only floating-point parameters are cast (as in FSDP2): complex and integer ones compute
    in their own dtype, and complex gradients reduce in a complex dtype whatever the reduce_dtype (FSDP2 casts them
    to it, dropping their imaginary parts). Quantized communication leaves them as they are too."""
    from fullshard import QuantizedCommPolicy
    from tests.test_mixed_precision import reference_casts

    f64 = torch.float64
    policy = MixedPrecisionPolicy(param_dtype=f64, reduce_dtype=reduce_dtype)
    # (on the complex group only, so the real layers travel exact)
    extra = {"comm_policy": QuantizedCommPolicy(reduce_dtype=torch.float32)} if quantized else {}

    def shard(model: nn.Module) -> None:
        fully_shard(model.spectral, mp_policy=policy, **extra)  # complex alone
        fully_shard(model, mp_policy=policy)  # complex, int64 and fp32

    loss_fn = reference_casts(mse_loss, f64, None)
    if not accumulate:
        seen: set[torch.dtype] = set()
        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        collective = getattr(dist, name)

        def recording(output: torch.Tensor, inp: torch.Tensor, **kwargs: Any) -> Any:
            seen.update((output.dtype, inp.dtype))
            return collective(output, inp, **kwargs)

        with mock.patch.object(dist, name, recording):
            _, model = run_parity(rank, world_size, ComplexNet, shard, regression_batch, loss_fn, steps=3)
        # The complex gradients reach the reduce-scatter as real pairs (NCCL has no complex type)
        assert seen and not any(d.is_complex for d in seen), seen
    else:  # two micro-batches, the first without gradient sync
        torch.manual_seed(0)
        ref, model = ComplexNet(), ComplexNet()
        model.load_state_dict(ref.state_dict())
        shard(model)
        micro = random_batches(2, world_size, regression_batch)
        for i, batch in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            loss_fn(model, batch[rank]).backward()
            (sum(loss_fn(ref, b) for b in batch) / world_size).backward()
        # fullshard's clip_grad_norm_ over complex, fp32 and float64 (upcast) gradients, as torch's on the reference
        for norm_type in (2.0, float("inf")):
            total = clip_grad_norm_(model, 1e-3, norm_type=norm_type)
            torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=norm_type))
        for (name, p), ref_p in zip(model.named_parameters(), ref.parameters()):
            if ref_p.grad is None:
                assert p.grad is None, name
                continue
            assert p.grad.dtype == ref_p.dtype, name
            torch.testing.assert_close(p.grad.full_tensor(), ref_p.grad, msg=lambda m: f"{name}: {m}")
    assert model.spectral.w.dtype == torch.complex64 and model.head.perm.dtype == torch.int64
    assert model.head.perm.to_local().dtype == torch.int64
    torch.manual_seed(0)
    assert torch.equal(model.head.perm.full_tensor(), ComplexNet().head.perm)


@pytest.mark.parametrize(("reduce_dtype", "accumulate", "quantized"), [
    (None, False, False), (torch.float32, False, False), (torch.float32, True, False), (None, False, True),
], ids=["compute-reduce", "fp32-reduce", "fp32-reduce-accumulated", "quantized-comm"])
def test_complex_and_integer_parameters_keep_their_dtype_under_param_dtype(
    reduce_dtype: torch.dtype | None, accumulate: bool, quantized: bool
) -> None:
    run_ranks(2, _complex, reduce_dtype, accumulate, quantized)


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(9, dtype=torch.complex64))  # 5 and 4 rows on 2 ranks
        self.lin = nn.Linear(7, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(self.lin(x) * self.gain).sum(-1)[:, :3]


def _complex_adam(rank: int, world_size: int) -> None:
    """Adam steps a complex parameter through real views of its tensors; on a complex ``DTensor`` sharded unevenly
    DTensor's view_as_real is a replicated copy, which the update would go to (FSDP2's case). torch's AdamW (local
    steps) and fullshard's step local tensors."""
    import fullshard.optim

    batches = random_batches(3, world_size, regression_batch)
    for sharded_adamw in (torch.optim.AdamW, fullshard.optim.AdamW):
        torch.manual_seed(0)
        ref, model = Gain(), Gain()
        model.load_state_dict(ref.state_dict())
        fully_shard(model)
        ref_trace = train(ref, batches, mse_loss, rank=None, make_optim=lambda ps: torch.optim.AdamW(ps, lr=0.05))
        trace = train(model, batches, mse_loss, rank=rank, make_optim=lambda ps: sharded_adamw(ps, lr=0.05))
        assert_parity(ref_trace, trace, rank)
        assert model.gain.dtype == torch.complex64 and model.gain.to_local().shape == (5 - rank,)


def test_complex_parameter_sharded_unevenly_steps_with_adamw() -> None:
    run_ranks(2, _complex_adam)
