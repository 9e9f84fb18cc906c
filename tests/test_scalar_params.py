"""0-dim parameters (a CLIP temperature, a gate), which torch's FSDP2 refuses: replicated on every rank
([Note: Replicated scalars] in layout.py), trained as the unsharded model trains them, with every copy equal."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import fullshard
from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests.harness import run_ranks
from tests.models import mse_loss
from tests.parity import full_params, random_batches, regression_batch, run_parity, train


class GatedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.tensor(0.6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(self.lin(x))


class Tempered(nn.Module):
    """Two gated blocks and a root temperature; widths 7 -> 5 -> 3 (uneven on 2 and 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.blocks = nn.ModuleList(GatedBlock(5) for _ in range(2))
        self.out = nn.Linear(5, 3)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temperature


def shard_tempered(kind: str, model: nn.Module) -> None:
    kwargs: dict[str, Any] = {}
    world_size = dist.get_world_size()
    if kind == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    elif kind == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif kind == "reshard_int":
        kwargs["reshard_after_forward"] = 2
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def assert_replicated_alike(model: nn.Module) -> None:
    """Every 0-dim parameter is a Replicate DTensor whose value (and gradient) is the same on every rank."""
    scalars = {n: p for n, p in model.named_parameters() if p.dim() == 0}
    assert scalars.keys() == {"blocks.0.gate", "blocks.1.gate", "temperature"}
    for name, p in scalars.items():
        assert isinstance(p, DTensor) and all(pl == Replicate() for pl in p.placements), (name, p)
        assert p.to_local().shape == ()
    mine = [(p.to_local().item(), None if p.grad is None else p.grad.to_local().item()) for p in scalars.values()]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert all(values == every[0] for values in every), every


def _reference_and_sharded(make_optim: Any) -> tuple[nn.Module, nn.Module, list[torch.optim.Optimizer]]:
    """The unsharded model and a sharded copy (plain), each with its optimizer."""
    torch.manual_seed(0)
    ref, model = Tempered(), Tempered()
    model.load_state_dict(ref.state_dict())
    shard_tempered("plain", model)
    return ref, model, [make_optim(m.parameters()) for m in (ref, model)]


def assert_trained_alike(ref: nn.Module, model: nn.Module) -> None:
    for name, value in full_params(model).items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[name].detach(), msg=lambda m: f"{name}: {m}")
    assert_replicated_alike(model)


def _train_scalars(rank: int, world_size: int, kind: str) -> None:
    _, model = run_parity(rank, world_size, Tempered, functools.partial(shard_tempered, kind), regression_batch,
                          mse_loss)
    assert_replicated_alike(model)


@pytest.mark.parametrize(("world_size", "kind"), [(2, "plain"), (4, "plain"), (4, "hsdp"), (2, "offload"),
                                                  (4, "reshard_int")])
def test_scalar_parameters_train(world_size: int, kind: str) -> None:
    run_ranks(world_size, _train_scalars, kind)


def _optimizers_and_clipping(rank: int, world_size: int, optim: str, clip: str) -> None:
    """torch's AdamW (local steps) or fullshard's, with torch's or fullshard's clip_grad_norm_: the norm counts
    each replicated gradient once, so it and every step equal the unsharded model's."""
    make = {"torch": torch.optim.AdamW, "fullshard": fullshard.optim.AdamW}[optim]
    ref, model, opts = _reference_and_sharded(functools.partial(make, lr=0.05))
    clip_fn = torch.nn.utils.clip_grad_norm_ if clip == "torch" else fullshard.clip_grad_norm_
    for step, batches in enumerate(random_batches(4, world_size, regression_batch)):
        (sum(mse_loss(ref, b) for b in batches) / world_size).backward()
        mse_loss(model, batches[rank]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = clip_fn(model.parameters() if clip == "torch" else model, 0.05)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {step} norm: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_trained_alike(ref, model)
    state = opts[1].state[model.temperature]
    for key in ("exp_avg", "exp_avg_sq"):  # shaped like the parameter: Replicate DTensors, as on DTensor steps
        assert isinstance(state[key], DTensor) and state[key].placements == (Replicate(),), (key, state[key])
    assert type(state["step"]) is torch.Tensor and float(state["step"]) == 4


@pytest.mark.parametrize(("optim", "clip"), [("torch", "torch"), ("fullshard", "fullshard")])
def test_scalar_parameters_with_adamw_and_clipping(optim: str, clip: str) -> None:
    run_ranks(4, _optimizers_and_clipping, optim, clip)


def _mixed_precision(rank: int, world_size: int) -> None:
    """bf16 compute: the unsharded 0-dim parameter is bf16 in forward, its gradient reduced in fp32 and the
    replicas stay equal; the result matches the fp32 model to bf16 tolerance."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    def cast(model: nn.Module, batch: Any) -> torch.Tensor:
        return mse_loss(model, batch).float()

    torch.manual_seed(0)
    model = Tempered()
    shard(model)
    seen = []  # the gate inside its block's forward (the lin layer runs in it)
    model.blocks[0].lin.register_forward_pre_hook(lambda module, args: seen.append(model.blocks[0].gate.dtype))
    model(torch.zeros(2, 7))
    assert seen == [torch.bfloat16] and model.blocks[0].gate.dtype == torch.float32
    run_parity(rank, world_size, Tempered, shard, regression_batch, cast, rtol=2e-2, atol=2e-2)


def test_scalar_parameters_with_mixed_precision() -> None:
    run_ranks(2, _mixed_precision)


def _accumulate(rank: int, world_size: int) -> None:
    """Two micro-batches per step, the first without gradient sync."""
    ref, model, opts = _reference_and_sharded(functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))
    batches = random_batches(6, world_size, regression_batch)
    for step in range(3):
        for micro in range(2):
            chunk = batches[2 * step + micro]
            (sum(mse_loss(ref, b) for b in chunk) / world_size).backward()
            model.set_requires_gradient_sync(micro == 1)
            mse_loss(model, chunk[rank]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_trained_alike(ref, model)


def test_scalar_parameters_with_accumulation() -> None:
    run_ranks(2, _accumulate)


def _save(rank: int, world_size: int, path: str) -> None:
    torch.manual_seed(0)
    model = Tempered()
    shard_tempered("plain", model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    train(model, random_batches(2, world_size, regression_batch), mse_loss, rank=rank, optim=opt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert type(full["temperature"]) is torch.Tensor and full["temperature"].shape == ()
    torch.testing.assert_close(full["temperature"], model.temperature.to_local())
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _resume(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # other values: the checkpoint must set them all
    model = Tempered()
    shard_tempered("plain", model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert_replicated_alike(model)
    train(model, random_batches(2, world_size, regression_batch, seed=7), mse_loss, rank=rank, optim=opt)
    params = full_params(model)
    # A full state dict from rank 0 sets every rank's copy, whatever the others held.
    if rank != 0:
        with torch.no_grad():
            model.temperature.to_local().fill_(-1.0)
    values = {"temperature": torch.tensor(2.0)} if rank == 0 else {}
    set_model_state_dict(model, values, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=False))
    assert model.temperature.to_local().item() == 2.0
    return params


def test_scalar_parameters_checkpoint_across_world_sizes() -> None:
    """Two AdamW steps at 2 ranks, a DCP checkpoint, two more at 4 ranks: as the unsharded model."""
    torch.manual_seed(0)
    ref = Tempered()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    train(ref, random_batches(2, 2, regression_batch), mse_loss, rank=None, optim=opt)
    train(ref, random_batches(2, 4, regression_batch, seed=7), mse_loss, rank=None, optim=opt)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_ranks(2, _save, path)
        results = run_ranks(4, _resume, path)
    for params in results:
        for name, value in params.items():
            torch.testing.assert_close(value, dict(ref.named_parameters())[name].detach(), msg=lambda m: f"{name}: {m}")


def _clip_model(rank: int, world_size: int) -> None:
    """Hugging Face's CLIPModel keeps its temperature as a 0-dim ``logit_scale``: shard every encoder layer and
    the root, train on the contrastive loss, as the unsharded model."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config={"vocab_size": 40, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_size": 16,
                     "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 9},
        vision_config={"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 8, "patch_size": 4, "num_channels": 3},
        projection_dim=12,
    )

    def build() -> nn.Module:
        return CLIPModel(config)

    def shard(model: nn.Module) -> None:
        for layer in [*model.text_model.encoder.layers, *model.vision_model.encoder.layers]:
            fully_shard(layer)
        fully_shard(model)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 40, (3, 9), generator=gen), torch.randn(3, 3, 8, 8, generator=gen)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=b[0], pixel_values=b[1], return_loss=True).loss

    _, model = run_parity(rank, world_size, build, shard, batch, loss, steps=3, rtol=1e-4, atol=1e-5)
    assert model.logit_scale.shape == () and model.logit_scale.placements == (Replicate(),)


def test_hugging_face_clip_trains() -> None:
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    run_ranks(2, _clip_model)


def _refused(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    module = nn.Module()
    module.w = nn.Parameter(distribute_tensor(torch.tensor(1.0), mesh["tp"], [Replicate()]))
    with pytest.raises(NotImplementedError, match="parameter 'w' is 0-dim and a DTensor; fully_shard replicates") as err:
        fully_shard(module, mesh=mesh["dp"])
    assert isinstance(err.value, ValueError)  # what FSDP2 raises for any 0-dim parameter


def test_zero_dim_tensor_parallel_parameter_is_refused() -> None:
    run_ranks(4, _refused)


def _copies_made_equal(rank: int, world_size: int) -> None:
    """Copies set differently per rank (an initialisation drawn per rank, as DTensor's random ops on CPU do after
    uneven shards; an edit written back on one rank only) take shard rank 0's, the one the forward uses, at the
    next all-gather, so state dicts and checkpoints agree with the forward."""
    with torch.device("meta"):
        model = Tempered()
    shard_tempered("plain", model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().copy_(torch.rand(p.to_local().shape) - 0.5) if p.dim() else p.to_local().fill_(rank + 1.0)
    with torch.no_grad():  # (an inference forward leaves every group sharded)
        out = model(torch.ones(2, 7))
    assert_replicated_alike(model)
    assert model.temperature.to_local().item() == 1.0
    with fullshard.summon_full_params(model, writeback=True), torch.no_grad():
        if rank == 1:
            model.temperature.fill_(5.0)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.ones(2, 7)), out)
    assert_replicated_alike(model)
    assert model.temperature.to_local().item() == 1.0, "rank 0's copy, as the forward saw it"


def test_replicated_copies_are_made_equal() -> None:
    run_ranks(2, _copies_made_equal)


class MyAdam(torch.optim.Adam):
    """A subclass: its step runs through DTensor's dispatch."""


def _optimizer_state_loads(rank: int, world_size: int) -> None:
    """torch's set_optimizer_state_dict (full, from rank 0 too) makes every 0-dim state tensor a plain one; the state
    of a 0-dim parameter comes back as Replicate DTensors (counters plain), so a step through DTensor works.
    fullshard's load_full_optim_state_dict keeps the counters plain."""
    for make in (torch.optim.Adam, MyAdam):
        for load in ("dcp_full", "dcp_broadcast", "fullshard"):
            ref, model, opts = _reference_and_sharded(functools.partial(make, lr=0.05))
            batches = random_batches(4, world_size, regression_batch)
            train(ref, batches, mse_loss, rank=None, optim=opts[0])
            train(model, batches[:2], mse_loss, rank=rank, optim=opts[1])
            if load == "fullshard":
                full = fullshard.full_optim_state_dict(model, opts[1], rank0_only=False)
                fresh = make(model.parameters(), lr=0.05)
                fullshard.load_full_optim_state_dict(model, fresh, full)
            else:
                options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=load == "dcp_broadcast")
                full = get_optimizer_state_dict(model, opts[1], options=options)
                fresh = make(model.parameters(), lr=0.05)
                set_optimizer_state_dict(model, fresh, full if rank == 0 or load == "dcp_full" else {}, options=options)
            for p in (model.temperature, model.blocks[0].gate):
                state = fresh.state[p]
                assert all(isinstance(state[k], DTensor) for k in ("exp_avg", "exp_avg_sq")), (make, load, state)
                assert type(state["step"]) is torch.Tensor, (make, load, state)
            train(model, batches[2:], mse_loss, rank=rank, optim=fresh)
            assert_trained_alike(ref, model)


def test_optimizer_state_of_scalars_loads() -> None:
    run_ranks(2, _optimizer_state_loads)


class DelayedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class AllReduceScatter:
    """A reduce-scatter as an in-place all-reduce of its input (this rank's row is the output): unlike gloo's
    reduce-scatter, its work reports completion as soon as it has completed."""

    inp: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.inp is None:  # the input (every rank's rows, flat), then the output
            self.inp = torch.empty(size, dtype=dtype, device=device)
            return self.inp
        inp, self.inp = self.inp, None
        return inp.view(dist.get_world_size(), -1)[dist.get_rank()]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        return dist.all_reduce(input_tensor, op=op, group=group, async_op=async_op)


class SlowBlock(GatedBlock):
    delay = 0.0  # seconds added to this block's backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(DelayedGrad.apply(self.lin(x), self.delay))


class SlowBackward(nn.Module):
    """Three gated blocks; ``between`` seconds added to the backward between two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SlowBlock(8) for _ in range(3))
        self.between = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = DelayedGrad.apply(x, self.between)
        return x


def _in_order(rank: int, world_size: int) -> None:
    """The all-reduce of replicated gradients goes out at the same point on every rank, also where a finished
    reduce-scatter is noticed early on one rank only (rank 1's backward is slower, its last block's most)."""
    torch.manual_seed(0)
    model = SlowBackward()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for block in model.blocks:
        block.set_custom_reduce_scatter(AllReduceScatter())
    if rank == 1:
        model.blocks[2].delay, model.between = 0.2, 0.05
    for _ in range(3):  # (a DivergenceError when the all-reduce went out early on rank 0)
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
    grads = [block.gate.grad.to_local().item() for block in model.blocks]
    every = [None] * world_size
    dist.all_gather_object(every, grads)
    assert every[0] == every[1], every


def test_replicated_gradients_go_out_in_order() -> None:
    run_ranks(2, _in_order)
