"""Losses live outside the models: an objective is how to call the model on a batch and score it.

Every loss is a *sum* divided by a denominator `norm`. Alone, `norm` defaults to the batch's own count
(the usual mean). The training loop instead passes the count over the whole optimizer step (all
micro-batches on all ranks), so the micro-batch losses add up to exactly the loss of one big batch:
4 micro-batches of B/4 give the gradient of 1 batch of B, even when they hold different numbers of
predicted tokens. Metrics are returned the same way (already divided by `norm`), so they add up too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position that is not predicted (padding, unmasked BERT tokens)


def causal_lm_counts(batch: dict) -> dict[str, int]:
    return {"lm": int((batch["y"] != IGNORE).sum())}


def causal_lm_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Next-token cross-entropy. logits (B, T, V); batch["y"] (B, T) targets, IGNORE where not predicted.

    Returns (loss, metrics) with loss = sum of token losses / norm["lm"] (default: tokens predicted here).
    """
    y = batch["y"]
    n = (norm or causal_lm_counts(batch))["lm"]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    loss = total / max(n, 1)
    return loss, {"loss": loss.detach()}


def mlm_nsp_counts(batch: dict) -> dict[str, int]:
    counts = {"mlm": int((batch["mlm_labels"] != IGNORE).sum())}
    if batch.get("nsp_labels") is not None:
        counts["nsp"] = int(batch["nsp_labels"].numel())
    return counts


def constant_guess_accuracy(labels) -> float:
    """The accuracy of always guessing the most frequent target: the baseline a model that reads no context
    reaches at best (MLM: the unigram guess; NSP: the majority class). labels: tensors of targets, IGNORE where
    nothing is predicted.

    >>> constant_guess_accuracy([torch.tensor([[5, 5, -100]]), torch.tensor([[7, -100, -100]])])
    0.6666666666666666
    """
    targets = torch.cat([t[t != IGNORE] for t in labels])
    return targets.bincount().max().item() / max(targets.numel(), 1)


def mlm_nsp_loss(outputs, batch: dict, norm: dict | None = None):
    """BERT pretraining: mean MLM cross-entropy over masked positions + mean NSP cross-entropy (the paper's sum).

    outputs = (mlm_logits, nsp_logits (B, 2)); batch["mlm_labels"] (B, T) original ids at the chosen positions,
    IGNORE elsewhere; mlm_logits (B, T, V), or (N, V) at the N chosen positions alone (what MLM_NSP's forward
    asks the model for); batch["nsp_labels"] (B,) 0 = B follows A, 1 = random B (None: MLM only, RoBERTa).
    Metrics: mlm_loss, nsp_loss, mlm_acc (masked positions predicted right), nsp_acc.
    """
    mlm_logits, nsp_logits = outputs
    norm = norm or mlm_nsp_counts(batch)
    labels = batch["mlm_labels"]
    chosen = labels != IGNORE
    logits = (mlm_logits[chosen] if mlm_logits.dim() == 3 else mlm_logits).float()    # (N, V)
    target = labels[chosen]
    n_mlm = max(norm["mlm"], 1)
    mlm = F.cross_entropy(logits, target, reduction="sum") / n_mlm
    metrics = {"mlm_loss": mlm.detach(), "mlm_acc": (logits.argmax(-1) == target).sum().float() / n_mlm}
    loss = mlm
    if batch.get("nsp_labels") is not None:
        n_nsp = max(norm["nsp"], 1)
        nsp = F.cross_entropy(nsp_logits.float(), batch["nsp_labels"], reduction="sum") / n_nsp
        metrics["nsp_loss"] = nsp.detach()
        metrics["nsp_acc"] = (nsp_logits.argmax(-1) == batch["nsp_labels"]).sum().float() / n_nsp
        loss = loss + nsp
    metrics["loss"] = loss.detach()
    return loss, metrics


@dataclass(frozen=True)
class Objective:
    """What differs between training runs besides the data: the forward call, the loss, its denominators."""
    forward: Callable      # (model, batch) -> outputs
    loss: Callable         # (outputs, batch, norm) -> (loss, metrics)
    counts: Callable       # batch -> {name: number of predicted items}, summed over the step for `norm`
    tokens: Callable       # batch -> number of input tokens (for tokens/s)


CAUSAL_LM = Objective(forward=lambda model, b: model(b["x"]), loss=causal_lm_loss, counts=causal_lm_counts,
                      tokens=lambda b: b["x"].numel())

MLM_NSP = Objective(forward=lambda model, b: model(b["idx"], b.get("segment_ids"), b.get("attention_mask"),
                                                  mlm_positions=b["mlm_labels"] != IGNORE),
                    loss=mlm_nsp_loss, counts=mlm_nsp_counts, tokens=lambda b: b["idx"].numel())
