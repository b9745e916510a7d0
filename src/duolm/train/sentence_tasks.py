"""Sentence and sentence-pair tasks (GLUE, the user's labelled texts): the losses of the heads, features,
validation, predictions and the GLUE submission files.

    L = CE(logits, label)                          classification (BERT section 4.1)
    L = (logit - y)^2                              regression (STS-B)
    L = L_task + lambda L_LM                       GPT-1 section 3.3: the LM loss on the same inputs helps
                                                   generalisation and convergence (lambda 0.5)

As in duolm.train.objectives, each loss is a sum divided by the step's count (norm["n"] inputs,
norm["lm"] predicted tokens), so micro-batches add up to the loss of the whole batch.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm.data.features import Features, collate, encode_examples, eval_batches
from duolm.data.tasks import Example, TaskData, first, load_task, write_submission
from duolm.evaluation.metrics import SEQUENCE_METRICS
from duolm.models.heads import HeadConfig
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



# --- features, predictions, metrics --------------------------------------------------------------------

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



# --- a task ready for the loop -------------------------------------------------------------------------

def _validator(dev: dict, kind: str, metrics, batch_size: int):
    def validate(model):
        out = {}
        for prefix, feats in dev.items():
            out.update({f"val_{prefix}{k}": v for k, v in
                        scores(predict_logits(model, feats, batch_size), feats, kind, metrics).items()})
        return out
    return validate



def prepare(task: str, tok, family: str, cfg, block_size: int, *, data=None, train_file=None, dev_file=None,
            text_column: str = "text", pair_column: str | None = None, label_column: str = "label") -> dict:
    """A GLUE task or the user's files ready for finetune(): head, training features and their collate
    function, objective, validate(model), metric names (the first selects), and what to tell the user."""
    if cfg.both_orders and family != "gpt2":
        raise ValueError("both_orders is GPT's way of feeding sentence pairs; BERT reads one [CLS] A [SEP] B [SEP]")
    data_ = load_task(task, data, train_file, dev_file, text=text_column, pair=pair_column, label=label_column,
                      dev_fraction=cfg.dev_fraction)
    if not data_.dev:
        raise ValueError(f"task {task!r} has no dev set to select on: give a dev file or a dev fraction")
    data_.train = first(data_.train, cfg.max_train_examples, data_.notes)
    head = HeadConfig(data_.kind, data_.labels, data_.name, min(cfg.max_length, block_size), cfg.both_orders)
    train_feats = encode(data_.train, tok, head)
    dev_feats = {p: encode(e, tok, head) for p, e in data_.dev.items()}
    return {"head": head, "train": train_feats, "collate": collate, "metrics": data_.metrics,
            "objective": sequence_objective(family, head.kind, cfg.lm_coef if family == "gpt2" else 0.0),
            "validate": _validator(dev_feats, head.kind, data_.metrics, 2 * cfg.batch_size),
            "info": {"task": data_.name, "kind": data_.kind, "labels": data_.labels, "train": len(train_feats),
                     "dev": {p or "dev": len(f) for p, f in dev_feats.items()}, "notes": data_.notes,
                     "truncated": {"train": train_feats.truncated,
                                   **{(p or "dev"): f.truncated for p, f in dev_feats.items()}}}}
