"""Fine-tuning as one library call: finetune() on a sentence task (GLUE, the user's labelled texts), NER
(CoNLL-2003) or SQuAD, with the papers' recipes, several seeds and a learning-rate grid; predict() and
evaluate_task() for the fine-tuned model whatever its head.

A task is a batch source plus a loss (duolm.train.sentence_tasks, duolm.train.token_tasks prepare them);
every run is the one train() loop, with the dev metrics after every epoch and the best model kept.
"""
from __future__ import annotations

import math
import multiprocessing
import shutil
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from duolm.checkpoint import load
from duolm.data.features import TaskBatches
from duolm.data.tasks import GLUE
from duolm.fileio import write_json, write_text
from duolm.models import GPT2
from duolm.models.heads import HEAD_MODELS, attach_head
from duolm.runs import read_manifest, read_metrics, replace_folder
from duolm.train import sentence_tasks, token_tasks
from duolm.train.logs import plot_run
from duolm.train.loop import TrainConfig, train

# --- the recipe ------------------------------------------------------------------------------------

def _opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


# The papers' recipes: BERT section 4 / appendix A.3, GPT-1 section 4.1 ("fine-tuning details").
RECIPES = {"bert": {"lr": 2e-5, "warmup": 0.1, "lm_coef": 0.0}, "gpt2": {"lr": 6.25e-5, "warmup": 0.002, "lm_coef": 0.5}}
TOKEN_TASK_LR = 5e-5                # BERT section 4.2 (SQuAD v1.1: 5e-5, batch 32, 3 epochs); NER alike
LR_GRID = (5e-5, 3e-5, 2e-5)        # BERT's grid, chosen on dev


@dataclass
class FinetuneConfig:
    """How to fine-tune; the CLI's flags are these fields. None: the paper's value for the model's family
    (BERT: lr 2e-5, 10% warmup; GPT-1: lr 6.25e-5, 0.2% warmup, lm_coef 0.5)."""
    lr: float | None = _opt(None, "peak learning rate (BERT 2e-5, GPT 6.25e-5)")
    lr_grid: bool = _opt(False, f"try the BERT paper's grid {LR_GRID} and keep the best on dev")
    batch_size: int = _opt(32, "examples per optimizer step")
    micro_batch_size: int | None = _opt(None, "examples per forward (default: the whole batch)")
    epochs: float = _opt(3.0, "passes over the training set")
    warmup: float | None = _opt(None, "share of the steps with linear warmup (BERT 0.1, GPT 0.002); linear decay after")
    weight_decay: float = _opt(0.01, "AdamW weight decay of the matrices")
    dropout: float = _opt(0.1, "dropout of the backbone and the head")
    max_length: int | None = _opt(None, "tokens per input at most (128; SQuAD 384); longer inputs are cut, and counted")
    lm_coef: float | None = _opt(None, "GPT: weight of the auxiliary LM loss (0.5; 0 disables it)")
    both_orders: bool = _opt(False, "GPT sentence pairs: also feed B<d>A and sum the two states (GPT-1 similarity)")
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0: off)")
    eval_every: int = _opt(0, "also validate every N steps (0: after every epoch)")
    seed: int = _opt(0, "first seed; seeds are seed, seed+1, ...")
    seeds: int = _opt(1, "runs with different seeds (results.json: each, mean, std, best)")
    jobs: int = _opt(1, "runs at once in worker processes (GPUs dealt out round-robin; no progress bar)")
    select: str = _opt("mean", "several seeds: report the mean, or keep the best on dev (BERT's restarts)",
                       choices=("mean", "best"))
    dev_fraction: float = _opt(0.0, "without a dev file, hold out this last share of train (SQuAD: of its articles)")
    max_train_examples: int = _opt(0, "train on the first N training examples only (NER: sentences, SQuAD: "
                                       "questions; 0: all)")
    context: str = _opt("sentence", "NER: each sentence alone, or with its document around it (BERT)",
                        choices=("sentence", "document"))
    stride: int = _opt(128, "SQuAD: pieces between the starts of a long context's windows")
    compile: bool = _opt(False, "torch.compile the model for training")

    def __post_init__(self):
        for name in ("batch_size", "seeds", "max_length", "stride", "jobs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_train_examples < 0:
            raise ValueError(f"max_train_examples={self.max_train_examples} must be >= 0 (0: all)")
        if self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs} must be > 0")

    def resolved(self, family: str, kind: str = "classify") -> "FinetuneConfig":
        """A copy with every None replaced by the recipe of the family and the kind of task."""
        recipe = {**RECIPES[family], "max_length": 384 if kind == "span" else 128}
        if kind in ("tag", "span"):
            recipe["lr"] = TOKEN_TASK_LR
        return replace(self, **{k: v for k, v in recipe.items() if getattr(self, k) is None})


# --- models in, predictions out ---------------------------------------------------------------------

def load_pretrained(path, device="cpu"):
    """-> (model, tokenizer, family) of a model to fine-tune: a duolm or HF GPT-2 / BERT directory or a run."""
    model, tok = load(path, device)
    if isinstance(model, HEAD_MODELS):
        raise ValueError(f"{path} is already fine-tuned (a {model.head.kind} head for task {model.head.task!r}); "
                         f"use it with `duolm predict` / `duolm evaluate`, or fine-tune its base model")
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files (vocab.txt, or vocab.json + merges.txt) to encode the task")
    return model, tok, "gpt2" if isinstance(model, GPT2) else "bert"


def load_finetuned(path, device="cpu"):
    """-> (head model, tokenizer) of a fine-tuned model directory or run (a run's best/ model)."""
    model, tok = load(path, device)
    if not isinstance(model, HEAD_MODELS):
        raise ValueError(f"{path} holds a {type(model).__name__} without a fine-tuning head; fine-tune it first "
                         f"(duolm finetune {path} --task ...)")
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files (vocab.txt, or vocab.json + merges.txt)")
    return model, tok


def predict(model, tokenizer, inputs, batch_size: int = 64) -> list:
    """Predictions of a fine-tuned model, whatever its head: classify / regress: texts or (text, text) pairs ->
    {"label", "probabilities"} / {"score"}; tag: texts -> their entities; span: (question, context) pairs ->
    {"answer", "start", "end", "score"}."""
    tasks = token_tasks if model.head.kind in ("tag", "span") else sentence_tasks
    return tasks.predict(model, tokenizer, inputs, batch_size)


# --- fine-tuning -------------------------------------------------------------------------------------

def _untrained_as_baseline(validate, fresh: bool):
    """train() validates a fresh run once before its first step: those metrics are logged as init_<metric>
    (the untrained model's baseline), so that neither best/ nor the results can be the untrained model."""
    calls = [0 if fresh else 1]

    def wrapped(model):
        calls[0] += 1
        out = validate(model)
        return {"init_" + k.removeprefix("val_"): v for k, v in out.items()} if calls[0] == 1 else out
    return wrapped


def _one_run(base, tok, task: dict, cfg: FinetuneConfig, lr: float, seed: int, run_dir, device, resume,
             on_log) -> dict:
    """One seed at one learning rate: train() with the task's batches, loss and validation; -> the dev metrics
    of the best evaluation (by the task's first metric)."""
    torch.manual_seed(seed)                                  # the new layer's initial weights
    model = attach_head(base, task["head"], cfg.dropout).to(device)
    per_epoch, max_steps = _steps(task["train"], cfg)
    main = "val_" + task["metrics"][0]
    tc = TrainConfig(max_steps=max_steps, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size, lr=lr,
                     warmup_steps=round(cfg.warmup * max_steps), decay="linear", weight_decay=cfg.weight_decay,
                     betas=(0.9, 0.999), eps=1e-6, grad_clip=cfg.grad_clip, eval_every=cfg.eval_every or per_epoch,
                     checkpoint_every=per_epoch, keep_last=1, seed=seed, compile=cfg.compile, select_metric=main)
    out = train(model, task["objective"], TaskBatches(task["train"], seed, task["collate"]), tc, run_dir,
                validate=_untrained_as_baseline(task["validate"], fresh=not (resume and read_manifest(run_dir))),
                tokenizer=tok, resume=resume, on_log=on_log)
    if out["stopped"]:
        raise InterruptedError(f"stopped by SIGTERM at step {out['step']} of {run_dir} (saved; --resume continues)")
    plot_run(run_dir)
    evals = [r for r in read_metrics(run_dir) if isinstance(r.get(main), float) and not math.isnan(r[main])]
    best = max(evals, key=lambda r: r[main]) if evals else {"step": max_steps}
    return {"run": Path(run_dir).name, "lr": lr, "seed": seed, "step": best["step"],
            "epoch": round(best["step"] / per_epoch, 2),
            "metrics": {k[4:]: v for k, v in best.items() if k.startswith("val_")}}


def _steps(train_feats, cfg: FinetuneConfig) -> tuple[int, int]:
    """(steps per epoch, steps in all) of a run."""
    per_epoch = TaskBatches(train_feats).steps_per_epoch(cfg.batch_size)
    return per_epoch, max(1, round(cfg.epochs * per_epoch))


def _prepare(task, tok, family, cfg, block_size, files: dict) -> dict:
    tasks = sentence_tasks if token_tasks.kind_of(task) is None else token_tasks
    return tasks.prepare(task, tok, family, cfg, block_size, **files)


def _job(model, task, files, cfg, lr, seed, run_dir, device, resume, threads) -> dict:
    """One run in a worker process: load, prepare, train (no progress reports cross the process border)."""
    torch.set_num_threads(threads)
    base, tok, family = load_pretrained(model, device)
    prepared = _prepare(task, tok, family, cfg, base.config.block_size, files)
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


def finetune(model, task: str, run_dir, config: FinetuneConfig | None = None, *, data=None, train_file=None,
             dev_file=None, text_column: str = "text", pair_column: str | None = None, label_column: str = "label",
             device: str | None = None, resume: bool = False, on_start=None, on_log=None) -> dict:
    """Fine-tune `model` (a GPT-2 / BERT directory or run) on `task` into `run_dir`; returns the results.

    task: a GLUE task with its folder `data` (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli);
    "classify" / "regress" with the user's train_file / dev_file and their column names; "conll2003" with
    its folder (eng.train, eng.testa) or "ner" with CoNLL-format files; "squad" with SQuAD json files.
    Every seed (and learning rate of the grid) is a run of the one train() loop with dev metrics after every
    epoch and the best model kept in best/; several runs go to run_dir/seed-S (lr-L-seed-S), the best one's
    model is copied to run_dir/best. run_dir/results.json and results.md hold each run's best dev metrics,
    mean and std over the seeds, and the best run. on_start(info) is called once the data is encoded
    (sizes, notes, truncated counts); on_log(row) with every row of every run.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base, tok, family = load_pretrained(model, dev)
    kind = token_tasks.kind_of(task)
    cfg = (config or FinetuneConfig()).resolved(family, kind)
    files = dict(data=data, train_file=train_file, dev_file=dev_file)
    if kind is None:
        files.update(text_column=text_column, pair_column=pair_column, label_column=label_column)
    prepared = _prepare(task, tok, family, cfg, base.config.block_size, files)
    lrs = LR_GRID if cfg.lr_grid else (cfg.lr,)
    info = {"model": str(model), "family": family, "device": str(dev), **prepared["info"],
            "metric": prepared["metrics"][0], "runs": len(lrs) * cfg.seeds, "steps": _steps(prepared["train"], cfg)[1],
            "max_length": prepared["head"].max_length, "config": asdict(cfg)}
    if on_start is not None:
        on_start(info)
    run_dir = Path(run_dir)
    single = len(lrs) == 1 and cfg.seeds == 1
    plan = [(lr, seed, run_dir if single else run_dir / (f"seed-{seed}" if len(lrs) == 1 else f"lr-{lr:g}-seed-{seed}"))
            for lr in lrs for seed in range(cfg.seed, cfg.seed + cfg.seeds)]
    if cfg.jobs > 1 and len(plan) > 1:
        runs_ = _parallel(model, task, files, cfg, plan, dev, resume)
    else:
        runs_ = [_one_run(base, tok, prepared, cfg, lr, seed, sub, dev, resume, on_log) for lr, seed, sub in plan]
    results = {**info, **summarize(runs_, info["metric"], cfg.select)}
    if not single:
        best = run_dir / results["best"]["run"] / "best"
        replace_folder(run_dir / "best", lambda d: [shutil.copy2(f, d / f.name) for f in best.iterdir()])
    write_json(run_dir / "results.json", results)
    write_text(run_dir / "results.md", results_table(results))
    return results


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
    results = {name: finetune(model, name, Path(run_dir) / name, config, data=Path(data_dir) / GLUE[name].folder, **kw)
               for name in found}
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
