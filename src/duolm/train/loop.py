"""The one training loop: pretraining and fine-tuning of both families, one process or many (torchrun).

    for step in range(start, max_steps):
        lr <- lr_at(step)                          schedule is a pure function of the step
        rows of this rank <- data.batch(step)      data is a pure function of (seed, step): resume = same step
        norm <- predicted items in the whole step  (all micro-batches, all ranks)
        for each micro-batch: backward(loss / norm)   so k micro-batches of B/k == one batch of B
        clip; skip the update if loss or gradient norm is not finite; AdamW step
        log; validate every eval_every; checkpoint every checkpoint_every or on SIGTERM

Exact resume: weights (via duolm.checkpoint), AdamW state and the step are saved; everything else that
decides a step (the batch, dropout masks) is a function of (seed, step, rank), because the global RNG is
re-seeded from them at every step. So N steps + kill + resume + N steps == 2N steps, bit for bit.

Checkpoint layout (only rank 0 writes):
    RUN/ckpt-00000100/   config.json, model.safetensors, tokenizer files, train_state.pt
    RUN/checkpoint.json  {"latest": "ckpt-00000100", "step": 100, "checkpoints": [...]}
A checkpoint is written to RUN/.tmp-ckpt-XXXXXXXX, renamed into place, and only then named by the
manifest (written atomically, last): a checkpoint the manifest does not name is never loaded.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from duolm.train.logs import JsonlWriter, TensorBoardWriter, plot_curves, read_jsonl
from duolm.train.objectives import Objective
from duolm.train.optim import lr_at, make_optimizer

MANIFEST = "checkpoint.json"


@dataclass
class TrainConfig:
    max_steps: int
    batch_size: int                      # global: sequences per optimizer step, over all ranks and micro-batches
    micro_batch_size: int | None = None  # sequences per forward on one rank (None: the rank's whole share)
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay: str = "cosine"                # "cosine" | "linear" | "constant"
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0               # 0: no clipping (the norm is still computed and logged)
    eval_every: int = 0                  # 0: validate only at the end (when val data is given)
    eval_batches: int | None = 20
    checkpoint_every: int = 0            # 0: only at the end and on SIGTERM
    keep_last: int = 3
    seed: int = 0
    compile: bool = False                # torch.compile the model for training steps
    bf16: bool = True                    # bf16 autocast, CUDA only

    def __post_init__(self):
        for name in ("max_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.keep_last < 1:
            raise ValueError(f"keep_last={self.keep_last} must be >= 1")


def _world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(values: dict, device) -> dict:
    """Sums a dict of numbers over ranks (identity in one process)."""
    if not values or _world()[1] == 1:
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

def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def read_manifest(run_dir) -> dict | None:
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _write_json_atomic(path: Path, obj):
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _crash(hook, step, stage):
    """Test hook: SIGKILL this process at a named point, to prove a kill there loses nothing."""
    if hook is not None and hook == (step, stage):
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(run_dir, step: int, model: nn.Module, state: dict, tokenizer=None, keep_last: int = 3,
                    crash_hook=None) -> Path:
    """Writes RUN/ckpt-<step>/ (model dir + train_state.pt) via a temp dir, then the manifest, then prunes."""
    from duolm.checkpoint import save

    run_dir = Path(run_dir)
    name = ckpt_name(step)
    tmp, final = run_dir / (".tmp-" + name), run_dir / name
    shutil.rmtree(tmp, ignore_errors=True)
    save(model, tmp, tokenizer=tokenizer)
    _crash(crash_hook, step, "save")                       # model written, train state not yet
    with open(tmp / "train_state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():                                     # left by a run killed before its manifest named it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _crash(crash_hook, step, "renamed")                    # complete on disk, but not in the manifest yet
    old = read_manifest(run_dir) or {}
    kept = [c for c in old.get("checkpoints", []) if c != name and int(c.split("-")[1]) < step]
    kept = (kept + [name])[-keep_last:]
    _write_json_atomic(run_dir / MANIFEST, {"latest": name, "step": step, "checkpoints": kept})
    for p in run_dir.glob("ckpt-*"):                       # older ones past keep_last, and orphans
        if p.name not in kept:
            shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob(".tmp-ckpt-*"):
        shutil.rmtree(p, ignore_errors=True)
    return final


def load_train_state(run_dir, model: nn.Module) -> dict | None:
    """Loads the newest complete checkpoint of a run into `model`; returns its train state (None: no checkpoint)."""
    from duolm.checkpoint import latest_checkpoint, load

    if read_manifest(run_dir) is None:
        return None
    ckpt = latest_checkpoint(run_dir)
    saved, _ = load(ckpt)
    try:
        model.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        raise ValueError(f"{ckpt} does not fit this model (different config?): {e}") from None
    return torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=True)


# --- evaluation -------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, batches, micro_batch_size: int | None = None,
             autocast=contextlib.nullcontext) -> dict:
    """Mean loss (and the objective's metrics) over `batches` (this rank's share), summed over ranks."""
    device = next(model.parameters()).device
    batches = [_to(b, device) for b in batches]
    micros = [m for b in batches for m in (_micro_batches(b, micro_batch_size) if micro_batch_size else [b])]
    counts = {}
    for m in micros:
        _add(counts, objective.counts(m))
    norm = {k: max(v, 1) for k, v in _all_reduce(counts, device).items()}
    was_training = model.training
    model.eval()
    total = {}
    for m in micros:
        with autocast():
            _, metrics = objective.loss(objective.forward(model, m), m, norm)
        _add(total, metrics)
    model.train(was_training)
    return _all_reduce(total, device)


# --- the loop ---------------------------------------------------------------------------------

def train(model: nn.Module, objective: Objective, data, cfg: TrainConfig, run_dir=None, *, val_data=None,
          tokenizer=None, resume: bool = False, on_log=None, crash_hook=None) -> dict:
    """Trains `model` (already on its device) in place; returns {"step", "skipped", "stopped", "rows"}.

    data: has .batch(step, batch_size, rank, world_size) -> this rank's rows of the step's global batch
          (a pure function of the step, e.g. duolm.data.CausalBatches / BertBatches).
    val_data: has .eval_batches(batch_size, rank, world_size, max_batches), or None.
    run_dir: where rank 0 writes metrics.jsonl, tb/, loss.png and checkpoints (None: nothing is written).
    resume: continue from the newest complete checkpoint in run_dir (a fresh start when there is none).
    on_log(row): called on rank 0 with every metrics row (the CLI draws its progress bar from it).
    crash_hook: (step, "step" | "save" | "renamed") SIGKILLs the process there (tests only).
    Torch.distributed, when initialised (torchrun), makes this DDP: the global batch is split over ranks.
    """
    rank, world = _world()
    device = next(model.parameters()).device
    per_rank = cfg.batch_size // world
    if per_rank * world != cfg.batch_size:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {world}")
    micro = cfg.micro_batch_size or per_rank
    if per_rank % micro:
        raise ValueError(f"each of {world} process(es) gets {per_rank} sequences per step, which is not a multiple "
                         f"of --micro-batch-size {micro}")
    writer = rank == 0 and run_dir is not None
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)

    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps)
    start, skipped, tokens_seen = 0, 0, 0
    if resume and run_dir is not None:
        state = load_train_state(run_dir, model)
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            start, skipped, tokens_seen = state["step"], state["skipped"], state["tokens"]

    fwd = ddp = model
    if world > 1:
        fwd = ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if cfg.compile:
        fwd = torch.compile(fwd)
    if device.type == "cuda" and cfg.bf16:
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext
    params = [p for p in model.parameters() if p.requires_grad]

    jsonl = JsonlWriter(Path(run_dir) / "metrics.jsonl", keep_until_step=start) if writer else None
    tb = TensorBoardWriter(Path(run_dir) / "tb") if writer else None
    stop = threading.Event()
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def log(row):
        rows.append(row)
        if writer:
            jsonl.write(row)
            tb.scalars(row["step"], {k: v for k, v in row.items() if k != "step"})
            if on_log is not None:
                on_log(row)

    def validate(step):
        if val_data is None:
            return {}
        batches = val_data.eval_batches(cfg.batch_size, rank=rank, world_size=world, max_batches=cfg.eval_batches)
        return {"val_" + k: v for k, v in evaluate(model, objective, batches, micro, autocast).items()}

    def checkpoint(step):
        if writer:
            state = {"step": step, "optimizer": optimizer.state_dict(), "skipped": skipped, "tokens": tokens_seen,
                     "seed": cfg.seed, "config": asdict(cfg)}
            save_checkpoint(run_dir, step, model, state, tokenizer, cfg.keep_last, crash_hook)
        if world > 1:
            dist.barrier()

    rows: list[dict] = []
    model.train()
    step, saved_at = start, start
    try:
        if start == 0 and cfg.eval_every and val_data is not None:
            log({"step": 0, **validate(0)})
        t0 = time.perf_counter()
        while step < cfg.max_steps:
            torch.manual_seed(_step_seed(cfg.seed, step, rank))   # dropout masks: a function of the step
            lr = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.decay, cfg.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micros = _micro_batches(_to(data.batch(step, cfg.batch_size, rank=rank, world_size=world), device), micro)
            counts = {}
            for m in micros:
                _add(counts, objective.counts(m))
            norm = _all_reduce(counts, device)      # predicted items in the whole step, all ranks
            total, n_tokens = {}, 0
            for i, m in enumerate(micros):
                # DDP averages gradients over ranks; losses are already divided by the global count, so undo it
                sync = world == 1 or i == len(micros) - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    with autocast():
                        loss, metrics = objective.loss(objective.forward(fwd, m), m, norm)
                    (loss * world).backward()
                _add(total, metrics)
                n_tokens += objective.tokens(m)
            total = _all_reduce({**total, "_tokens": n_tokens}, device)
            n_tokens = int(total.pop("_tokens"))
            grad_norm = float(nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
            ok = math.isfinite(total["loss"]) and math.isfinite(grad_norm)
            if ok:
                optimizer.step()
            else:
                skipped += 1                       # a bad batch must not poison the weights
            optimizer.zero_grad(set_to_none=True)
            _crash(crash_hook, step + 1, "step")
            step += 1
            tokens_seen += n_tokens
            t1 = time.perf_counter()
            row = {"step": step, **total, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": n_tokens / (t1 - t0),
                   "tokens": tokens_seen, "skipped": skipped}
            if not ok:
                row["nonfinite"] = True
            if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.max_steps:
                row.update(validate(step))
            log(row)
            stopping = stop.is_set()
            if world > 1:                          # every rank must stop at the same step
                stopping = _all_reduce({"stop": float(stopping)}, device)["stop"] > 0
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.max_steps or stopping:
                checkpoint(step)
                saved_at = step
            if stopping:
                break
            t0 = time.perf_counter()
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        if writer:
            jsonl.close()
            tb.close()
            history = read_jsonl(Path(run_dir) / "metrics.jsonl")
            curves = {"train": [(r["step"], r["loss"]) for r in history if "loss" in r],
                      "val": [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]}
            plot_curves(Path(run_dir) / "loss.png", curves)
    return {"step": step, "skipped": skipped, "stopped": stop.is_set(), "saved_at": saved_at, "rows": rows}
