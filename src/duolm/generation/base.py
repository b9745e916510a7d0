"""What every decoder shares: the checks of prompts and stop sequences, left padding, the cache, the logits of the
last position."""
from __future__ import annotations

from enum import Enum

import torch

from duolm.models.gpt2 import KVCache


class StopReason(str, Enum):
    """Why a prompt stopped producing tokens."""
    STOP = "stop"                   # it produced one of the stop sequences (included in the output)
    MAX_NEW_TOKENS = "max_new_tokens"
    CONTEXT = "context"             # the context window (block_size) is full


def check_prompts(model, prompts, max_new_tokens):
    cfg = model.config
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt {i} is empty or not a list of token ids; every prompt needs >= 1 token")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"prompt {i}: token ids must be in [0, {cfg.vocab_size}); got min {lo}, max {hi}")
        if len(p) > cfg.block_size:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the context window is block_size="
                             f"{cfg.block_size}; truncate it (keep the last tokens: "
                             f"prompt[-{cfg.block_size}:], or `duolm generate --truncate left`)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")


def check_stop(stop, vocab_size):
    stop = [list(s) for s in (stop or [])]
    for s in stop:
        if not s or min(s) < 0 or max(s) >= vocab_size:
            raise ValueError(f"stop sequence {s} must be a non-empty list of ids in [0, {vocab_size})")
    return stop


def left_pad(prompts, device):
    """-> idx (B, P) left-padded with id 0, attention mask (B, P) of 0/1, or None if no padding."""
    P = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return idx, (None if bool(mask.all()) else mask)


def device_dtype(model):
    w = model.wte.weight
    return w.device, w.dtype


def new_cache(model, batch_size, max_len, device, dtype):
    return KVCache(model.config, batch_size, max_len=max_len, device=device, dtype=dtype)


def last_logits(model, idx, mask, cache):
    """Run idx through the model (writing the cache) and return fp32 logits (B, V) of the last
    position only: the output layer is never applied to the rest of the prompt."""
    h = model.hidden(idx, attention_mask=mask, cache=cache)
    return model.head(h[:, -1]).float()
