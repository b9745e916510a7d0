"""Fine-tuning: the losses of the heads, and finetune() / predict() / evaluate_task() as library calls.

    L = CE(logits, label)                          classification (BERT section 4.1)
    L = (logit - y)^2                              regression (STS-B)
    L = L_task + lambda L_LM                       GPT-1 section 3.3: the LM loss on the same inputs helps
                                                   generalisation and convergence (lambda 0.5)

As in duolm.train.objectives, each loss is a sum divided by the step's count (norm["n"] inputs,
norm["lm"] predicted tokens), so micro-batches add up to the loss of the whole batch.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm.checkpoint import load
from duolm.data.features import Features, TaskBatches, eval_batches, encode_examples
from duolm.data.tasks import GLUE, Example, TaskData, load_task, write_submission
from duolm.evaluation.metrics import SEQUENCE_METRICS
from duolm.fileio import write_json, write_text
from duolm.models import GPT2
from duolm.models.heads import HEAD_MODELS, HeadConfig, attach_head
from duolm.runs import read_metrics, replace_folder
from duolm.train.logs import plot_run
from duolm.train.loop import TrainConfig, train
from duolm.train.objectives import IGNORE, Objective, causal_lm_loss


def sequence_counts(batch: dict) -> dict[str, int]:
    counts = {"n": int(batch["labels"].shape[0])}
    if "y" in batch:
        counts["lm"] = int((batch["y"] != IGNORE).sum())
    return counts


def classify_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of logits (B, n_labels) against batch["labels"] (B,) class ids; metrics loss, accuracy."""
    n = max((norm or sequence_counts(batch))["n"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float(), labels, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def regress_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Squared error of logits (B, 1) against batch["labels"] (B,) floats; metric loss (the mean)."""
    n = max((norm or sequence_counts(batch))["n"], 1)
    loss = F.mse_loss(logits.float().squeeze(-1), batch["labels"].float(), reduction="sum") / n
    return loss, {"loss": loss.detach()}


def with_lm_loss(task_loss, lm_coef: float):
    """GPT-1's L_task + lm_coef * L_LM over outputs (logits, lm_logits); metrics add task_loss and lm_loss."""
    def loss(outputs, batch: dict, norm: dict | None = None):
        logits, lm_logits = outputs
        norm = norm or sequence_counts(batch)
        task, metrics = task_loss(logits, batch, norm)
        if lm_logits is None:
            return task, metrics
        lm, _ = causal_lm_loss(lm_logits, batch, norm)
        total = task + lm_coef * lm
        return total, {**metrics, "task_loss": task.detach(), "lm_loss": lm.detach(), "loss": total.detach()}
    return loss


def sequence_objective(family: str, kind: str, lm_coef: float = 0.0) -> Objective:
    """The objective of a sentence (pair) task: BERT's classifier / regressor, or GPT's with lm_coef * L_LM."""
    if kind not in ("classify", "regress"):
        raise ValueError(f"a sentence task is classify or regress, not {kind!r}")
    task_loss = classify_loss if kind == "classify" else regress_loss
    if family == "bert":
        return Objective(forward=lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), loss=task_loss,
                         counts=sequence_counts, tokens=lambda b: b["idx"].numel())
    lm = lm_coef > 0
    return Objective(forward=lambda m, b: m(b["idx"], b["last"], lm=lm), loss=with_lm_loss(task_loss, lm_coef),
                     counts=sequence_counts if lm else (lambda b: {"n": int(b["labels"].shape[0])}),
                     tokens=lambda b: b["idx"].numel())


def tag_counts(batch: dict) -> dict[str, int]:
    return {"tokens": int((batch["labels"] != IGNORE).sum())}


def tag_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of logits (B, T, n_labels) at the labelled pieces (the first piece of each word); metrics
    loss and accuracy over those pieces."""
    n = max((norm or tag_counts(batch))["tokens"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def span_loss(outputs, batch: dict, norm: dict | None = None):
    """BERT's SQuAD loss: the mean of the start and end cross-entropies over the window's pieces (padding
    excluded, so it never changes the loss); a window without the answer points at [CLS] (position 0)."""
    start, end = outputs
    n = max((norm or {"n": start.shape[0]})["n"], 1)
    pad = batch["attention_mask"] == 0
    ce = lambda lg, y: F.cross_entropy(lg.float().masked_fill(pad, -math.inf), y, reduction="sum")   # noqa: E731
    loss = (ce(start, batch["start"]) + ce(end, batch["end"])) / (2 * n)
    return loss, {"loss": loss.detach()}


def token_objective(kind: str) -> Objective:
    """The objective of a token task: "tag" (NER) or "span" (SQuAD)."""
    forward = lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"])   # noqa: E731
    tokens = lambda b: b["idx"].numel()                                          # noqa: E731
    if kind == "tag":
        return Objective(forward=forward, loss=tag_loss, counts=tag_counts, tokens=tokens)
    if kind == "span":
        return Objective(forward=forward, loss=span_loss, counts=lambda b: {"n": int(b["start"].shape[0])},
                         tokens=tokens)
    raise ValueError(f"a token task is tag or span, not {kind!r}")


# --- the recipe ------------------------------------------------------------------------------------

def _opt(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


# The papers' recipes: BERT section 4 / appendix A.3, GPT-1 section 4.1 ("fine-tuning details").
RECIPES = {"bert": {"lr": 2e-5, "warmup": 0.1, "lm_coef": 0.0}, "gpt2": {"lr": 6.25e-5, "warmup": 0.002, "lm_coef": 0.5}}
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
    max_length: int = _opt(128, "tokens per input at most (longer inputs are cut, and counted)")
    lm_coef: float | None = _opt(None, "GPT: weight of the auxiliary LM loss (0.5; 0 disables it)")
    both_orders: bool = _opt(False, "GPT sentence pairs: also feed B<d>A and sum the two states (GPT-1 similarity)")
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0: off)")
    eval_every: int = _opt(0, "also validate every N steps (0: after every epoch)")
    seed: int = _opt(0, "first seed; seeds are seed, seed+1, ...")
    seeds: int = _opt(1, "runs with different seeds (results.json: each, mean, std, best)")
    select: str = _opt("mean", "several seeds: report the mean, or keep the best on dev (BERT's restarts)",
                       choices=("mean", "best"))
    dev_fraction: float = _opt(0.0, "without a dev file, hold out this last share of train as dev")
    compile: bool = _opt(False, "torch.compile the model for training")

    def __post_init__(self):
        for name in ("batch_size", "seeds", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.epochs <= 0:
            raise ValueError(f"epochs={self.epochs} must be > 0")

    def resolved(self, family: str) -> "FinetuneConfig":
        """A copy with every None replaced by the family's recipe."""
        return replace(self, **{k: v for k, v in RECIPES[family].items() if getattr(self, k) is None})


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


def encode(examples, tokenizer, head: HeadConfig) -> Features:
    return encode_examples(examples, tokenizer, head.max_length, head.labels, head.kind, head.both_orders)


@torch.no_grad()
def predict_logits(model, features: Features, batch_size: int = 64) -> torch.Tensor:
    """The head's outputs (N, n_out) for every example of `features`, in order (float32, on the CPU)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = torch.empty(len(features), model.head.n_out)
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    for index, batch in eval_batches(features, batch_size):
        b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with bf16:
            logits = model(b["idx"], b["segment_ids"], b["attention_mask"]) if features.family == "bert" else \
                model(b["idx"], b["last"])[0]
        out[index] = logits.float().cpu()
    model.train(was_training)
    return out


def scores(logits: torch.Tensor, features: Features, kind: str, metrics) -> dict[str, float]:
    """The task's metrics (names in duolm.evaluation.metrics.SEQUENCE_METRICS) and the mean loss."""
    gold = features.labels
    if kind == "regress":
        pred = logits[:, 0].tolist()
        loss = F.mse_loss(logits[:, 0], torch.tensor(gold)).item()
    else:
        pred = logits.argmax(-1).tolist()
        loss = F.cross_entropy(logits, torch.tensor(gold)).item()
    return {**{m: SEQUENCE_METRICS[m](pred, gold) for m in metrics}, "loss": loss}


def predict(model, tokenizer, texts, batch_size: int = 64) -> list[dict]:
    """Predictions of a fine-tuned head model for texts (str) or pairs ((str, str)), in order:
    {"label", "probabilities": {label: p}} (classify) or {"score"} (regress); "truncated": True marks an
    input that was cut to the model's max_length."""
    head = model.head
    examples = [Example(*t) if isinstance(t, (tuple, list)) else Example(t) for t in texts]
    feats = encode(examples, tokenizer, head)
    logits = predict_logits(model, feats, batch_size)
    if head.kind == "regress":
        out = [{"score": float(x)} for x in logits[:, 0]]
    else:
        probs = logits.softmax(-1)
        out = [{"label": head.labels[int(p.argmax())], "probabilities": dict(zip(head.labels, p.tolist()))}
               for p in probs]
    for i in feats.cut:
        out[i]["truncated"] = True
    return out


def evaluate_task(model, tokenizer, data: TaskData, batch_size: int = 64) -> dict[str, float]:
    """The task's metrics of a fine-tuned model on each dev set of `data` ({prefix + metric: value})."""
    if data.kind != model.head.kind or (data.labels and data.labels != model.head.labels):
        raise ValueError(f"the model predicts {model.head.kind} {model.head.labels or ''} (task {model.head.task!r}); "
                         f"the data is {data.kind} {data.labels or ''} (task {data.name!r})")
    out = {}
    for prefix, examples in data.dev.items():
        feats = encode(examples, tokenizer, model.head)
        out.update({prefix + k: v for k, v in scores(predict_logits(model, feats, batch_size), feats, data.kind,
                                                      data.metrics).items()})
    return out


def write_glue_predictions(model, tokenizer, data: TaskData, out_dir, batch_size: int = 64) -> list[Path]:
    """The GLUE submission files (SST-2.tsv, MNLI-m.tsv, ...) for the test files of `data`, into out_dir."""
    if not data.test:
        raise ValueError(f"no GLUE test file found for task {data.name!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, examples in data.test.items():
        logits = predict_logits(model, encode(examples, tokenizer, model.head), batch_size)
        preds = logits[:, 0].tolist() if data.kind == "regress" else [data.labels[i] for i in logits.argmax(-1)]
        written.append(write_submission(out_dir / name, examples, preds))
    return written


# --- fine-tuning -------------------------------------------------------------------------------------

def _validator(dev: dict, kind: str, metrics, batch_size: int):
    def validate(model):
        out = {}
        for prefix, feats in dev.items():
            out.update({f"val_{prefix}{k}": v for k, v in
                        scores(predict_logits(model, feats, batch_size), feats, kind, metrics).items()})
        return out
    return validate


def _one_run(base, tok, family, head, train_feats, dev_feats, data, cfg, lr, seed, run_dir, device, resume,
             on_log) -> dict:
    torch.manual_seed(seed)                                  # the new layer's initial weights
    model = attach_head(base, head, cfg.dropout).to(device)
    batches = TaskBatches(train_feats, seed)
    per_epoch, max_steps = _steps(train_feats, cfg)
    main = "val_" + data.metrics[0]
    tc = TrainConfig(max_steps=max_steps, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size, lr=lr,
                     warmup_steps=round(cfg.warmup * max_steps), decay="linear", weight_decay=cfg.weight_decay,
                     betas=(0.9, 0.999), eps=1e-6, grad_clip=cfg.grad_clip, eval_every=cfg.eval_every or per_epoch,
                     checkpoint_every=per_epoch, keep_last=1, seed=seed, compile=cfg.compile, select_metric=main)
    objective = sequence_objective(family, head.kind, cfg.lm_coef if family == "gpt2" else 0.0)
    train(model, objective, batches, tc, run_dir, validate=_validator(dev_feats, head.kind, data.metrics, 2 * cfg.batch_size),
          tokenizer=tok, resume=resume, on_log=on_log)
    plot_run(run_dir)
    evals = [r for r in read_metrics(run_dir) if isinstance(r.get(main), float) and not math.isnan(r[main])]
    best = max(evals, key=lambda r: r[main]) if evals else {"step": max_steps}
    return {"run": Path(run_dir).name, "lr": lr, "seed": seed, "step": best["step"],
            "epoch": round(best["step"] / per_epoch, 2),
            "metrics": {k[4:]: v for k, v in best.items() if k.startswith("val_")}}


def _steps(train_feats: Features, cfg: FinetuneConfig) -> tuple[int, int]:
    """(steps per epoch, steps in all) of a run."""
    per_epoch = TaskBatches(train_feats).steps_per_epoch(cfg.batch_size)
    return per_epoch, max(1, round(cfg.epochs * per_epoch))


def finetune(model, task: str, run_dir, config: FinetuneConfig | None = None, *, data=None, train_file=None,
             dev_file=None, text_column: str = "text", pair_column: str | None = None, label_column: str = "label",
             device: str | None = None, resume: bool = False, on_start=None, on_log=None) -> dict:
    """Fine-tune `model` (a GPT-2 / BERT directory or run) on `task` into `run_dir`; returns the results.

    task: a GLUE task with its folder `data` (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli), or
    "classify" / "regress" with the user's train_file / dev_file and their column names. Every seed (and
    learning rate of the grid) is a run of the one train() loop with dev metrics after every epoch and the
    best model kept in best/; several runs go to run_dir/seed-S (lr-L-seed-S), the best one's model is
    copied to run_dir/best. run_dir/results.json and results.md hold each run's best dev metrics, mean and
    std over the seeds, and the best run. on_start(info) is called once the data is encoded (sizes, notes,
    truncated counts); on_log(row) with every row of every run.
    """
    cfg = (config or FinetuneConfig())
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base, tok, family = load_pretrained(model, dev)
    cfg = cfg.resolved(family)
    if cfg.both_orders and family != "gpt2":
        raise ValueError("both_orders is GPT's way of feeding sentence pairs; BERT reads one [CLS] A [SEP] B [SEP]")
    data_ = load_task(task, data, train_file, dev_file, text=text_column, pair=pair_column, label=label_column,
                      dev_fraction=cfg.dev_fraction)
    if not data_.dev:
        raise ValueError(f"task {task!r} has no dev set to select on: give a dev file or a dev fraction")
    head = HeadConfig(data_.kind, data_.labels, data_.name, min(cfg.max_length, base.config.block_size),
                      cfg.both_orders)
    train_feats = encode(data_.train, tok, head)
    dev_feats = {p: encode(e, tok, head) for p, e in data_.dev.items()}
    lrs = LR_GRID if cfg.lr_grid else (cfg.lr,)
    info = {"runs": len(lrs) * cfg.seeds, "steps": _steps(train_feats, cfg)[1], "model": str(model), "family": family, "device": str(dev), "task": data_.name, "kind": data_.kind,
            "labels": data_.labels, "metric": data_.metrics[0], "train": len(train_feats),
            "dev": {p or "dev": len(f) for p, f in dev_feats.items()}, "notes": data_.notes,
            "truncated": {"train": train_feats.truncated, **{(p or "dev"): f.truncated for p, f in dev_feats.items()}},
            "max_length": head.max_length, "config": asdict(cfg)}
    if on_start is not None:
        on_start(info)
    run_dir = Path(run_dir)
    single = len(lrs) == 1 and cfg.seeds == 1
    runs_ = []
    for lr in lrs:
        for seed in range(cfg.seed, cfg.seed + cfg.seeds):
            sub = run_dir if single else run_dir / (f"seed-{seed}" if len(lrs) == 1 else f"lr-{lr:g}-seed-{seed}")
            runs_.append(_one_run(base, tok, family, head, train_feats, dev_feats, data_, cfg, lr, seed, sub, dev,
                                  resume, on_log))
    results = {**info, **summarize(runs_, data_.metrics[0], cfg.select)}
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
