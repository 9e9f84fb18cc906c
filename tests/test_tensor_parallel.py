"""FSDP + tensor parallel: parameters that are DTensors on a ``tp`` axis, sharded by ``fully_shard`` on ``dp``.

The reference is the unsharded model trained on the data-parallel ranks' batches (every TP rank of one dp
group sees its dp group's batch). Widths are odd, so both the TP split and the FSDP split are uneven.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import checkpoint

import fullshard
from fullshard import MixedPrecisionPolicy, fully_shard
from tests.comm import CommRecorder
from tests.harness import run_ranks
from tests.models import mse_loss
from tests.parity import assert_parity, full_params, random_batches, regression_batch, token_batch, train

DIM = 5  # in_proj 5 -> 15 rows: TP pieces of 8 and 7 rows, FSDP chunks of 4/4 and 4/3


class Block(nn.Module):
    def __init__(self, dim: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(3 * dim, dim)
        self.checkpointed = checkpointed

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.relu(self.in_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False) if self.checkpointed else self._body(x)


class Net(nn.Module):
    """Two tensor-parallel blocks and a head that is not tensor parallel (data parallel only)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, checkpointed) for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tp_plan() -> dict[str, object]:
    plan: dict[str, object] = {}
    for i in range(2):
        plan[f"blocks.{i}.in_proj"] = ColwiseParallel(use_local_output=False)  # keeps the uneven width
        plan[f"blocks.{i}.out_proj"] = RowwiseParallel()
    return plan


def parallelize(model: nn.Module, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, **kwargs: object) -> nn.Module:
    parallelize_module(model, tp_mesh, tp_plan())  # type: ignore[arg-type]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, mesh=dp_mesh, **kwargs)  # type: ignore[arg-type]
    return model


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(gen, in_dim=DIM, out_dim=3, rows=6)


def _dp_tp(rank: int, world_size: int, reshard_after_forward: bool, checkpointed: bool) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = Net(checkpointed)
    model = parallelize(Net(checkpointed), mesh["dp"], mesh["tp"], reshard_after_forward=reshard_after_forward)
    model.load_state_dict(ref.state_dict())  # full tensors are accepted and cut for (dp, tp)
    batches = random_batches(4, 2, batch)
    ref_trace = train(ref, batches, mse_loss, rank=None)
    trace = train(model, batches, mse_loss, rank=dp_rank)
    assert_parity(ref_trace, trace, dp_rank, rtol=1e-5, atol=1e-6)

    strided = _StridedShard(0, split_factor=2)
    expected = {
        "in_proj.weight": (strided, Shard(0)), "in_proj.bias": (strided, Shard(0)),
        "out_proj.weight": (Shard(0), Shard(1)), "out_proj.bias": (Shard(0), Replicate()),
    }
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        if name.startswith("head."):
            assert p.placements == (Shard(0),) and p.device_mesh.mesh_dim_names == ("dp",), name
            continue
        assert p.device_mesh == mesh, name
        assert p.placements == expected[name.split(".", 2)[2]], (name, p.placements)
        ref_param = dict(ref.named_parameters())[name]
        assert p.shape == ref_param.shape and p.stride() == ref_param.stride(), name
        assert p.grad is None or p.grad.placements == p.placements, name


@pytest.mark.parametrize("reshard_after_forward,checkpointed", [(True, False), (False, True)])
def test_dp_tp_parity(reshard_after_forward: bool, checkpointed: bool) -> None:
    run_ranks(4, _dp_tp, reshard_after_forward, checkpointed)


def _collectives_and_clip(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = Net()
    model = parallelize(Net(), mesh["dp"], mesh["tp"], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    model.load_state_dict(ref.state_dict())
    batches = random_batches(1, 2, batch)[0]
    rec = CommRecorder(model)
    mse_loss(model, batches[dp_rank]).backward()
    # One all-gather per group in forward, the blocks' again in backward; one reduce-scatter per group,
    # each over the dp ranks only (the TP pieces never travel through fullshard).
    assert rec.count("ag") == 3 + 2 and rec.count("rs") == 3, rec.events
    (sum(mse_loss(ref, b) for b in batches) / 2).backward()
    for max_norm in (1e-3, float("inf")):
        norm = fullshard.clip_grad_norm_(model, max_norm=max_norm, norm_type=2.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
    inf_norm = fullshard.clip_grad_norm_(model, max_norm=1.0, norm_type="inf")
    torch.testing.assert_close(inf_norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type="inf"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(ref.named_parameters())[name].grad, rtol=1e-5, atol=1e-7)


def test_collectives_stay_on_dp_and_clip_over_mixed_placements() -> None:
    run_ranks(4, _collectives_and_clip)


def _save(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize(Net(), mesh["dp"], mesh["tp"])
    batches = random_batches(2, 2, batch)
    train(model, batches, mse_loss, rank=mesh["dp"].get_local_rank())
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = fullshard.full_state_dict(model)
    return {k: v.clone() for k, v in full.items()} if rank == 0 else {}


def _load(rank: int, world_size: int, path: str, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)  # other values: the load must replace them all
    model = parallelize(Net(), mesh["dp"], mesh["tp"])
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return full_params(model)


def _load_plain(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    """The same checkpoint into plain FSDP (no tensor parallel) over all ranks."""
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    return full_params(model)


def test_dcp_reload_at_other_dp_sizes_and_full_state_dict(tmp_path: Path) -> None:
    saved = run_ranks(4, _save, str(tmp_path))[0]
    assert saved and all(not isinstance(v, DTensor) for v in saved.values())
    for loaded in (run_ranks(2, _load, str(tmp_path), (1, 2))[1], run_ranks(2, _load_plain, str(tmp_path))[0]):
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def _hsdp_tp(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]
    dp_rank = dp_mesh.get_local_rank(0) * 2 + dp_mesh.get_local_rank(1)
    torch.manual_seed(0)
    ref = Net()
    model = parallelize(Net(), dp_mesh, mesh["tp"])
    model.load_state_dict(ref.state_dict())
    batches = random_batches(3, 4, batch)
    ref_trace = train(ref, batches, mse_loss, rank=None)
    trace = train(model, batches, mse_loss, rank=dp_rank)
    assert_parity(ref_trace, trace, dp_rank, rtol=1e-5, atol=1e-6)
    weight = model.blocks[0].in_proj.weight
    assert weight.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert weight.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0))


def test_hsdp_tp_parity_on_3d_mesh() -> None:
    run_ranks(8, _hsdp_tp, timeout=180)


def _meta_init_and_other_shard_dim(rank: int, world_size: int) -> None:
    """Built on the meta device, FSDP on the dim TP does not shard (the 4 columns of a 15 x 4 weight whose rows
    TP splits 8 / 7), materialized with to_empty + reset_parameters; gradients equal the unsharded model's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 15), nn.ReLU(), nn.Linear(15, 4))

    def columns_if_tp_rows(param: nn.Parameter) -> Shard:
        tp_dims = [pl.dim for pl in param.placements if isinstance(pl, Shard)] if isinstance(param, DTensor) else []
        return Shard(1) if param.ndim == 2 and tp_dims == [0] else Shard(0)

    with torch.device("meta"):
        model = build()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=columns_if_tp_rows)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()  # through DTensor's random ops
    weight = model[0].weight
    assert weight.placements == (Shard(1), Shard(0)) and weight.to_local().shape == (8 - rank % 2, 2)
    # On CPU meshes DTensor's random ops are not coordinated across ranks (replicas would differ): load values.
    torch.manual_seed(0)
    plain = build()
    model.load_state_dict(plain.state_dict())
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    F_loss = nn.MSELoss()
    F_loss(model(xs[mesh["dp"].get_local_rank()]), torch.zeros(3, 4)).backward()
    F_loss(plain(torch.cat(xs)), torch.zeros(6, 4)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(plain.named_parameters())[name].grad, msg=lambda m: f"{name}: {m}")


def test_meta_init_and_fsdp_on_another_dim_than_tp() -> None:
    run_ranks(4, _meta_init_and_other_shard_dim)


def _bad_tp(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="already a DTensor on the mesh fully_shard shards over") as err:
        fully_shard(lin, mesh=mesh)
    assert isinstance(err.value, RuntimeError)  # FSDP2's type ("Cannot concatenate overlapping meshes")
    assert not isinstance(lin, fullshard.FSDPModule)
    unnamed = nn.Linear(4, 4)  # a tensor-parallel parameter beside a data-parallel mesh without axis names
    unnamed.weight = nn.Parameter(distribute_tensor(unnamed.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="to be distinct named axes of one mesh") as named:
        fully_shard(unnamed, mesh=init_device_mesh("cpu", (2,)))
    assert isinstance(named.value, TypeError)  # FSDP2's type
    return str(err.value)


def test_dtensor_on_the_dp_mesh_is_refused() -> None:
    assert "'weight'" in run_ranks(2, _bad_tp)[0]


def _same_batch_on_tp_ranks(rank: int, world_size: int) -> None:
    """Gradients of one dp group agree across its TP ranks only when they see one batch; check the recorder."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(Net(), mesh["dp"], mesh["tp"])
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    model(x).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, grads)
    for other in gathered[1:]:
        for a, b in zip(gathered[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_full_gradients_identical_on_every_rank() -> None:
    run_ranks(4, _same_batch_on_tp_ranks)



# ---- parameters on another mesh (mixture of experts) ---------------------------------------------------

N_EXPERTS = 4


class Experts(nn.Module):
    """Expert weights sharded over "ep"; each rank applies its own experts (standing in for routing + all-to-all)."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.w = nn.Parameter(distribute_tensor(torch.randn(N_EXPERTS, DIM + 1, DIM + 1) / 3, ep_mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((x @ expert for expert in self.w.to_local()), torch.zeros_like(x))


class MoEBlock(nn.Module):
    def __init__(self, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM + 1, DIM + 1)
        self.experts = Experts(ep_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(torch.relu(self.proj(x)))


def _experts_on_another_mesh(rank: int, world_size: int, reshard_after_forward: bool) -> None:
    """A mixture of experts, torchtitan's way on FSDP2: one fully_shard call per block whose shard_placement_fn returns
    ShardPlacementResults, the experts over the ranks outside their expert-parallel group ("edp"), the rest over
    every rank ([Note: Parameters on other meshes]). fullshard's one-call form, its two-call form (the experts
    sharded by a call of their own first) and FSDP2's one-call form give the same meshes, placements, losses,
    gradients and values, also with a micro-batch that skips the gradient sync."""
    fsdp_common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    experts_mesh = dp._unflatten(0, (2, world_size // 2), ("edp", "ep"))
    dp_info = fsdp_common.FSDPMeshInfo(dp, shard_mesh_dim=0)
    edp_info = fsdp_common.FSDPMeshInfo(experts_mesh["edp"], shard_mesh_dim=0)

    def build(form: str) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(MoEBlock(experts_mesh["ep"]), MoEBlock(experts_mesh["ep"]))
        shard = torch_fully_shard if form == "torch" else fully_shard
        for block in model:
            experts = set(block.experts.parameters())
            if form == "two calls":
                fully_shard(block.experts, mesh=experts_mesh["edp"], reshard_after_forward=reshard_after_forward)
            shard(block, mesh=dp, reshard_after_forward=reshard_after_forward,
                  shard_placement_fn=lambda p, e=experts: fsdp_common.ShardPlacementResult(
                      placement=Shard(0), mesh_info=edp_info if p in e else dp_info))
        shard(model, mesh=dp)
        return model

    models = [build("one call"), build("two calls"), build("torch")]
    layouts = [[(n, p.device_mesh.mesh_dim_names, p.placements, p.to_local().shape) for n, p in m.named_parameters()]
               for m in models]
    assert layouts[0] == layouts[1] == layouts[2]
    experts_layout = next(entry for entry in layouts[0] if entry[0] == "0.experts.w")
    assert experts_layout[1:3] == (("edp", "ep"), (_StridedShard(0, split_factor=2), Shard(0)))
    assert not isinstance(models[0][0].experts, fullshard.FSDPModule)  # (as FSDP2: one call, one FSDP module)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        for micro in range(2):
            for m in models:
                m.set_requires_gradient_sync(micro == 1 or step != 1)
            x = [torch.randn(3, DIM + 1, generator=gen) for _ in range(world_size)][rank]
            losses = [m(x).square().mean() for m in models]
            for loss in losses:
                loss.backward()
            assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
            if step == 1 and micro == 0:
                continue
            for (name, *params) in zip(*(dict(m.named_parameters()) for m in models[:1]),
                                       *(m.parameters() for m in models), strict=True):
                grads = [p.grad.to_local() for p in params]
                assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[2]), name
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for ours, theirs in zip(models[0].parameters(), models[2].parameters(), strict=True):
        assert torch.equal(ours.to_local(), theirs.to_local())
    for m in (models[0], models[2]):  # several groups: the setters FSDP2 refuses for them
        with pytest.raises(ValueError, match="multiple param groups"):
            m[0].set_all_reduce_hook(lambda t: None)
    faces = []
    for m in (models[0], models[2]):  # an explicit unshard registers every group's unsharded parameters
        m[0].unshard()
        faces.append([(n, type(p).__name__, tuple(p.shape)) for n, p in m[0].named_parameters()])
        m[0].reshard()
    assert faces[0] == faces[1]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_experts_on_another_mesh_match_torch(reshard_after_forward: bool) -> None:
    run_ranks(4, _experts_on_another_mesh, reshard_after_forward)


def _experts_mesh_errors(rank: int, world_size: int) -> None:
    fsdp_common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    experts_mesh = dp._unflatten(0, (2, world_size // 2), ("edp", "ep"))
    edp_info = fsdp_common.FSDPMeshInfo(experts_mesh["edp"], shard_mesh_dim=0)
    block = MoEBlock(experts_mesh["ep"])
    # an int reshard_after_forward must divide every group's shard size (edp has 2 ranks): the block unchanged
    with pytest.raises(ValueError, match="factor of 2"):
        fully_shard(block, mesh=dp, reshard_after_forward=4, shard_placement_fn=lambda p: (
            fsdp_common.ShardPlacementResult(placement=Shard(0), mesh_info=edp_info) if p.dim() == 3 else None))
    assert not isinstance(block, fullshard.FSDPModule) and not isinstance(block.experts.w.placements[0], _StridedShard)
    cube = fsdp_common.FSDPMeshInfo(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")), shard_mesh_dim=2)
    with pytest.raises(ValueError, match=r"put 'experts.w' on .*must be 1-D \(sharding\) or 2-D"):
        fully_shard(block, mesh=dp, shard_placement_fn=lambda p: (
            fsdp_common.ShardPlacementResult(placement=Shard(0), mesh_info=cube) if p.dim() == 3 else None))
    assert not isinstance(block, fullshard.FSDPModule)
    with pytest.raises(ValueError, match="no mesh to shard over"):
        fully_shard(block, mesh=dp, shard_placement_fn=lambda p: fsdp_common.ShardPlacementResult(
            placement=Shard(0), mesh_info=object()))
    assert not isinstance(block, fullshard.FSDPModule)


def test_experts_mesh_errors() -> None:
    run_ranks(4, _experts_mesh_errors)


class SPBlock(nn.Module):
    """A Llama-style block as torchtitan parallelises it: norms on sequence shards (their weights replicated on
    ``tp``, so their gradients come out as partial sums over it), attention and MLP inputs gathered by
    ``PrepareModuleInput``, column-parallel in, row-parallel out to sequence shards."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = nn.ModuleDict({"q": nn.Linear(dim, dim, bias=False), "k": nn.Linear(dim, dim, bias=False),
                                   "v": nn.Linear(dim, dim, bias=False), "o": nn.Linear(dim, dim, bias=False)})
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        b, s, _ = h.shape
        q, k, v = (self.attn[n](h).view(b, s, -1, 2).transpose(1, 2) for n in "qkv")  # heads of 2, split over tp
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["o"](o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.mlp_norm(x))


class SPNet(nn.Module):
    def __init__(self, vocab: int = 24, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SPBlock(dim) for _ in range(2))
        self.norm, self.out = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def _sequence_parallel(rank: int, world_size: int) -> None:
    """torchtitan's TP plan (sequence-parallel norms, PrepareModuleInput, loss_parallel) under FSDP on ``dp``:
    fp32 against the unsharded model, and bf16 with an fp32 reduction and a micro-batch without sync bit for bit
    against torch's FSDP2 (which sums the norms' partial TP gradients over the micro-batches in fp32 and reduces
    them over ``tp`` once)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, loss_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block_plan = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": gathered,
                  "mlp": gathered, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                  "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                  "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}

    def build(shard: object, mp: object) -> nn.Module:
        torch.manual_seed(0)
        model = SPNet()
        parallelize_module(model, mesh["tp"], {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], block_plan)  # type: ignore[arg-type]
            shard(block, mesh=mesh["dp"], mp_policy=mp)  # type: ignore[operator]
        shard(model, mesh=mesh["dp"], mp_policy=mp)  # type: ignore[operator]
        return model

    def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            logits = model(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: list[torch.Tensor]) -> list[float]:
        losses = []
        for i, tokens in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # type: ignore[operator]
            loss = loss_fn(model, tokens) / len(micro_batches)
            with loss_parallel():
                loss.backward()
            losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
        opt.step()
        opt.zero_grad()
        return losses

    batches = random_batches(3, 2, lambda g: [token_batch(g, vocab=24, seq=8, rows=2) for _ in range(2)])
    torch.manual_seed(0)
    ref = SPNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = build(fully_shard, MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for per_rank in batches:
        for micro in range(2):
            (sum(loss_fn(ref, per_rank[r][micro]) for r in range(2)) / 4).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        step(model, opt, per_rank[dp_rank])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[name], rtol=1e-5, atol=1e-6)

    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    models = [build(fully_shard, MixedPrecisionPolicy(**bf16)), build(torch_fully_shard, TorchMixedPrecisionPolicy(**bf16))]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for per_rank in batches:
        assert step(models[0], optims[0], per_rank[dp_rank]) == step(models[1], optims[1], per_rank[dp_rank])
    for (name, ours), theirs in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(ours.to_local(), theirs.to_local()), name


def test_sequence_parallel_plan_matches_unsharded_and_fsdp2() -> None:
    run_ranks(4, _sequence_parallel)
