"""AdamW with the usual decay split, and the learning-rate schedule as a pure function."""
from __future__ import annotations

import math

import torch
from torch import nn


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int, decay: str = "cosine", min_lr: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine or linear decay.

    Warmup: steps 0 .. warmup_steps-1 use lr * (step+1) / warmup_steps, so the first step already moves
    and step warmup_steps-1 reaches the peak. Decay: from step warmup_steps (lr) to step max_steps (min_lr),
    progress p = (step - warmup_steps) / (max_steps - warmup_steps);
    cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2;  linear: lr - (lr - min_lr) * p;  "constant": lr.
    Steps past max_steps stay at min_lr.
    Example (lr=1, warmup 2, max 6, cosine): 0.5, 1.0, 1.0, 0.8536, 0.5, 0.1464, then 0.0.
    """
    if decay not in ("cosine", "linear", "constant"):
        raise ValueError(f"decay must be 'cosine', 'linear' or 'constant', got {decay!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    if step >= max_steps:
        return min_lr
    p = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    return lr - (lr - min_lr) * p


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (Linear weights and the embeddings) decay; vectors do not.

    Biases and LayerNorm gains/shifts are 1-D: decaying them pulls LayerNorm towards zero output and
    biases towards zero for no regularising gain (BERT's and GPT-2's own optimizers exclude them).
    The embeddings are kept in the decayed group as nanoGPT and HF do, since GPT-2's wte is also the
    tied output matrix. Tied parameters appear once (named_parameters de-duplicates them).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95),
                   eps: float = 1e-8) -> torch.optim.AdamW:
    """torch AdamW over `param_groups(model, weight_decay)`, with the fused kernel (CPU and CUDA): on the CPU many
    times faster than the default for-each path (benchmarks/training.py times training steps)."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, fused=True)
