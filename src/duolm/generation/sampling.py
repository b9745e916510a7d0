"""Sampling is the composition of small pure functions on logits (B, V), applied in the order `transformers`
uses: repetition penalty, temperature, top-k, top-p, then a draw from the softmax."""
from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# Sampling filters: pure functions, logits (B, V) -> logits (B, V); removed tokens become -inf

def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL (Keskar et al., 2019): make tokens already in the text less likely. A seen token's logit
    is divided by `penalty` when positive and multiplied by it when negative, so `penalty > 1`
    always lowers it. `seen` is a bool mask (B, V) of the ids present in prompt + generated text."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T): T < 1 sharpens, T > 1 flattens. T = 0 means greedy (handled by the caller)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 here (0 means greedy: take the argmax)")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept, as in transformers)."""
    if k < 1:
        raise ValueError(f"top_k={k} must be >= 1")
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al., 2019): keep the smallest set of most likely tokens whose
    probabilities sum to at least p (always at least the most likely one). Same rule as
    transformers: sorted ascending, drop the tokens whose cumulative probability is <= 1 - p."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={p} must be in (0, 1]")
    if p == 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1.0 - p)
    drop_sorted[..., -1] = False                     # the most likely token always stays
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> ids (B,): argmax when temperature == 0, else a draw from the filtered
    softmax (with `generator`, so a seed makes it reproducible)."""
    if temperature == 0:
        return logits.max(dim=-1).indices       # the first maximal index, as argmax (its CPU kernel the slower)
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
