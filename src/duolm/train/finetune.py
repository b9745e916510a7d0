"""Fine-tuning: the losses of the heads, and finetune() / predict() / evaluate_task() as library calls.

    L = CE(logits, label)                          classification (BERT section 4.1)
    L = (logit - y)^2                              regression (STS-B)
    L = L_task + lambda L_LM                       GPT-1 section 3.3: the LM loss on the same inputs helps
                                                   generalisation and convergence (lambda 0.5)

As in duolm.train.objectives, each loss is a sum divided by the step's count (norm["n"] inputs,
norm["lm"] predicted tokens), so micro-batches add up to the loss of the whole batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
