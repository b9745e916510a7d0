"""The one training loop: pretraining and fine-tuning of both families, one process or many (torchrun).

    for step in range(start, max_steps):
        lr <- lr_at(step)                          schedule is a pure function of the step
        rows of this rank <- data.batch(step)      data is a pure function of (seed, step): resume = same step
        norm <- predicted items in the whole step  (all micro-batches, all ranks)
        for each micro-batch: backward(loss / norm)   so k micro-batches of B/k == one batch of B
        clip; skip the update if loss or gradient norm is not finite; AdamW step
        log; validate every eval_every; checkpoint every checkpoint_every or on SIGTERM

Exact resume: weights, AdamW state and the step are saved; everything else that decides a step (the
batch, dropout masks) is a function of (seed, step, rank), because the global RNG is re-seeded from
them at every step. So N steps + kill + resume + N steps == 2N steps, bit for bit. The run directory
(checkpoints, manifest, metrics.jsonl) is duolm.runs's; only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import math
import pickle
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from duolm import runs
from duolm.checkpoint import SHARDS, load, save
from duolm.config import opt
from duolm.fileio import write_error
from duolm.generation.static import isa_options
from duolm.objectives import Objective
from duolm.precision import TRAINING, autocast, resolve
from duolm.train.logs import open_logs
from duolm.train.optim import lr_at, make_optimizer
from duolm.train.parallel import (PARALLEL, activation_checkpointing, load_model_state, load_optimizer_state,
                                  load_shards, model_state, no_sync, rank_world, save_shards, sharded, wrap)

TRAIN_STATE = "train_state.pt"


@dataclass
class TrainConfig:
    """How to train (the same for pretraining and fine-tuning); the CLI's flags are these fields."""
    max_steps: int = opt(1000, "optimizer steps in all")
    batch_size: int = opt(32, "GLOBAL batch: sequences per optimizer step, over all processes")
    micro_batch_size: int | None = opt(None, "sequences per forward on one process (default: its whole share)")
    lr: float = opt(6e-4, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    warmup_steps: int = opt(100, "linear warmup steps")
    decay: str = opt("cosine", "schedule after warmup", choices=("cosine", "linear", "constant"))
    weight_decay: float = opt(0.1, "AdamW weight decay of the matrices")
    betas: tuple = opt((0.9, 0.95), "AdamW betas", cli=False)
    eps: float = opt(1e-8, "AdamW epsilon", cli=False)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: no clipping)")
    eval_every: int = opt(100, "validate every N steps (0: at the end only)")
    eval_batches: int | None = opt(20, "validation batches per evaluation")
    checkpoint_every: int = opt(500, "checkpoint every N steps (0: at the end and on SIGTERM only)")
    keep_last: int = opt(3, "checkpoints kept (the newest)")
    seed: int = opt(0, "seed of the weights, the data order and dropout")
    compile: bool = opt(False, "torch.compile the model for training")
    activation_checkpointing: bool = opt(False, "keep each transformer block's input only and recompute its "
                                         "activations in the backward pass: less memory, one more forward")
    parallel: str = opt("ddp", "with several processes (torchrun): ddp (a replica each) or fsdp (FSDP2: parameters, "
                        "gradients and optimizer state sharded over the processes)", choices=PARALLEL)
    precision: str = opt("auto", "arithmetic of training: bf16 autocast (fp32 weights, optimizer state and "
                         "losses) or fp32; auto: bf16 where the device computes it natively (CUDA, CPUs with "
                         "AVX512-BF16 or AMX), fp32 elsewhere", choices=TRAINING)
    select_metric: str | None = opt(None, "keep RUN/best/ by this validation metric (e.g. val_accuracy)", cli=False)
    select_mode: str = opt("max", "whether a larger or smaller select_metric is better", cli=False)

    def __post_init__(self):
        for name in ("max_steps", "batch_size", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.select_mode not in ("max", "min"):
            raise ValueError(f"select_mode={self.select_mode!r} must be 'max' or 'min'")


def _all_reduce(values: dict, device) -> dict:
    """Sums a dict of numbers over ranks (identity in one process)."""
    if not values or rank_world()[1] == 1:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def _to(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _micro_batches(batch: dict, size: int) -> list[dict]:
    n = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    return [{k: (v[i:i + size] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(0, n, size)]


def _add(total: dict, metrics: dict):
    for k, v in metrics.items():
        total[k] = total.get(k, 0.0) + (v.detach() if isinstance(v, torch.Tensor) else v)


def _step_seed(seed: int, step: int, rank: int) -> int:
    return ((seed * 1_000_003 + step) * 1_009 + rank) % (2 ** 63)


# --- checkpoints ------------------------------------------------------------------------------

def save_checkpoint(run_dir, step: int, model: nn.Module, state: dict, tokenizer=None, keep_last: int = 3,
                    best: dict | None = None, info: dict | None = None, model_state: dict | None = None,
                    shards=None) -> Path:
    """RUN/ckpt-<step>/: the model directory plus train_state.pt, committed by duolm.runs (best, info: see
    duolm.runs.save_checkpoint; model_state: a sharded model's state, gathered; shards(folder): writes the weights
    (and the optimizer's state) as shards instead, at once with the other processes: duolm.train.parallel)."""
    def write(folder):
        if shards is not None:
            shards(folder / SHARDS)
        save(model, folder, tokenizer=tokenizer, state=model_state, weights=shards is None)
        try:
            with open(folder / TRAIN_STATE, "wb") as f:
                torch.save(state, f)
        except (OSError, RuntimeError) as e:   # torch wraps a failed write (a full disk) in a RuntimeError
            raise write_error(folder / TRAIN_STATE, e) from e
    return runs.save_checkpoint(run_dir, step, write, keep_last, best, info)


def load_train_state(run_dir, model: nn.Module, optimizer=None) -> dict | None:
    """Loads the newest complete checkpoint of a run into `model` (and `optimizer`, unless None: a run's of any
    kind and number of processes); returns its train state (None: no checkpoint yet)."""
    if runs.read_manifest(run_dir) is None:
        return None
    ckpt = runs.latest_checkpoint(run_dir)
    path = ckpt / TRAIN_STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: refused as unsafe: it holds more than tensors and plain values, and "
                         f"unpickling it could run code; duolm never loads such a file") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path}: not a readable training state ({type(e).__name__}); "
                         f"it may be truncated or corrupt") from None
    if (ckpt / SHARDS).is_dir():
        load_shards(model, optimizer, ckpt / SHARDS)
        return state
    saved, _ = load(ckpt)
    try:
        load_model_state(model, saved.state_dict())
    except RuntimeError as e:
        raise ValueError(f"{ckpt} does not fit this model (different config?): {e}") from None
    if optimizer is not None:
        load_optimizer_state(model, optimizer, state["optimizer"])
    return state


# --- evaluation -------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches, micro_batch_size: int | None = None) -> dict:
    """Mean loss (and the objective's metrics) over `batches` (this rank's share), summed over ranks, in the
    caller's precision context."""
    device = next(model.parameters()).device
    micros = [m for b in batches for m in
              (_micro_batches(_to(b, device), micro_batch_size) if micro_batch_size else [_to(b, device)])]
    counts = {}
    for m in micros:
        _add(counts, objective.counts(m))
    norm = {k: max(v, 1) for k, v in _all_reduce(counts, device).items()}
    was_training = model.training
    model.eval()
    total = {}
    for m in micros:
        _add(total, objective.loss(objective.forward(model, m), m, norm)[1])
    model.train(was_training)
    return _all_reduce(total, device)


def loss_validator(objective: Objective, val_data, cfg: TrainConfig):
    """validate(model, step) -> {"val_loss": ..., "val_<metric>": ...} over cfg.eval_batches of `val_data`, in fp32
    (as `duolm evaluate` scores the saved model)."""
    def validate(model, step):
        rank, world = rank_world()
        batches = val_data.eval_batches(cfg.batch_size, rank=rank, world_size=world, max_batches=cfg.eval_batches)
        micro = cfg.micro_batch_size or cfg.batch_size // world
        metrics = evaluate(model, objective, batches, micro)
        return {"val_" + k: v for k, v in metrics.items()}
    return validate


# --- one step ---------------------------------------------------------------------------------

def train_step(fwd: nn.Module, objective: Objective, optimizer, micros: list[dict], params, grad_clip: float,
               world: int = 1, autocast=contextlib.nullcontext) -> dict:
    """One optimizer step over this rank's micro-batches: returns the step's metrics summed over ranks,
    its input tokens, the gradient norm and whether the update was applied (a non-finite loss or
    gradient skips it, so a bad batch cannot poison the weights)."""
    device = params[0].device
    counts = {}
    for m in micros:
        _add(counts, objective.counts(m))
    norm = _all_reduce(counts, device)          # predicted items in the whole step, all ranks
    total, n_tokens = {}, 0
    for i, m in enumerate(micros):
        # DDP and FSDP average gradients over ranks; losses are already divided by the global count, so undo it
        with no_sync(getattr(fwd, "_orig_mod", fwd), sync=i == len(micros) - 1):   # (a compiled module's own)
            with autocast():
                loss, metrics = objective.loss(objective.forward(fwd, m), m, norm)
            (loss * world).backward()
        _add(total, metrics)
        n_tokens += objective.tokens(m)
    total = _all_reduce({**total, "_tokens": n_tokens}, device)
    grad_norm = nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # (FSDP's DTensor)
    ok = math.isfinite(total["loss"]) and math.isfinite(grad_norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**total, "_tokens": int(total["_tokens"]), "grad_norm": grad_norm, "_ok": ok}


class _StopOnSigterm:
    """While active, SIGTERM sets a flag instead of killing: the loop finishes its step, saves, returns."""

    def __init__(self):
        self.event, self.old = threading.Event(), None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, lambda signum, frame: self.event.set())
        return self.event

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


# --- the loop ---------------------------------------------------------------------------------

@dataclass
class _Progress:
    """Where a run stands; saved in every checkpoint (and the best model in the manifest), read back on resume."""
    step: int = 0
    skipped: int = 0
    tokens: int = 0
    best: dict | None = None


def _resume(run_dir, model: nn.Module, optimizer, precision: str) -> _Progress:
    """The run's newest checkpoint loaded into model and optimizer (a fresh _Progress where there is none).
    Resuming under another precision than the run's is a ValueError: it would not continue the run exactly."""
    manifest = runs.read_manifest(run_dir) or {}
    if manifest.get("precision", precision) != precision:
        raise ValueError(f"{run_dir} was trained in {manifest['precision']}; resuming it in {precision} would not "
                         f"continue it exactly: resume with precision {manifest['precision']}")
    state = load_train_state(run_dir, model, optimizer)
    if state is None:
        return _Progress()
    return _Progress(state["step"], state["skipped"], state["tokens"], manifest.get("best"))


class _Run:
    """What train() writes and keeps: metrics rows (to its sinks), validations with the best model kept in
    RUN/best/ (by cfg.select_metric), checkpoints. Only rank 0 with a run_dir writes."""

    def __init__(self, model, optimizer, cfg: TrainConfig, run_dir, tokenizer, precision: str, progress: _Progress,
                 sinks: list, world: int):
        self.model, self.optimizer, self.cfg, self.run_dir, self.tokenizer = model, optimizer, cfg, run_dir, tokenizer
        self.precision, self.progress, self.sinks, self.world = precision, progress, sinks, world
        self.writer = rank_world()[0] == 0 and run_dir is not None
        self.rows: list[dict] = []

    def log(self, row: dict):
        self.rows.append(row)
        for sink in self.sinks:
            sink(row)

    def validate(self, validate, step: int) -> dict:
        metrics = validate(self.model, step)        # summed over ranks: every rank decides alike
        value, best = metrics.get(self.cfg.select_metric), self.progress.best
        if self.run_dir is not None and value is not None and (best is None or (
                value > best["value"] if self.cfg.select_mode == "max" else value < best["value"])):
            self.progress.best = {"metric": self.cfg.select_metric, "value": value, "step": step}
            model_sd = model_state(self.model)
            if self.writer:
                runs.replace_folder(Path(self.run_dir) / "best",
                                    lambda d: save(self.model, d, tokenizer=self.tokenizer, state=model_sd))
        return metrics

    def checkpoint(self, step: int):
        """Every rank calls it: a sharded model's ranks each write their shards into the folder rank 0 commits (after
        rank 0 made it ready: the barrier inside `shards`); a plain model's state is rank 0's to write."""
        if self.run_dir is None:
            return
        shards = None
        if sharded(self.model):
            def shards(folder):
                dist.barrier()
                save_shards(self.model, self.optimizer, folder)
            if not self.writer:
                shards(runs.staging(self.run_dir, step) / SHARDS)
        if self.writer:
            p = self.progress
            state = {"step": step, "skipped": p.skipped, "tokens": p.tokens, "seed": self.cfg.seed,
                     "config": asdict(self.cfg), **({} if shards else {"optimizer": self.optimizer.state_dict()})}
            save_checkpoint(self.run_dir, step, self.model, state, self.tokenizer, self.cfg.keep_last, p.best,
                            {"precision": self.precision}, shards=shards)
        if self.world > 1:
            dist.barrier()

    def close(self):
        for sink in self.sinks:
            if hasattr(sink, "close"):
                sink.close()


def micro_batch_size(cfg: TrainConfig, world: int) -> int:
    """Sequences a forward on each of `world` processes; a ValueError where the batch does not divide."""
    per_rank = cfg.batch_size // world
    if per_rank * world != cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of processes {world}")
    micro = cfg.micro_batch_size or per_rank
    if per_rank % micro:
        raise ValueError(f"each of {world} process(es) gets {per_rank} sequences per step, which is not a multiple "
                         f"of micro_batch_size {micro}")
    return micro


def train(model: nn.Module, objective: Objective, data, cfg: TrainConfig, run_dir=None, *, validate=None,
          tokenizer=None, resume: bool = False, on_log=None, tensorboard: bool = True) -> dict:
    """Trains `model` (already on its device) in place; returns {"step", "skipped", "stopped", "saved_at", "rows",
    "best", "precision"}.

    data: .batch(step, batch_size, rank, world_size) -> this rank's rows of the step's global batch, a pure
          function of the step (e.g. duolm.data.CausalBatches / BertBatches).
    validate(model, step) -> {name: value}: the caller's validation, run every cfg.eval_every steps, at step 0 of a
          fresh run and at the end, in the precision it chooses (see loss_validator). With cfg.select_metric, the
          best model by that metric is kept in RUN/best/.
    run_dir: where rank 0 writes checkpoints, metrics.jsonl and tb/ (None: nothing is written), holding it as its
          one writer (duolm.runs.hold: a second process training into it is refused).
    resume: continue from the newest complete checkpoint in run_dir (a fresh start when there is none).
    on_log(row): called on rank 0 with every metrics row (the CLI draws its progress bar from it).
    Torch.distributed, when initialised (torchrun), makes this DDP: the global batch is split over ranks.
    Training forwards run in cfg.precision (duolm.precision.autocast; "auto" resolved here once, as
    duolm.precision.resolve says), which the manifest records.
    """
    rank, world = rank_world()
    device = next(model.parameters()).device
    micro = micro_batch_size(cfg, world)
    precision = resolve(cfg.precision, device, training=True)
    fwd = wrap(model, cfg.parallel, world, device, precision)
    fwd = torch.compile(fwd, options=isa_options()) if cfg.compile else fwd
    params = [p for p in model.parameters() if p.requires_grad]
    with contextlib.ExitStack() as stack:
        stack.enter_context(activation_checkpointing(model, cfg.activation_checkpointing))
        if rank == 0 and run_dir is not None:
            stack.enter_context(runs.hold(run_dir))         # the run directory's one writer, or a ValueError
        optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps)
        progress = _resume(run_dir, model, optimizer, precision) if resume and run_dir is not None else _Progress()
        fresh = progress.step == 0
        sinks = open_logs(run_dir, None if fresh else progress.step, tensorboard) if rank == 0 and run_dir else []
        sinks += [on_log] if on_log is not None and rank == 0 else []
        run = _Run(model, optimizer, cfg, run_dir, tokenizer, precision, progress, sinks, world)
        stack.callback(run.close)
        stop = stack.enter_context(_StopOnSigterm())
        step, saved_at = progress.step, progress.step
        model.train()
        if fresh and cfg.eval_every and validate is not None:
            run.log({"step": 0, **run.validate(validate, 0)})
        t0 = time.perf_counter()
        while step < cfg.max_steps:
            torch.manual_seed(_step_seed(cfg.seed, step, rank))   # dropout masks: a function of the step
            lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.decay, cfg.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = _to(data.batch(step, cfg.batch_size, rank=rank, world_size=world), device)
            out = train_step(fwd, objective, optimizer, _micro_batches(batch, micro), params, cfg.grad_clip, world,
                             lambda: autocast(precision, device))
            n_tokens, ok = out.pop("_tokens"), out.pop("_ok")
            step += 1
            progress.skipped += not ok
            progress.tokens += n_tokens
            row = {"step": step, **out, "lr": lr, "tokens_per_s": n_tokens / (time.perf_counter() - t0),
                   "tokens": progress.tokens, "skipped": progress.skipped, **({} if ok else {"nonfinite": True})}
            if validate is not None and (cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.max_steps):
                row.update(run.validate(validate, step))
            run.log(row)
            stopping = stop.is_set()
            if world > 1:                          # every rank must stop at the same step
                stopping = _all_reduce({"stop": float(stopping)}, device)["stop"] > 0
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps or stopping:
                run.checkpoint(step)
                saved_at = step
            if stopping:
                break
            t0 = time.perf_counter()
    return {"step": step, "skipped": progress.skipped, "stopped": stop.is_set(), "saved_at": saved_at,
            "rows": run.rows, "best": progress.best, "precision": precision}
