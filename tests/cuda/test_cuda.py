"""The accelerator path: side streams, events, pinned memory and NCCL on one GPU (skipped without CUDA).

Run on a machine with a GPU, plainly and under torch's stream-race detector:

    python3 -m pytest -q tests/cuda
    TORCH_CUDA_SANITIZER=1 python3 -m pytest -q tests/cuda

One process, world size 1 over NCCL: no collective goes on the wire, but every
copy-in, cast, reduction epilogue, offload copy and the events that order them
run on their streams exactly as at any world size.
"""

from __future__ import annotations

import functools
import gc
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._pytree import tree_map_only

from fullshard import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard, no_sync
from tests.models import MLP, Transformer, lm_loss, mse_loss
from tests.parity import assert_parity, random_batches, regression_batch, token_batch, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16 = torch.bfloat16
FP32_TOL = {"rtol": 1e-4, "atol": 1e-5}  # cuBLAS may pick other kernels for the differently aligned views
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(scope="module", autouse=True)
def nccl_group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("rendezvous") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def on_cuda(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(model, tree_map_only(torch.Tensor, lambda t: t.cuda(), batch))

    return loss


def cuda_parity(
    build: Callable[[], nn.Module], shard: Callable[[nn.Module], None], make_batch: Any, loss_fn: Any,
    steps: int = 4, **tol: float,
) -> nn.Module:
    torch.manual_seed(0)
    ref = build().cuda()
    torch.manual_seed(0)
    model = build()  # on CPU: fully_shard moves each shard to the GPU
    shard(model)
    batches = random_batches(steps, 1, make_batch)
    ref_trace = train(ref, batches, on_cuda(loss_fn), rank=None)
    trace = train(model, batches, on_cuda(loss_fn), rank=0)
    assert_parity(ref_trace, trace, 0, **tol)
    torch.cuda.synchronize()
    return model


def shard_blocks(model: nn.Module, **kwargs: Any) -> None:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def test_fp32_parity() -> None:
    model = cuda_parity(Transformer, shard_blocks, token_batch, lm_loss, **FP32_TOL)
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_bf16_mixed_precision_parity() -> None:
    from tests.test_mixed_precision import reference_casts, shard_with

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    cuda_parity(Transformer, functools.partial(shard_with, policy, "blocks"), token_batch,
                reference_casts(lm_loss, BF16, torch.float32), **BF16_TOL)


def test_checkpoint_around_the_root_with_cpu_inputs() -> None:
    """The root moves CPU inputs to the GPU in its forward, and again when a checkpoint around it recomputes
    from the saved CPU inputs."""
    from torch.utils.checkpoint import checkpoint

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = checkpoint(model, x, use_reentrant=False) if isinstance(model, FSDPModule) else model(x.cuda())
        return nn.functional.mse_loss(out, y.cuda())

    def shard(model: nn.Module) -> None:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)

    cuda_parity(MLP, shard, regression_batch, loss, **FP32_TOL)


@pytest.mark.parametrize("mode", ["synced", "no_sync"])
def test_cpu_offload_with_accumulation_parity(mode: str) -> None:
    from tests.test_grad_accumulation import two_micro_batches

    model = cuda_parity(Transformer, functools.partial(shard_blocks, offload_policy=CPUOffloadPolicy(pin_memory=True)),
                        token_batch, functools.partial(two_micro_batches, mode, 1), **FP32_TOL)
    for p in model.parameters():
        assert p.to_local().device.type == "cpu" and p.to_local().is_pinned()


@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_saved_copied_and_staged(offload: bool, tmp_path: Any) -> None:
    """State dict values reach the flat shard buffers (GPU, or pinned host memory) through storages of their own
    ([Note: Own-storage views]): torch.save, copy.deepcopy and DCP's async_save take them, pinned stays pinned."""
    import copy
    import io

    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = Transformer()
    shard_blocks(model, **({"offload_policy": CPUOffloadPolicy(pin_memory=True)} if offload else {}))
    lm_loss(model, token_batch(torch.Generator().manual_seed(0)).cuda()).backward()
    state = model.state_dict()
    for name, p in model.named_parameters():
        local = state[name].to_local()
        assert local.storage_offset() == 0 and local.data_ptr() == p.to_local().data_ptr(), name
        assert local.is_pinned() == offload, name
    torch.save(state, io.BytesIO())
    copied = copy.deepcopy(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "dcp", process_group=dist.new_group(backend="gloo")).result()
    loaded = {k: v.clone() for k, v in state.items()}  # DCP loads in place
    dcp.load(loaded, checkpoint_id=tmp_path / "dcp")
    for name, value in state.items():
        torch.testing.assert_close(copied[name].full_tensor(), value.full_tensor(), rtol=0, atol=0)
        torch.testing.assert_close(loaded[name].full_tensor(), value.full_tensor(), rtol=0, atol=0)


def test_no_sync_context_with_offload() -> None:
    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(model, FSDPModule):
            with no_sync(model):
                lm_loss(model, tokens[:2]).backward()
        else:
            lm_loss(model, tokens[:2]).backward()
        return lm_loss(model, tokens[2:])

    cuda_parity(Transformer, functools.partial(shard_blocks, offload_policy=CPUOffloadPolicy()), token_batch, loss,
                **FP32_TOL)


def test_reshard_after_forward_int_and_hsdp_mesh() -> None:
    cuda_parity(Transformer, functools.partial(shard_blocks, reshard_after_forward=1), token_batch, lm_loss, **FP32_TOL)
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    cuda_parity(Transformer, functools.partial(shard_blocks, mesh=mesh), token_batch, lm_loss, **FP32_TOL)


def test_post_optim_event_and_all_reduce_hook_stream() -> None:
    torch.manual_seed(0)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    hook_stream = torch.cuda.Stream()
    seen: list[torch.cuda.Stream] = []
    model.layers[1].set_all_reduce_hook(lambda t: (seen.append(torch.cuda.current_stream()), t.mul_(1.0)), stream=hook_stream)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in random_batches(3, 1, regression_batch):
        on_cuda(mse_loss)(model, batch[0]).backward()
        opt.step()
        opt.zero_grad()
        model.set_post_optim_event(torch.cuda.current_stream().record_event())
    assert seen and all(s == hook_stream for s in seen)


# ---- overlap and memory -------------------------------------------------------------------------------


class Wide(nn.Module):
    def __init__(self, dim: int = 2048, n_blocks: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.skipif(bool(os.environ.get("TORCH_CUDA_SANITIZER")),
                    reason="the stream checker slows every host-side op so far that the GPU waits for the host")
def test_next_all_gather_overlaps_compute(tmp_path: Any) -> None:
    """bf16: each group's copy-in (the cast into the all-gather input) runs on the all-gather stream while the
    previous group's matmuls run on the compute stream."""
    model = Wide(dim=4096)  # matmuls long enough (about 1 ms) that the host runs ahead of the GPU
    shard_blocks(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    x = torch.randn(16384, 4096, device="cuda")
    for _ in range(2):  # record the order, warm up
        model(x).float().sum().backward()
    torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):  # overlap needs the host ahead of the GPU: one iteration where it was not misses it
            model(x).float().sum().backward()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    gemm_names = ("gemm", "matmul", "nvjet", "cutlass", "xmma")  # cuBLAS names its Hopper kernels nvjet_*
    gemms = [e for e in kernels if any(n in e["name"].lower() for n in gemm_names)]
    assert gemms, "no matmul kernels in the trace"
    compute_stream = max({e["args"]["stream"] for e in gemms}, key=lambda s: sum(e["args"]["stream"] == s for e in gemms))
    side = [e for e in kernels if e["args"]["stream"] != compute_stream]
    assert side, "nothing ran on a communication stream"

    def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    overlapped = [k for k in side if any(overlaps(k, g) for g in gemms if g["args"]["stream"] == compute_stream)]
    assert overlapped, f"no side-stream kernel overlaps a matmul: {[k['name'] for k in side][:10]}"


def _peak_bytes(shard: Callable[[nn.Module], None]) -> int:
    """Peak bytes above what was allocated before (earlier tests' models die with the next garbage collection).
    A plain model's step first makes cuBLAS's workspaces (one per thread and stream), whichever test runs first."""
    warm = Wide(dim=1024, n_blocks=1).cuda()
    warm(torch.randn(8, 1024, device="cuda")).sum().backward()
    del warm
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = Wide(dim=1024, n_blocks=8)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2048, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt
    torch.cuda.empty_cache()
    return peak


def test_peak_memory_against_fsdp2() -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def shard_torch(model: nn.Module) -> None:
        model.cuda()
        for block in model.blocks:
            torch_fully_shard(block)
        torch_fully_shard(model)

    ours = _peak_bytes(shard_blocks)
    theirs = _peak_bytes(shard_torch)
    print(f"peak memory: fullshard {ours / 2**20:.1f} MiB, FSDP2 {theirs / 2**20:.1f} MiB ({ours / theirs:.3f}x)")
    assert ours <= 1.05 * theirs, (ours, theirs)


def test_tensor_subclass_hooks_and_quantized_comm_with_offload() -> None:
    """The packed all-gather on the side stream: a subclass's hooks, int8 blocks from pinned host shards."""
    from fullshard import QuantizedCommPolicy
    from tests.test_extensions import RowInt8Weight, qmlp

    def with_subclass(model: nn.Module) -> None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight = nn.Parameter(RowInt8Weight(layer.weight.detach().clone()))
                fully_shard(layer)
        fully_shard(model)

    model = cuda_parity(qmlp, with_subclass, regression_batch, mse_loss, **FP32_TOL)
    assert model[0].weight.device.type == "cuda"
    policy = QuantizedCommPolicy(block_size=16)
    model = cuda_parity(Transformer, functools.partial(shard_blocks, comm_policy=policy, offload_policy=CPUOffloadPolicy()),
                        token_batch, lm_loss, rtol=2e-2, atol=2e-2)
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())


def test_tensor_parallel_on_one_gpu() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "tp"))

    def shard(model: nn.Module) -> None:
        model.cuda()
        parallelize_module(model, mesh["tp"], {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])

    model = cuda_parity(MLP, shard, regression_batch, mse_loss, **FP32_TOL)
    assert model.layers[0].weight.device_mesh.mesh_dim_names == ("dp", "tp")


@pytest.mark.parametrize("config", ["adamw", "adam_tensor_lr", "adamw_fused", "sgd_foreach_momentum"])
def test_local_optimizer_step_gives_the_dtensor_path_bits(config: str) -> None:
    """On CUDA torch's default for AdamW is its foreach kernels (a Tensor lr: the loop); the local step picks the same."""
    from tests.test_local_step import CONFIGS, _assert_same_bits, _groups, _steps, dtensor_path

    cls, kwargs = CONFIGS[config]
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = Transformer()
        shard_blocks(model)
        models.append(model)
        opts.append(cls(_groups(model), **kwargs))
    batches = random_batches(3, 1, token_batch)
    assert _steps(models[0], opts[0], batches, 0, on_cuda(lm_loss)) == 0
    with dtensor_path():
        assert _steps(models[1], opts[1], batches, 0, on_cuda(lm_loss)) > 0
    _assert_same_bits(models[0], opts[0], models[1], opts[1], config)


@pytest.mark.parametrize("offload", [False, True])
def test_replicated_scalars_on_streams(offload: bool) -> None:
    """0-dim parameters ([Note: Replicated scalars]) in the flat buffers on the GPU and in pinned host memory, with
    bf16 copy-in: one element per rank, the unsharded parameter a view of rank 0's (at world size 1 no broadcast
    or all-reduce is needed, so none is issued)."""
    from tests.test_scalar_params import Tempered

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=True) if offload else None

    def shard(model: nn.Module) -> None:
        kwargs: dict[str, Any] = {"mp_policy": policy}
        if offload_policy is not None:
            kwargs["offload_policy"] = offload_policy
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:  # against the fp32 model, to bf16 tolerance
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)  # CUDA's mse_loss backward wants one dtype

    model = cuda_parity(Tempered, shard, regression_batch, loss, **BF16_TOL)
    for name, p in model.named_parameters():
        if p.dim() == 0:
            assert p.to_local().device.type == ("cpu" if offload else "cuda"), name


@pytest.mark.parametrize("offload", [False, True])
def test_parameters_on_another_mesh(offload: bool) -> None:
    """Every call's 1-D parameters on a (replicate, shard) mesh of their own through a ``ShardPlacementResult``, so
    each call forms two groups whose all-gathers, reduce-scatters and bf16 copy-ins share the streams; with and
    without pinned-memory offload."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    from tests.test_mixed_precision import reference_casts, shard_with

    other = HSDPMeshInfo(init_device_mesh("cuda", (1, 1), mesh_dim_names=("r", "s")), shard_mesh_dim=1,
                         replicate_mesh_dim=0)
    kwargs: dict[str, Any] = {
        "shard_placement_fn": lambda p: ShardPlacementResult(Shard(0), other) if p.dim() == 1 else None,
    }
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    model = cuda_parity(Transformer, functools.partial(shard_with, policy, "blocks", **kwargs), token_batch,
                        reference_casts(lm_loss, BF16, torch.float32), **BF16_TOL)
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    assert ("r", "s") in meshes and len(meshes) == 2
