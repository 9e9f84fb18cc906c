"""``fully_shard(..., dp_mesh_dims=...)`` on a whole SPMD mesh: parameters are DTensors on it, Replicate on the axes
``dp_mesh_dims`` names, and the forward computes on DTensors.

Every case runs beside torch's own ``fully_shard`` on a copy of the model: the sharded parameters must have its
meshes, placements and local shapes, and training must give its values. A single MLP (the model of torch's own test
of this mode) is also compared with the unsharded model trained on the data-parallel ranks' batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import fullshard
from fullshard import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from fullshard.runtime import state_of
from tests.comm import CommRecorder
from tests.harness import run_ranks

DIM = 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 3 * DIM)  # 24 rows: TP pieces of 12, FSDP chunks of 6 or 12
        self.out_proj = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def tp_partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Column-parallel in_proj, row-parallel out_proj on the last mesh axis; Replicate on the others."""
    if not isinstance(module, nn.Linear):
        return
    replicate = [Replicate()] * (mesh.ndim - 1)
    for param_name, param in list(module.named_parameters(recurse=False)):
        last = Replicate() if param_name == "bias" else Shard(0) if name.endswith("in_proj") else Shard(1)
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [*replicate, last])))


def off_the_tp_dim(param: nn.Parameter) -> Shard:
    tp_on_0 = any(isinstance(p, Shard) and p.dim == 0 for p in param.placements)  # type: ignore[attr-defined]
    return Shard(1 if tp_on_0 else 0)


# name: (mesh sizes at 4 ranks, axis names, dp_mesh_dims, tensor parallel on the last axis, reshard_after_forward).
# Axis names are not reused: the mesh of a DTensor made on a mesh unflattened again under the same names is the
# earlier, equal mesh object, and fully_shard (as torch's) wants the very mesh it is given.
CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], DataParallelMeshDims, bool, bool]] = {
    "fsdp": ((4,), ("f0",), DataParallelMeshDims(shard="f0"), False, True),
    "fsdp-keep": ((4,), ("f1",), DataParallelMeshDims(shard="f1"), False, False),
    "ddp": ((4,), ("d0",), DataParallelMeshDims(replicate="d0"), False, True),
    "hsdp": ((2, 2), ("r0", "s0"), DataParallelMeshDims(shard="s0", replicate="r0"), False, True),
    "two-shard-axes": ((2, 2), ("s1", "s2"), DataParallelMeshDims(shard=("s1", "s2")), False, True),
    "fsdp+tp": ((2, 2), ("f2", "t0"), DataParallelMeshDims(shard="f2"), True, True),
    "fsdp+tp-keep": ((2, 2), ("f3", "t1"), DataParallelMeshDims(shard="f3"), True, False),
    "hsdp+tp": ((1, 2, 2), ("r1", "f4", "t2"), DataParallelMeshDims(shard="f4", replicate="r1"), True, True),
    "two-replicate-axes": ((1, 2, 2), ("r2", "r3", "f5"), DataParallelMeshDims(shard="f5", replicate=("r2", "r3")),
                           False, True),
}


def dp_rank_and_size(mesh: DeviceMesh, dims: DataParallelMeshDims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks (the TP ranks of one index share a batch), and their count."""
    index, size = 0, 1
    for name in (*dims.replicate_names, *dims.shard_names):
        index, size = index * mesh[name].size() + mesh[name].get_local_rank(), size * mesh[name].size()
    return index, size


def build(shard: Any, mesh: DeviceMesh, dims: DataParallelMeshDims, tp: bool, nested: bool, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(MLP(), MLP()) if nested else MLP()
    distribute_module(model, mesh, tp_partition if tp else None)
    kwargs.update(mesh=mesh, dp_mesh_dims=dims, shard_placement_fn=off_the_tp_dim if tp else None)
    if nested:
        for block in model:
            shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def layout(model: nn.Module) -> list[tuple[str, tuple[str, ...] | None, str, tuple[int, ...]]]:
    return [(n, p.device_mesh.mesh_dim_names, str(p.placements), tuple(p.to_local().shape))
            for n, p in model.named_parameters()]


def step(model: nn.Module, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The summed output of this rank's batch, passed in as a DTensor Replicate on every axis."""
    for block in model if isinstance(model, nn.Sequential) else [model]:
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False) if not isinstance(x, DTensor) else x
        x = block(x).redistribute(placements=[Replicate()] * mesh.ndim)  # the row-parallel output is a Partial sum
    loss = x.sum()
    loss.backward()
    return loss.full_tensor()


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in model.named_parameters()}


def _cases(rank: int, world_size: int) -> None:
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    for label, (sizes, names, dims, tp, reshard) in CASES.items():
        mesh = world._unflatten(0, sizes, names)
        model = build(fully_shard, mesh, dims, tp, nested=False, reshard_after_forward=reshard)
        theirs = build(torch_fully_shard, mesh, dims, tp, nested=False, reshard_after_forward=reshard)
        assert layout(model) == layout(theirs), label
        torch.manual_seed(0)
        ref = MLP()
        dp_rank, dp_size = dp_rank_and_size(mesh, dims)
        optims = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False) for m in (model, theirs, ref)]
        gen = torch.Generator().manual_seed(1)
        for i in range(4):
            xs = [torch.randn(2, DIM, generator=gen) for _ in range(dp_size)]
            rec = CommRecorder(model) if i == 0 else None
            loss = step(model, xs[dp_rank], mesh)
            if rec is not None:
                rec.close()
                sharded = label != "ddp"
                assert (rec.count("ag") > 0, rec.count("rs") > 0) == (sharded, sharded), (label, rec.events)
            # (torch's replicate-only reduction divides in another order: equal within rounding, not bitwise)
            torch.testing.assert_close(loss, step(theirs, xs[dp_rank], mesh), rtol=2e-6, atol=1e-7)
            ref_loss = sum(ref(x).sum() for x in xs) / dp_size
            (ref_loss / 2).backward()
            torch.testing.assert_close(loss, ref(xs[dp_rank]).sum().detach(), msg=lambda m: f"{label}: {m}")
            for opt in optims:
                opt.step()
                opt.zero_grad(set_to_none=i % 2 == 0)
        ours, torch_values, expected = full_values(model), full_values(theirs), full_values(ref)
        for name, value in ours.items():
            torch.testing.assert_close(value, torch_values[name], rtol=2e-6, atol=1e-7, msg=lambda m: f"{label} {name}: {m}")
            torch.testing.assert_close(value, expected[name], msg=lambda m: f"{label} {name}: {m}")
        dist.barrier()


def test_cases_match_torch_and_the_unsharded_model() -> None:
    run_ranks(4, _cases)


def _combinations(rank: int, world_size: int, tmp: str) -> None:
    """Two groups of two TP MLPs under the root, with mixed precision, offload, accumulation, clipping."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    dims = DataParallelMeshDims(shard="fsdp")
    variants: dict[str, dict[str, Any]] = {
        "plain": {},
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "offload": {"offload_policy": fullshard.CPUOffloadPolicy(pin_memory=False)},
        "accumulate": {},
    }
    dp_rank, dp_size = dp_rank_and_size(mesh, dims)
    for label, kwargs in variants.items():
        models = [build(shard, mesh, dims, True, nested=True, **kwargs) for shard in (fully_shard, torch_fully_shard)]
        optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        gen = torch.Generator().manual_seed(2)
        micro = 2 if label == "accumulate" else 1
        for _ in range(3):
            for i in range(micro):
                x = [torch.randn(2, DIM, generator=gen) for _ in range(dp_size)][dp_rank]
                losses = []
                for model in models:
                    model.set_requires_gradient_sync(i == micro - 1)
                    losses.append(step(model, x, mesh))
                assert torch.equal(*losses), label
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).full_tensor() for m in models]
            assert torch.equal(*norms), label
            for opt in optims:
                opt.step()
                opt.zero_grad()
        ours, theirs = full_values(models[0]), full_values(models[1])
        assert all(torch.equal(v, theirs[n]) for n, v in ours.items()), label
        full = get_model_state_dict(models[0], options=StateDictOptions(full_state_dict=True))
        assert all(torch.equal(full[n], v) for n, v in ours.items()), label
    # a DCP round trip of the last variant's sharded state
    model = models[0]
    path = str(Path(tmp) / "spmd")
    dcp.save(model.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    assert all(torch.equal(v, ours[n]) for n, v in full_values(model).items())


def test_combinations_match_torch(tmp_path: Path) -> None:
    run_ranks(4, _combinations, str(tmp_path))


def _reshard_to_smaller_groups(rank: int, world_size: int, spmd: bool) -> None:
    """reshard_after_forward=2 on the data-parallel axis of a (4, 2) (dp, tp) mesh, whose rows each rank sees only
    its own of: the whole SPMD mesh with dp_mesh_dims (torch's fully_shard raises NotImplementedError there), or
    mesh["dp"] with tensor-parallel parameters on mesh["tp"]."""
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    if spmd:
        dims = DataParallelMeshDims(shard="dp")
        with pytest.raises(NotImplementedError, match="reshard_after_forward as int"):
            build(torch_fully_shard, mesh, dims, True, nested=True, reshard_after_forward=2)
        model = build(fully_shard, mesh, dims, True, nested=True, reshard_after_forward=2)
    else:
        torch.manual_seed(0)
        model = nn.Sequential(MLP(), MLP())
        for block in model:
            parallelize_module(block, mesh["tp"], {"in_proj": ColwiseParallel(output_layouts=Replicate())})
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=2)
        fully_shard(model, mesh=mesh["dp"])
    groups = [state_of(block).group.post_forward.group for block in model]
    assert all(dist.get_process_group_ranks(g) == [rank // 4 * 4 + rank % 2 + 2 * i for i in range(2)] for g in groups)
    torch.manual_seed(0)
    ref = nn.Sequential(MLP(), MLP())
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    gen = torch.Generator().manual_seed(3)
    dp_rank = mesh["dp"].get_local_rank()
    for _ in range(3):
        xs = [torch.randn(2, DIM, generator=gen) for _ in range(4)]
        if spmd:
            loss = step(model, xs[dp_rank], mesh)
        else:
            loss = model(xs[dp_rank]).sum()
            loss.backward()
        torch.testing.assert_close(loss, ref(xs[dp_rank]).sum().detach())
        (sum(ref(x).sum() for x in xs) / 4).backward()
        for opt in optims:
            opt.step()
            opt.zero_grad()
    expected = full_values(ref)
    for name, value in full_values(model).items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("spmd", [True, False], ids=["spmd-mesh", "dp-submesh"])
def test_reshard_after_forward_int_beside_tp(spmd: bool) -> None:
    run_ranks(8, _reshard_to_smaller_groups, spmd)


def _bad_input(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    other = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    dims = DataParallelMeshDims(shard="fsdp")

    def on(target: DeviceMesh, placements: list[Any]) -> nn.Module:
        module = nn.Linear(4, 8)
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), target, placements))
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [Replicate()]))
        return module

    cases: list[tuple[Any, str, Any]] = [
        (lambda: nn.Linear(4, 8), "must be DTensors on the full SPMD mesh", dims),
        (lambda: on(mesh, [Shard(0)]), r"Expected Replicate\(\) on DP shard dim 'fsdp'", dims),
        (lambda: on(other, [Replicate()]), "same mesh", dims),
        (lambda: on(mesh, [Replicate()]), "not found in mesh.mesh_dim_names", DataParallelMeshDims(shard="tp")),
    ]
    for make, message, case_dims in cases:
        with pytest.raises(ValueError, match=message):  # the same error type as torch's
            torch_fully_shard(make(), mesh=mesh, dp_mesh_dims=case_dims)
        module = make()
        before = dict(module.named_parameters())
        with pytest.raises(ValueError, match=message):
            fully_shard(module, mesh=mesh, dp_mesh_dims=case_dims)
        assert dict(module.named_parameters()) == before and not isinstance(module, fullshard.FSDPModule)
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    distribute_module(tied, mesh)
    tied[1].weight = tied[0].weight
    fully_shard(tied[0], mesh=mesh, dp_mesh_dims=dims)
    with pytest.raises(ValueError, match="is a DTensor .* a tie across fully_shard groups is supported for plain"):
        fully_shard(tied, mesh=mesh, dp_mesh_dims=dims)  # (FSDP2 raises a ValueError at the first forward)
    with pytest.raises(ValueError, match="names a mesh axis twice") as twice:
        fully_shard(on(mesh, [Replicate()]), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp", replicate="fsdp"))
    assert isinstance(twice.value, RuntimeError)  # FSDP2's type (overlapping meshes)
    with pytest.raises(AttributeError, match="dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims") as kind:
        fully_shard(on(mesh, [Replicate()]), mesh=mesh, dp_mesh_dims={"shard": "fsdp"})
    assert isinstance(kind.value, TypeError)


def test_bad_input() -> None:
    run_ranks(2, _bad_input)


def _batch_sharded_input(rank: int, world_size: int) -> None:
    """The batch as a DTensor sharded over the data-parallel axes: most gradients come out as Partial sums there,
    which the reduce-scatter takes as they are (an all-reduce first would count them dp times). Compared with
    torch's fully_shard, gradients included: where DTensor's backward already reduced a gradient (a Replicate one),
    both average it again, which no unsharded model reproduces."""
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    for label in ("fsdp", "hsdp", "fsdp+tp"):
        sizes, names, dims, tp, reshard = CASES[label]
        mesh = world._unflatten(0, sizes, tuple(f"b{n}" for n in names))
        dims = DataParallelMeshDims(shard=tuple(f"b{n}" for n in dims.shard_names) or None,
                                    replicate=tuple(f"b{n}" for n in dims.replicate_names) or None)
        models = [build(shard, mesh, dims, tp, nested=False) for shard in (fully_shard, torch_fully_shard)]
        dp_rank, dp_size = dp_rank_and_size(mesh, dims)
        # (SGD: Adam's step would hide gradients scaled by a constant, the fault this test is after)
        optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        placements = [Shard(0) if n in (*dims.shard_names, *dims.replicate_names) else Replicate()
                      for n in mesh.mesh_dim_names or ()]
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            x = [torch.randn(2, DIM, generator=gen) for _ in range(dp_size)][dp_rank]
            losses = []
            for model in models:
                loss = model(DTensor.from_local(x, mesh, placements, run_check=False)).sum()
                loss.backward()
                losses.append(loss.full_tensor())
            assert torch.equal(*losses), label
            for (name, ours), theirs in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
                assert torch.equal(ours.grad.full_tensor(), theirs.grad.full_tensor()), (label, name)
            for opt in optims:
                opt.step()
                opt.zero_grad()


def test_batch_sharded_input() -> None:
    run_ranks(4, _batch_sharded_input)


# ---- experts on a mesh of their own (torchtitan's mixture of experts under full DTensor) --------------------------


class Experts(nn.Module):
    """Expert weights on the "sparse" mesh (Replicate on its data-parallel axis, Shard(0) on "ep"): each rank applies
    its own experts to the dense activations (standing in for routing and the all-to-alls)."""

    def __init__(self, sparse: DeviceMesh) -> None:
        super().__init__()
        self.w = nn.Parameter(distribute_tensor(torch.randn(4, DIM, DIM) / 3, sparse, [Replicate(), Shard(0)]))

    def forward(self, x: DTensor) -> DTensor:
        local = x.to_local()
        out = sum((local @ expert for expert in self.w.to_local()), torch.zeros_like(local))
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


class MoEBlock(nn.Module):
    def __init__(self, dense: DeviceMesh, sparse: DeviceMesh) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        distribute_module(self.proj, dense)
        self.experts = Experts(sparse)

    def forward(self, x: DTensor) -> DTensor:
        return self.experts(torch.relu(self.proj(x)))


def _experts_on_their_own_spmd_mesh(rank: int, world_size: int) -> None:
    """One fully_shard call per block with dp_mesh_dims, its shard_placement_fn returning ShardPlacementResults with
    FSDP2's mesh infos of the dense and the sparse SPMD mesh (torchtitan's expert-parallel path under full DTensor):
    the same layouts, losses, gradients and values as torch's fully_shard."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (world_size,), ("g0",))
    sparse = world._unflatten(0, (2, world_size // 2), ("e0", "ep0"))
    dense_dims, sparse_dims = DataParallelMeshDims(shard="g0"), DataParallelMeshDims(shard="e0")
    dense_info, sparse_info = _get_mesh_info(dense, dense_dims), _get_mesh_info(sparse, sparse_dims)

    def build(shard: Any) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(MoEBlock(dense, sparse), MoEBlock(dense, sparse))
        for block in model:
            experts = set(block.experts.parameters())
            shard(block, mesh=dense, dp_mesh_dims=dense_dims, shard_placement_fn=lambda p, e=experts: ShardPlacementResult(
                placement=Shard(0), mesh_info=sparse_info if p in e else dense_info))
        shard(model, mesh=dense, dp_mesh_dims=dense_dims)
        return model

    models = [build(fully_shard), build(torch_fully_shard)]
    assert layout(models[0]) == layout(models[1])
    assert [len(state_of(block).groups) for block in models[0]] == [2, 2]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = [torch.randn(2, DIM, generator=gen) for _ in range(world_size)][rank]
        losses = [step(m, x, dense) for m in models]
        assert torch.equal(*losses)
        for (name, ours), theirs in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
            assert torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name
        for opt in optims:
            opt.step()
            opt.zero_grad()
    ours, theirs = full_values(models[0]), full_values(models[1])
    assert all(torch.equal(v, theirs[n]) for n, v in ours.items())


def test_experts_on_their_own_spmd_mesh_match_torch() -> None:
    run_ranks(4, _experts_on_their_own_spmd_mesh)
