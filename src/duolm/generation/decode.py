"""generate(): prefill once, then one position per step through a KV cache; a Generation streams the ids."""
from __future__ import annotations

import torch

from duolm.generation.base import StopReason, check_prompts, check_stop, device_dtype, last_logits, left_pad, new_cache
from duolm.generation.grammar import constrain
from duolm.generation.sampling import apply_repetition_penalty, next_token
from duolm.generation.static import decoder_of

# ---------------------------------------------------------------------------------------------
# Streaming generation

class Generation:
    """The iterator generate() returns. Each step yields a list with one new id per prompt, or None
    for a prompt that has stopped; iteration ends when every prompt has stopped.
    `stop_reasons[i]` is a StopReason once prompt i has stopped (None while it runs);
    `tokens[i]` is the list of ids prompt i produced so far."""

    def __init__(self, steps, state):
        self._steps = steps
        self._state = state

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._steps)

    @property
    def stop_reasons(self) -> list:
        return list(self._state["reasons"])

    @property
    def tokens(self) -> list:
        return [list(t) for t in self._state["tokens"]]


def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             repetition_penalty=1.0, stop=None, generator=None, compile=False, constraints=None) -> Generation:
    """Sample (or, with temperature=0, greedily pick) up to `max_new_tokens` ids after each prompt.

    prompts: list of token-id lists, any lengths (left-padded internally). The prompts are
    prefilled once; each step then feeds one position per prompt through a preallocated KVCache.
    stop: list of token-id sequences; a prompt stops right after producing one (its ids included).
    A prompt longer than block_size raises ValueError. When the window fills up (in a batch, the
    longest prompt plus the steps taken reaches block_size + 1) the running prompts stop with
    StopReason.CONTEXT; `Generation.stop_reasons` tells every prompt's reason.
    The model should be in eval mode (dropout off). Runs under torch.inference_mode.
    compile=True: every step after the prefill is the static-shape step of duolm.generation.static, compiled once
    per model and, on CUDA, replayed as a CUDA graph; the first call of a (batch, cache length) bucket pays the
    compilation. Same ids as compile=False up to the last bits of the logits (the ops are fused differently).
    constraints: one per prompt, a duolm.generation.grammar.Constraint (structured output: each draw masked to the
    tokens its grammar allows; the prompt stops with StopReason.STOP once its text is complete) or None."""
    check_prompts(model, prompts, max_new_tokens)
    constraints = [None] * len(prompts) if constraints is None else list(constraints)
    if len(constraints) != len(prompts):
        raise ValueError(f"{len(constraints)} constraints for {len(prompts)} prompts: give one per prompt (or None)")
    V = model.config.vocab_size
    stop = check_stop(stop, V)
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 or None")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0 (1.0 = off)")
    prompts = [list(p) for p in prompts]
    state = {"reasons": [None] * len(prompts), "tokens": [[] for _ in prompts]}
    steps = _generate_steps(model, prompts, max_new_tokens, temperature, top_k, top_p,
                            repetition_penalty, stop, generator, state, compile, constraints)
    return Generation(steps, state)


class EagerStep:
    """generate's reference path: a KVCache as long as the generation needs, one position a step, the padding mask
    grown by one real column a step (sliced, never reallocated)."""

    def __init__(self, model, batch: int, length: int):
        device, dtype = device_dtype(model)
        self.model = model
        self.cache = new_cache(model, batch, length, device, dtype)
        self.full = torch.ones(batch, length, dtype=torch.long, device=device)
        self.padded = False

    def prefill(self, idx, mask):
        self.padded = mask is not None
        if self.padded:
            self.full[:, :idx.shape[1]] = mask
        return last_logits(self.model, idx, mask, self.cache)

    def step(self, nxt):
        m = self.full[:, :self.cache.length + 1] if self.padded else None
        return last_logits(self.model, nxt[:, None], m, self.cache)


def _to_host(ids: torch.Tensor):
    """Start copying ids (B,) to the host; -> a function that waits for them alone and returns the list (on CUDA,
    where generate launches the next step before that wait, so that the GPU never idles while Python reads a
    token)."""
    if ids.device.type != "cuda":
        return ids.tolist
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return lambda: (copied.synchronize(), host.tolist())[1]


def _generate_steps(model, prompts, max_new_tokens, temperature, top_k, top_p,
                    repetition_penalty, stop, generator, state, compile, constraints):
    cfg = model.config
    B, V = len(prompts), cfg.vocab_size
    reasons, tokens = state["reasons"], state["tokens"]
    if max_new_tokens == 0:
        reasons[:] = [StopReason.MAX_NEW_TOKENS] * B
        return
    P = max(len(p) for p in prompts)
    # Step s (0-based) needs the logits after P + s positions; the last step's token is never fed.
    n_steps = min(max_new_tokens, cfg.block_size - P + 1)
    running = [True] * B
    with torch.inference_mode():
        device = device_dtype(model)[0]
        idx, mask = left_pad(prompts, device)
        dec = decoder_of(model).get(B, P + n_steps - 1) if compile else EagerStep(model, B, P + n_steps - 1)
        seen = None
        if repetition_penalty != 1.0:
            seen = torch.zeros(B, V, dtype=torch.bool, device=device)
            for i, p in enumerate(prompts):
                seen[i, p] = True
        logits = dec.prefill(idx, mask)
        for s in range(n_steps):
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, repetition_penalty)
            logits = constrain(logits, [c if running[i] else None for i, c in enumerate(constraints)])
            nxt = next_token(logits, temperature, top_k, top_p, generator)
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            ids = _to_host(nxt)
            ahead = nxt.device.type == "cuda" and s < n_steps - 1    # the GPU runs the next step while we read
            if ahead:
                logits = dec.step(nxt)
            out = []
            for i, t in enumerate(ids()):
                if not running[i]:
                    out.append(None)
                    continue
                out.append(t)
                tokens[i].append(t)
                if (any(tokens[i][-len(q):] == q for q in stop if len(q) <= len(tokens[i]))
                        or constraints[i] is not None and constraints[i].advance(t)):
                    running[i] = False
                    reasons[i] = StopReason.STOP
            if s == n_steps - 1:
                last = StopReason.MAX_NEW_TOKENS if n_steps == max_new_tokens else StopReason.CONTEXT
                for i in range(B):
                    if running[i]:
                        running[i] = False
                        reasons[i] = last
            yield out
            if not any(running):
                return
            if not ahead:
                logits = dec.step(nxt)
