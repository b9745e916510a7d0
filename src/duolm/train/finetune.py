"""Fine-tuning as one library call: finetune() on any task of duolm.tasks (GLUE, the user's labelled texts, NER,
SQuAD, multiple choice) with the papers' recipes, several seeds and a learning-rate grid.

A task (duolm.tasks.prepare) is a batch source, a loss and a validation; every run is the one train() loop,
with the dev metrics after every epoch and the best model kept. This module is the recipe: seeds, the rate
grid, selection over runs, the results files.
"""
from __future__ import annotations

import math
import multiprocessing
import shutil
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from duolm import tasks
from duolm.checkpoint import load, save
from duolm.config import opt
from duolm.convert.st import Pooling, read_pooling
from duolm.fileio import write_json, write_text
from duolm.models.heads import HEAD_MODELS, attach_head
from duolm.precision import resolve
from duolm.runs import read_metrics, replace_folder
from duolm.tasks import Files, TaskBatches, TaskOptions
from duolm.tasks.glue import GLUE
from duolm.train.logs import plot_run
from duolm.train.loop import TrainConfig, train
from duolm.train.parallel import process_group, rank_world

# --- the recipe ------------------------------------------------------------------------------------

# The papers' recipes: BERT section 4 / appendix A.3, GPT-1 section 4.1 ("fine-tuning details").
RECIPES = {"bert": {"lr": 2e-5, "warmup": 0.1, "lm_coef": 0.0}, "gpt2": {"lr": 6.25e-5, "warmup": 0.002, "lm_coef": 0.5}}
TOKEN_TASK_LR = 5e-5                # BERT section 4.2 (SQuAD v1.1: 5e-5, batch 32, 3 epochs); NER alike
LR_GRID = (5e-5, 3e-5, 2e-5)        # BERT's grid, chosen on dev
# How the loop runs for fine-tuning: BERT's AdamW (betas 0.9 / 0.999, eps 1e-6, weight decay 0.01), linear decay,
# validation after every epoch (eval_every 0), the newest checkpoint kept. Steps, warmup and lr come from the recipe.
FINETUNE_LOOP = TrainConfig(batch_size=32, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6, decay="linear",
                            eval_every=0, keep_last=1)
# The loop's fields a fine-tuning user sets (flags of `duolm finetune`, with help where it differs from
# pretraining's); the others follow from the recipe.
LOOP_OPTIONS = {"batch_size": "examples per optimizer step", "micro_batch_size": "examples per forward (default: "
                "the whole batch)", "weight_decay": None, "grad_clip": None, "eval_every": "also validate every N "
                "steps (0: after every epoch)", "seed": "first seed; seeds are seed, seed+1, ...", "compile": None,
                "precision": None, "activation_checkpointing": None, "parallel": None}


@dataclass
class FinetuneConfig:
    """How to fine-tune; the CLI's flags are these fields, those of `inputs` and the LOOP_OPTIONS of `loop`.
    None: the paper's value for the model's family (BERT: lr 2e-5, 10% warmup; GPT-1: lr 6.25e-5, 0.2% warmup,
    lm_coef 0.5). loop.eval_every 0: validate after every epoch."""
    loop: TrainConfig = opt(FINETUNE_LOOP, "the training loop", fields=LOOP_OPTIONS)
    inputs: TaskOptions = opt(TaskOptions(), "how the task's inputs are made")
    lr: float | None = opt(None, "peak learning rate (BERT 2e-5, GPT 6.25e-5)")
    lr_grid: bool = opt(False, f"try the BERT paper's grid {LR_GRID} and keep the best on dev")
    epochs: float = opt(3.0, "passes over the training set")
    warmup: float | None = opt(None, "share of the steps with linear warmup (BERT 0.1, GPT 0.002); linear decay after")
    dropout: float = opt(0.1, "dropout of the backbone and the head")
    lm_coef: float | None = opt(None, "GPT: weight of the auxiliary LM loss (0.5; 0 disables it)")
    seeds: int = opt(1, "runs with different seeds (results.json: each, mean, std, best); the first is --seed")
    jobs: int = opt(1, "runs at once in worker processes (GPUs dealt out round-robin; no progress bar)")
    select: str = opt("mean", "several seeds: report the mean, or keep the best on dev (BERT's restarts)",
                      choices=("mean", "best"))

    def __post_init__(self):
        for name in ("seeds", "jobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs} must be > 0")

    def resolved(self, family: str, kind: str = "classify") -> "FinetuneConfig":
        """A copy with every None replaced by the recipe of the family and the kind of task."""
        recipe = dict(RECIPES[family])
        if kind in ("tag", "span"):
            recipe["lr"] = TOKEN_TASK_LR
        return replace(self, **{k: v for k, v in recipe.items() if getattr(self, k) is None})


# --- models in ---------------------------------------------------------------------------------------

def load_pretrained(path, device="cpu"):
    """-> (model, tokenizer, family) of a model to fine-tune: a duolm or HF GPT-2 / BERT directory or a run."""
    model, tok = load(path, device)
    if isinstance(model, HEAD_MODELS):
        raise ValueError(f"{path} is already fine-tuned (a {model.head.kind} head for task {model.head.task!r}); "
                         f"use it with `duolm predict` / `duolm evaluate`, or fine-tune its base model")
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files (vocab.txt, or vocab.json + merges.txt) to encode the task")
    return model, tok, model.config.family


# --- fine-tuning -------------------------------------------------------------------------------------

def _one_run(base, tok, task: tasks.Prepared, cfg: FinetuneConfig, lr: float, seed: int, run_dir, device, resume,
             on_log) -> dict:
    """One seed at one learning rate: train() with the task's batches, loss and validation; -> the dev metrics
    of the best evaluation (by the task's first metric). Values chosen on dev by validation (SQuAD v2.0's
    null_threshold) are saved into the best model's head."""
    torch.manual_seed(seed)                                  # the new layer's initial weights
    model = attach_head(base, task.head, cfg.dropout).to(device)
    per_epoch, max_steps = _steps(task.train, cfg)
    main = "val_" + task.metrics[0]
    tc = replace(cfg.loop, max_steps=max_steps, lr=lr, warmup_steps=round(cfg.warmup * max_steps),
                 eval_every=cfg.loop.eval_every or per_epoch, checkpoint_every=per_epoch, seed=seed, select_metric=main)
    batch_size = 2 * cfg.loop.batch_size

    def validate(model, step):             # the untrained model's scores at step 0, as init_*: never the best
        metrics = task.validate(model, tok, batch_size)
        return metrics if step else {"init_" + k.removeprefix("val_"): v for k, v in metrics.items()}
    out = train(model, task.objective, TaskBatches(task.train, seed), tc, run_dir, validate=validate, tokenizer=tok,
                resume=resume, on_log=on_log)
    if out["stopped"]:
        raise InterruptedError(f"stopped by SIGTERM at step {out['step']} of {run_dir} (saved; --resume continues)")
    evals = [r for r in read_metrics(run_dir) if isinstance(r.get(main), float) and not math.isnan(r[main])]
    best = max(evals, key=lambda r: r[main]) if evals else {"step": max_steps}
    metrics = {k[4:]: v for k, v in best.items() if k.startswith("val_")}
    if rank_world()[0] == 0:                                 # (every rank validates alike; rank 0 writes)
        plot_run(run_dir)
        if "null_threshold" in metrics and (Path(run_dir) / "best").is_dir():
            _save_into_head(Path(run_dir) / "best", null_threshold=metrics["null_threshold"])
    return {"run": Path(run_dir).name, "lr": lr, "seed": seed, "step": best["step"],
            "epoch": round(best["step"] / per_epoch, 2), "metrics": metrics}


def _save_into_head(model_dir: Path, **learned) -> None:
    """The model in model_dir with fields of its HeadConfig set to values learned on dev, saved in its place."""
    model, tok = load(model_dir)
    model.head = replace(model.head, **learned)
    replace_folder(model_dir, lambda d: save(model, d, tokenizer=tok))


def _steps(train_feats, cfg: FinetuneConfig) -> tuple[int, int]:
    """(steps per epoch, steps in all) of a run."""
    per_epoch = TaskBatches(train_feats).steps_per_epoch(cfg.loop.batch_size)
    return per_epoch, max(1, round(cfg.epochs * per_epoch))


def _prepare(model, task: str, tok, family: str, cfg: FinetuneConfig, block_size: int, files: Files) -> tasks.Prepared:
    """The task prepared for `model` (a path); an embedding head pools as the model's sentence-transformers files
    say (mean, normalised, without them)."""
    prepared = tasks.prepare(task, tok, family, cfg.inputs, files, block_size, cfg.lm_coef if family == "gpt2" else 0.0)
    if prepared.head.kind == "embed":
        own = read_pooling(model, Pooling("mean"))
        prepared.head = replace(prepared.head, pooling=own.mode, normalize=own.normalize)
    return prepared


def _job(model, task, files, cfg, lr, seed, run_dir, device, resume, threads) -> dict:
    """One run in a worker process: load, prepare, train (no progress reports cross the process border)."""
    torch.set_num_threads(threads)
    base, tok, family = load_pretrained(model, device)
    prepared = _prepare(model, task, tok, family, cfg, base.config.block_size, files)
    return _one_run(base, tok, prepared, cfg, lr, seed, run_dir, device, resume, None)


def _parallel(model, task, files, cfg, plan, device, resume) -> list[dict]:
    """The runs of `plan` in cfg.jobs spawned processes: CUDA devices dealt out round-robin, CPU threads split."""
    n = min(cfg.jobs, len(plan))
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    threads = max(1, torch.get_num_threads() // (1 if gpus else n))
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_job, str(model), task, files, cfg, lr, seed, sub,
                               f"cuda:{i % gpus}" if gpus else str(device), resume, threads)
                   for i, (lr, seed, sub) in enumerate(plan)]
        return [f.result() for f in futures]


def finetune(model, task: str, run_dir, config: FinetuneConfig | None = None, files: Files | None = None, *,
             device: str | None = None, resume: bool = False, on_start=None, on_log=None) -> dict:
    """Fine-tune `model` (a GPT-2 / BERT directory or run) on `task` into `run_dir`; returns the results.

    task (with its `files`): a GLUE task with its folder files.data (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte,
    wnli); "classify" / "regress" with the user's files.train / files.dev and their column names; "conll2003" with
    its folder (eng.train, eng.testa) or "ner" with CoNLL-format files; "squad" with SQuAD json files;
    "multiple-choice" with csv / jsonl files of context, ending0..N, label.
    Every seed (and learning rate of the grid) is a run of the one train() loop with dev metrics after every
    epoch and the best model kept in best/; several runs go to run_dir/seed-S (lr-L-seed-S), the best one's
    model is copied to run_dir/best. run_dir/results.json and results.md hold each run's best dev metrics,
    mean and std over the seeds, and the best run. on_start(info) is called once the data is encoded
    (sizes, notes, truncated counts); on_log(row) with every row of every run.
    Under torchrun every run spreads over the processes (cfg.loop.parallel: ddp or fsdp), one run after another;
    on_start and on_log are called, and the files written, on rank 0.
    """
    with process_group(device) as (dev, rank):
        base, tok, family = load_pretrained(model, dev)
        files = files or Files()
        cfg = (config or FinetuneConfig()).resolved(family, tasks.task(task).kinds[0])
        cfg = replace(cfg, loop=replace(cfg.loop, precision=resolve(cfg.loop.precision, dev, training=True)))
        prepared = _prepare(model, task, tok, family, cfg, base.config.block_size, files)
        lrs = LR_GRID if cfg.lr_grid else (cfg.lr,)
        seeds = range(cfg.loop.seed, cfg.loop.seed + cfg.seeds)
        info = {"model": str(model), "family": family, "device": str(dev), **prepared.info,
                "metric": prepared.metrics[0], "runs": len(lrs) * cfg.seeds, "steps": _steps(prepared.train, cfg)[1],
                "max_length": prepared.head.max_length, "precision": cfg.loop.precision,
                "config": asdict(cfg)}
        if on_start is not None and rank == 0:
            on_start(info)
        run_dir = Path(run_dir)
        single = len(lrs) == 1 and cfg.seeds == 1
        plan = [(lr, seed, run_dir if single else
                 run_dir / (f"seed-{seed}" if len(lrs) == 1 else f"lr-{lr:g}-seed-{seed}")) for lr in lrs for seed in seeds]
        if cfg.jobs > 1 and len(plan) > 1:
            if rank_world()[1] > 1:
                raise ValueError(f"jobs={cfg.jobs} runs seeds in worker processes of one process; under torchrun "
                                 f"the runs take turns over all the processes: jobs 1")
            runs_ = _parallel(model, task, files, cfg, plan, dev, resume)
        else:
            runs_ = [_one_run(base, tok, prepared, cfg, lr, seed, sub, dev, resume, on_log) for lr, seed, sub in plan]
        results = {**info, **summarize(runs_, info["metric"], cfg.select)}
        if rank == 0:
            _write_results(run_dir, results, single)
        return results


def _write_results(run_dir: Path, results: dict, single: bool) -> None:
    """results.json and results.md; with several runs, the best one's model copied to run_dir/best."""
    if not single:
        best = run_dir / results["best"]["run"] / "best"
        replace_folder(run_dir / "best", lambda d: [shutil.copy2(f, d / f.name) for f in best.iterdir()])
    write_json(run_dir / "results.json", results)
    write_text(run_dir / "results.md", results_table(results))


def summarize(runs: list[dict], metric: str, select: str = "mean") -> dict:
    """Mean and sample standard deviation of every dev metric over the seeds of the best learning rate (by the
    mean of `metric`), and the best run: the best seed of that rate, or with select="best" the best run of all.
    "result" is the headline: the mean, or the best run's metrics.

    Example: f1 0.80 and 0.90 at one rate -> mean f1 0.85, std 0.0707, best the 0.90 run."""
    def value(r, m=metric):
        v = r["metrics"].get(m, math.nan)
        return -math.inf if math.isnan(v) else v

    by_lr: dict = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    lr = max(by_lr, key=lambda k: statistics.fmean(value(r) for r in by_lr[k]))
    chosen = by_lr[lr]
    names = list(chosen[0]["metrics"])
    mean = {m: statistics.fmean(r["metrics"].get(m, math.nan) for r in chosen) for m in names}
    std = {m: statistics.stdev([r["metrics"].get(m, math.nan) for r in chosen]) if len(chosen) > 1 else 0.0
           for m in names}
    best = max(chosen if select == "mean" else runs, key=value)
    return {"runs": runs, "lr": lr, "seeds": len(chosen), "mean": mean, "std": std, "best": best, "select": select,
            "result": mean if select == "mean" else best["metrics"]}


def results_table(results: dict) -> str:
    """results.json as a markdown table: one row per run, then mean ± std (metrics x 100, as the papers)."""
    names = [m for m in results["mean"] if not m.endswith("loss")]
    pct = lambda v: f"{100 * v:.2f}"                                         # noqa: E731
    lines = [f"{results['task']} ({results['model']}): dev metrics at each run's best epoch by "
             f"{results['metric']}", "",
             "| run | lr | seed | epoch | " + " | ".join(names) + " |", "|---" * (4 + len(names)) + "|"]
    for r in results["runs"]:
        lines.append(f"| {r['run']} | {r['lr']:g} | {r['seed']} | {r['epoch']:g} | "
                     + " | ".join(pct(r["metrics"].get(m, math.nan)) for m in names) + " |")
    lines.append(f"| mean ± std ({results['seeds']} seed{'s' * (results['seeds'] > 1)}) | {results['lr']:g} | | | "
                 + " | ".join(f"{pct(results['mean'][m])} ± {pct(results['std'][m])}" for m in names) + " |")
    best = results["best"]
    lines += ["", f"best run: {best['run']} ({results['metric']} {pct(best['metrics'].get(results['metric'], math.nan))})"]
    return "\n".join(lines + [""] + [f"note: {n}" for n in results.get("notes", [])]) + "\n"


# --- the BERT paper's GLUE table ---------------------------------------------------------------------

# BERT-base in the paper's Table 1 (GLUE test server), in its column order: the task's main metric x 100.
BERT_BASE_GLUE = {"mnli": 84.6, "mnli-mm": 83.4, "qqp": 71.2, "qnli": 90.1, "sst2": 93.5, "cola": 52.1,
                  "stsb": 85.8, "mrpc": 88.9, "rte": 66.4}


def finetune_glue(model, data_dir, run_dir, config: FinetuneConfig | None = None, **kw) -> dict:
    """finetune() on every GLUE task whose folder (with train.tsv) is in data_dir, each into run_dir/<task>;
    writes run_dir/glue.md (glue_table) and returns {task: results}."""
    found = [name for name, t in GLUE.items() if (Path(data_dir) / t.folder / "train.tsv").is_file()]
    if not found:
        raise FileNotFoundError(f"{data_dir}: no GLUE task folder with a train.tsv ({', '.join(t.folder for t in GLUE.values())})")
    with process_group(kw.get("device")) as (_, rank):          # (under torchrun, joined once for every task)
        results = {name: finetune(model, name, Path(run_dir) / name, config,
                                  Files(data=Path(data_dir) / GLUE[name].folder), **kw)
                   for name in found}
        if rank == 0:
            write_text(Path(run_dir) / "glue.md", glue_table(results))
    return results


def glue_table(results: dict) -> str:
    """Table 1's layout: a column per task (its main metric x 100, mean over the seeds), the average of the
    columns present, and BERT-base's numbers from the paper on the same columns."""
    ours = {}
    for name, r in results.items():
        ours[name] = 100 * r["result"][r["metric"]]
        if "mm_accuracy" in r["result"]:
            ours["mnli-mm"] = 100 * r["result"]["mm_accuracy"]
    cols = [c for c in BERT_BASE_GLUE if c in ours]
    head = "| | " + " | ".join(c.upper().replace("SST2", "SST-2").replace("STSB", "STS-B") for c in cols) + " | Average |"
    row = lambda name, vals: f"| {name} | " + " | ".join(f"{v:.1f}" for v in vals) + f" | {statistics.fmean(vals):.1f} |"  # noqa: E731
    return "\n".join([head, "|---" * (len(cols) + 2) + "|", row("duolm (dev)", [ours[c] for c in cols]),
                      row("BERT-base (paper, test)", [BERT_BASE_GLUE[c] for c in cols])]) + "\n"
