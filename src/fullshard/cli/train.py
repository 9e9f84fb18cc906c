"""``fullshard train``: sharded training of a byte-level GPT, from a fresh clone in one command.

Without ``torchrun`` it starts ``--nproc`` local CPU ranks (gloo) itself; under
``torchrun`` it uses the launcher's ranks (NCCL with ``--device cuda``).
``--batch-size`` is the global batch (sequences per optimizer step), split
evenly over ranks and micro-batches, so a run resumed at another world size
continues with the same data and the same losses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fullshard import checkpoint
from fullshard import optim as fullshard_optim
from fullshard.api import original_class
from fullshard.cli import hf, launch
from fullshard.cli.data import Corpus, default_corpus
from fullshard.cli.launch import UserError
from fullshard.codec import QuantizedCommPolicy
from fullshard.ema import EMA
from fullshard.fsdp1 import clip_grad_norm_, no_sync, nonfinite_gradients
from fullshard.gpt import GPT, Block, GPTConfig
from fullshard.runtime import state_of
from fullshard.wrap import MixedPrecision, ModuleWrapPolicy, ShardingStrategy, shard_model

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
STRATEGIES = {s.name.lstrip("_"): s for s in ShardingStrategy}


@dataclass
class TrainConfig:
    data: str = ""
    out: str = "fullshard-run"
    nproc: int = 2
    device: str = "cpu"
    dtype: str = "fp32"
    layers: int = 4
    dim: int = 128
    heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    sharding: str = "FULL_SHARD"
    replicate: int = 1
    reshard_after_forward: str = "auto"
    activation_checkpointing: bool = False
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 2
    checkpoint_every: int = 100
    resume: bool = False
    stop_at: int = 0
    hf_model: str = ""
    ema: float = 0.0
    skip_nonfinite: bool = False
    quantized_comm: bool = False
    optimizer: str = "adamw"
    max_restarts: int = 0
    progress: bool = True

    def model_config(self) -> GPTConfig:
        try:
            return GPTConfig(vocab_size=256, dim=self.dim, n_heads=self.heads, hidden=4 * self.dim, n_layers=self.layers,
                             seq_len=self.seq_len, checkpoint_blocks=self.activation_checkpointing)
        except ValueError as err:
            raise UserError(f"impossible model shape: {err}") from None

    def check(self) -> None:
        self.model_config()
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.sharding not in STRATEGIES:
            raise UserError(f"--sharding must be one of {sorted(STRATEGIES)}, got {self.sharding!r}")
        if self.reshard_after_forward not in ("auto", "true", "false"):
            raise UserError(f"--reshard-after-forward must be auto, true or false, got {self.reshard_after_forward!r}")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be at least 0, got {self.max_restarts}")
        if not 0.0 <= self.ema < 1.0:
            raise UserError(f"--ema must be a decay in [0, 1) (0: off), got {self.ema}")
        if self.optimizer not in ("adamw", "muon"):
            raise UserError(f"--optimizer must be adamw or muon, got {self.optimizer!r}")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got {self.device!r}")
        for name in ("nproc", "batch_size", "grad_accum", "steps", "eval_every", "eval_batches", "checkpoint_every", "replicate"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "stop_at", "weight_decay", "clip"):
            if not getattr(self, name) >= 0:
                raise UserError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(self, name)}")
        if not (0 < self.lr < math.inf):
            raise UserError(f"--lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")

    def strategy(self) -> ShardingStrategy:
        """The FSDP1 strategy in effect: ``--replicate N`` makes a sharding strategy hybrid."""
        chosen = STRATEGIES[self.sharding]
        if self.replicate > 1 and chosen is ShardingStrategy.FULL_SHARD:
            return ShardingStrategy.HYBRID_SHARD
        if self.replicate > 1 and chosen is ShardingStrategy.SHARD_GRAD_OP:
            return ShardingStrategy._HYBRID_SHARD_ZERO2
        return chosen

    def rows_per_rank(self, world_size: int) -> int:
        per_step = world_size * self.grad_accum
        if self.batch_size % per_step:
            raise UserError(
                f"--batch-size {self.batch_size} (the global batch) does not split evenly over {world_size} ranks x "
                f"{self.grad_accum} micro-batches; use a multiple of {per_step}"
            )
        return self.batch_size // per_step


# ---- arguments and config file -------------------------------------------------------------------------


HELP = {
    "data": "a text file or a folder of files (default: the Python standard library's source)",
    "out": "run folder: checkpoints/, metrics.jsonl, training.png",
    "nproc": "local ranks to start when not under torchrun",
    "device": "cpu or cuda (cuda: run under torchrun, one rank per GPU)",
    "dtype": "compute dtype: fp32, or bf16/fp16 mixed precision (fp32 shards, gradients reduced in fp32)",
    "layers": "transformer blocks",
    "dim": "model width",
    "heads": "attention heads (must divide --dim)",
    "seq_len": "sequence length in bytes",
    "batch_size": "global batch: sequences per optimizer step, split over ranks and micro-batches",
    "grad_accum": "micro-batches per optimizer step (gradients reduced once, after the last)",
    "steps": "optimizer steps in all",
    "lr": "peak learning rate",
    "min_lr_ratio": "final learning rate as a fraction of --lr (cosine decay)",
    "warmup": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay",
    "clip": "gradient-norm clipping threshold (0: off)",
    "sharding": f"FSDP1 strategy name: {', '.join(sorted(STRATEGIES))}",
    "replicate": "HSDP: replicas (the ranks split into --replicate groups that each shard the model)",
    "reshard_after_forward": "auto (blocks yes, root no), true or false",
    "activation_checkpointing": "recompute each block in backward instead of keeping its activations",
    "seed": "initialisation and data seed",
    "eval_every": "evaluate on held-out text every K steps",
    "eval_batches": "global batches per evaluation",
    "checkpoint_every": "save a checkpoint every K steps (and at the end)",
    "resume": "continue from the latest complete checkpoint in --out (at any world size)",
    "stop_at": "stop after this step with a checkpoint (0: run all --steps), e.g. to fit a time slot; --resume continues",
    "hf_model": "train a transformers causal LM instead: a model type (llama, gpt2, ...) sized by the flags above, "
    "or a config.json (needs the [hf] extra; random init, no hub access)",
    "ema": "also keep an exponential moving average of the weights with this decay (e.g. 0.99), evaluated "
    "on held-out text at each evaluation and saved in checkpoints (0: off)",
    "skip_nonfinite": "skip an optimizer step whose gradients hold a NaN or inf (on every rank alike) instead of "
    "stopping with an error that names the parameters",
    "max_restarts": "when a rank dies, stop the others and start again from the latest intact checkpoint, up to N "
    "times (local ranks; under torchrun use its --max-restarts: a restarted worker resumes by itself)",
    "quantized_comm": "all-gather weight matrices as block-quantized int8 and reduce-scatter gradients in bf16 "
    "(fullshard.QuantizedCommPolicy; shards, optimizer and the fp32 gradient accumulation stay full precision)",
    "optimizer": "adamw (fullshard.optim.AdamW), or muon: fullshard.optim.Muon for the blocks' weight matrices "
    "(RMS matched to AdamW, so one --lr serves both) and AdamW for embeddings, head, norms and biases",
    "progress": "show the progress bar on rank 0",
}

# Fault injection for testing recovery: "kill:RANK:STEP" makes RANK kill itself (SIGKILL) as it starts step STEP,
# in the first attempt only.
FAULT_ENV = "FULLSHARD_FAULT"
RESTART_ENV = "FULLSHARD_RESTART_COUNT"  # set by the local launcher; torchrun sets TORCHELASTIC_RESTART_COUNT


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get(RESTART_ENV) or 0)


def _inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec.startswith("kill:") and restart_count() == 0:
        _, fault_rank, fault_step = spec.split(":")
        if rank == int(fault_rank) and step + 1 == int(fault_step):
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def add_command(commands: Any) -> None:
    p = commands.add_parser(
        "train", help="train a byte-level GPT with fully sharded data parallelism", description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", metavar="FILE.toml", help="TOML file whose keys mirror the flags (e.g. seq_len = 256)")
    # Flags default to "not given" (SUPPRESS), so a config file value is overridden only by a flag actually passed.
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        text = f"{HELP[field.name]} (default: {field.default!r})"
        if field.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            p.add_argument(flag, type=type(field.default), default=argparse.SUPPRESS, help=text)
    p.set_defaults(run=main)


def load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"config file {path} is not valid TOML: {err}") from None
    known = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UserError(f"unknown option {key!r} in config file {path}")
        expected = type(known[name].default)
        if not isinstance(value, expected) and not (expected is float and isinstance(value, int)):
            raise UserError(f"option {key!r} in config file {path} must be {expected.__name__}, got {value!r}")
    return {k.replace("-", "_"): v for k, v in values.items()}


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults < config file < flags given on the command line."""
    given = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    file_values = load_config_file(args.config) if args.config else {}
    cfg = TrainConfig(**{**dataclasses.asdict(TrainConfig()), **file_values, **given})
    cfg.check()
    return cfg


def main(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    data = Path(cfg.data) if cfg.data else default_corpus()
    Corpus.load(data, cfg.seq_len)  # fail here, before starting ranks, on bad data
    if launch.under_launcher():
        launch.run(worker, cfg.nproc, cfg, device_type=cfg.device)
        return 0
    cfg.rows_per_rank(cfg.nproc)
    for restarts in range(cfg.max_restarts + 1):
        os.environ[RESTART_ENV] = str(restarts)
        try:
            launch.run(worker, cfg.nproc, cfg, device_type=cfg.device)
            return 0
        except launch.RankFailed as err:
            if restarts == cfg.max_restarts:
                raise
            print(f"fullshard train: {err}; restarting from the latest intact checkpoint "
                  f"(restart {restarts + 1} of {cfg.max_restarts})", file=sys.stderr)
            cfg = dataclasses.replace(cfg, resume=True)
    return 0


# ---- the run ----------------------------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build(cfg: TrainConfig, world_size: int, device: torch.device) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(cfg.seed)
    model: torch.nn.Module
    if cfg.hf_model:
        model = hf.build_model(hf.build_config(cfg.hf_model, layers=cfg.layers, dim=cfg.dim, heads=cfg.heads,
                                               seq_len=cfg.seq_len))
        layer_class = hf.decoder_layer_class(model)
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    else:
        model, layer_class = GPT(cfg.model_config()), Block
    strategy = cfg.strategy()
    mesh = None
    if cfg.replicate > 1:
        if world_size % cfg.replicate or strategy is ShardingStrategy.NO_SHARD:
            raise UserError(f"--replicate {cfg.replicate} needs a sharding strategy and a world size ({world_size}) "
                            "that it divides")
        mesh = init_device_mesh(device.type, (cfg.replicate, world_size // cfg.replicate), mesh_dim_names=("replicate", "shard"))
    dtype = DTYPES[cfg.dtype]
    comm_policy = QuantizedCommPolicy() if cfg.quantized_comm else None
    reduce_dtype = comm_policy.reduce_dtype if comm_policy is not None else torch.float32
    shard_model(
        model, auto_wrap_policy=ModuleWrapPolicy({layer_class}), sharding_strategy=strategy, device_mesh=mesh,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=reduce_dtype) if dtype else None,
        comm_policy=comm_policy,
    )
    if cfg.reshard_after_forward != "auto":
        model.set_reshard_after_forward(cfg.reshard_after_forward == "true")  # type: ignore[operator]
    adamw: dict[str, Any] = {"lr": cfg.lr, "betas": (0.9, 0.95), "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "adamw":
        return model, fullshard_optim.AdamW(model.parameters(), **adamw)
    # Muon for the blocks' weight matrices, AdamW for embeddings, head, norms and biases.
    matrices = {p: None for m in model.modules() if isinstance(m, layer_class) for p in m.parameters() if p.ndim == 2}
    rest = [p for p in model.parameters() if p not in matrices]
    muon = fullshard_optim.Muon(list(matrices), lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    return model, Optimizers(muon, fullshard_optim.AdamW(rest, **adamw))


class Optimizers:
    """Several optimizers stepped as one (``--optimizer muon``); checkpoints hold each one's state."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)


def _each(opt: Any) -> Any:
    """What torch's optimizer state-dict helpers take: one optimizer or several."""
    return opt.optimizers if isinstance(opt, Optimizers) else opt


def app_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, ema: EMA | None) -> dict[str, Any]:
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, _each(opt)),
        "train": {"step": torch.tensor(step)},
    }
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def complete_checkpoints(out: Path) -> list[Path]:
    """The run's complete checkpoints, newest first."""
    found = [p for p in (out / "checkpoints").glob("step_*") if checkpoint.is_complete(p)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]), reverse=True)


def latest_checkpoint(out: Path) -> Path | None:
    found = complete_checkpoints(out)
    return found[0] if found else None


def intact_checkpoint(out: Path, rank: int) -> Path | None:
    """The newest checkpoint whose files match its manifest; each damaged newer one is reported. Collective."""
    for path in complete_checkpoints(out):
        try:
            checkpoint.verify(path)
            return path
        except checkpoint.CheckpointDamagedError as err:
            if rank == 0:
                print(f"fullshard train: {err}; falling back to the previous checkpoint", file=sys.stderr)
    return None


def causal_lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy for our GPT (logits) and transformers models (an output with ``.logits``)."""
    out = model(tokens[:, :-1])
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def global_mean(value: torch.Tensor) -> float:
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""
    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    optim = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
    }


def worker(rank: int, world_size: int, cfg: TrainConfig) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    rows = cfg.rows_per_rank(world_size)
    corpus = Corpus.load(Path(cfg.data) if cfg.data else default_corpus(), cfg.seq_len)
    model, opt = build(cfg, world_size, device)
    ema = EMA(model, cfg.ema) if cfg.ema else None
    out = Path(cfg.out)
    start = 0
    if cfg.resume or restart_count() > 0:
        found = intact_checkpoint(out, rank)
        if found is not None:
            state = app_state(model, opt, 0, ema)
            try:
                checkpoint.load(state, found, check_files=False)  # verified just now
            except ValueError as err:
                raise UserError(
                    f"cannot resume: {err} (was it written by a model of another shape, or with another --ema setting?)"
                ) from None
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, _each(opt), state["optim"])
            if ema is not None:
                ema.load_state_dict(state["ema"])
            start = int(state["train"]["step"])
        elif rank == 0:
            print(f"fullshard train: no intact checkpoint in {out / 'checkpoints'}; starting at step 0", file=sys.stderr)

    def local_rows(split: str, index: int, micro: int) -> torch.Tensor:
        batch = corpus.batch(split, cfg.seed, index, cfg.batch_size, cfg.seq_len)
        first = (rank * cfg.grad_accum + micro) * rows
        return batch[first : first + rows].to(device)

    def evaluate() -> float:
        with torch.no_grad():
            losses = [
                causal_lm_loss(model, local_rows("eval", i, m)) for i in range(cfg.eval_batches) for m in range(cfg.grad_accum)
            ]
        return global_mean(torch.stack(losses).mean())

    progress = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        progress = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    metrics: list[dict[str, Any]] = []
    memory: dict[str, int] = {}
    tokens_per_step = cfg.batch_size * cfg.seq_len
    saved_at = None
    timed: list[float] = []
    skipped: list[int] = []  # steps whose gradients were not finite (--skip-nonfinite)
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    metrics_file = _open_metrics(out, start) if rank == 0 else None
    for step in range(start, end):
        _inject_fault(rank, step)
        begin = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            with no_sync(model) if not last else contextlib.nullcontext():
                loss = causal_lm_loss(model, local_rows("train", step, micro)) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        # The total norm is the same on every rank, so all ranks take the same branch.
        norm = clip_grad_norm_(model, cfg.clip if cfg.clip > 0 else math.inf)
        finite = math.isfinite(float(norm))
        if not finite:
            bad = nonfinite_gradients(model)
            where = f"non-finite gradient at step {step + 1} in {', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else "")
            if not cfg.skip_nonfinite:
                raise UserError(f"{where}; lower --lr, clip with --clip, or skip such steps with --skip-nonfinite")
            skipped.append(step + 1)
            if rank == 0:
                print(f"fullshard train: {where}; step skipped", file=sys.stderr)
        else:
            opt.step()
            if ema is not None:
                ema.update()
        if not memory and finite:  # gradients and optimizer state both exist now
            memory = state_bytes(model, opt)
        opt.zero_grad()
        loss_value = global_mean(total)
        elapsed = time.perf_counter() - begin
        if step > start:
            timed.append(elapsed)
        record: dict[str, Any] = {"step": step + 1, "loss": loss_value, "lr": lr_at(cfg, step),
                                  "tokens_per_s": tokens_per_step / elapsed}
        if not finite:
            record["skipped"] = True
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record["eval_loss"] = evaluate()
            if ema is not None:
                with ema.swap():
                    record["eval_loss_ema"] = evaluate()
        metrics.append(record)
        if metrics_file is not None:  # a line per step, so a run that dies keeps what it did
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
            saved_at = checkpoint.save(app_state(model, opt, step + 1, ema), out / "checkpoints" / f"step_{step + 1:06d}")
    if progress is not None:
        progress.close()
    if not memory:  # nothing left to train after resuming: measure the state as it is
        memory = state_bytes(model, opt)
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, memory)
    if metrics_file is not None:
        metrics_file.close()
    if rank == 0:
        report = _summary(cfg, corpus, model, metrics, per_rank, timed, tokens_per_step, saved_at or latest_checkpoint(out), out)
        print(report)


def _open_metrics(out: Path, start: int) -> Any:
    """metrics.jsonl for appending; a resumed run keeps the earlier lines up to where it resumed."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.jsonl"
    kept = []
    if start and path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start]
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a")


def _summary(
    cfg: TrainConfig, corpus: Corpus, model: torch.nn.Module, metrics: list[dict[str, Any]], per_rank: list[dict[str, int]],
    timed: list[float], tokens_per_step: int, saved: Path | None, out: Path,
) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    unsharded = n_params * 4 * 4  # fp32 parameters, gradients and two AdamW moments
    mib = 2**20
    ranks = ", ".join(f"{sum(m.values()) / mib:.2f}" for m in per_rank)
    lines = ["fullshard train: done"]
    lines.append(f"  data: {corpus.path} ({len(corpus.train)} training bytes, {len(corpus.eval)} held out)")
    kind = original_class(model).__name__ if cfg.hf_model else "GPT"
    lines.append(f"  model: {kind} {cfg.layers} layers, width {cfg.dim}, {cfg.heads} heads, sequence {cfg.seq_len}: "
                 f"{n_params:,} parameters; {len(per_rank)} ranks, {cfg.strategy().name.lstrip('_')}, {cfg.dtype}")
    groups = [original_class(m).__name__ for m in model.modules() if (st := state_of(m)) is not None and m is st.modules[0]]
    layer_names = sorted(set(groups[1:]))
    lines.append(f"  sharded as {len(groups)} groups: {len(groups) - 1} x {', '.join(layer_names) or '-'} and the root")
    if metrics:
        evals = [m for m in metrics if "eval_loss" in m]
        held_out = f" (held-out {evals[-1]['eval_loss']:.4f}" if evals else ""
        if evals and "eval_loss_ema" in evals[-1]:
            held_out += f", EMA weights {evals[-1]['eval_loss_ema']:.4f}"
        lines.append(f"  loss: {metrics[0]['loss']:.4f} at step {metrics[0]['step']} -> {metrics[-1]['loss']:.4f} at step "
                     f"{metrics[-1]['step']}" + (held_out + ")" if evals else ""))
    skipped = [m["step"] for m in metrics if m.get("skipped")]
    if skipped:
        lines.append(f"  skipped {len(skipped)} steps with non-finite gradients: {', '.join(map(str, skipped[:10]))}"
                     + (" ..." if len(skipped) > 10 else ""))
    if timed:
        lines.append(f"  throughput: {tokens_per_step * len(timed) / sum(timed):,.0f} tokens/s")
    lines.append(f"  per-rank parameters + gradients + optimizer state: [{ranks}] MiB; unsharded total {unsharded / mib:.2f} MiB")
    lines.append(f"  checkpoint: {saved}")
    plot = _plot(out, per_rank, unsharded)
    lines.append(f"  plot: {plot}")
    return "\n".join(lines)


def _plot(out: Path, per_rank: list[dict[str, int]], unsharded: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    evals = [r for r in rows if "eval_loss" in r]
    ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
    if any("eval_loss_ema" in r for r in evals):
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss_ema"] for r in evals], "s--", label="held-out, EMA weights")
    ax_loss.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax_loss.legend()
    mib = 2**20
    bottom = [0.0] * len(per_rank)
    for part in ("params", "grads", "optimizer"):
        values = [m[part] / mib for m in per_rank]
        ax_mem.bar(range(len(per_rank)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.axhline(unsharded / mib, color="black", linestyle="--", label="unsharded total")
    ax_mem.set(xlabel="rank", ylabel="MiB", title="per-rank training state", xticks=range(len(per_rank)))
    ax_mem.legend()
    fig.tight_layout()
    path = out / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
