"""What the scheduler runs: a Row (one sequence to generate, its settings and its state) and the Sink its results go
to; packed_groups, how waiting prompts are cut into forwards of a bounded size."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duolm.generation.grammar import Constraint
from duolm.models import KVCache


class Sink:
    """Where a row's results go; called from the decode thread. Subclass and override."""

    def prompt(self, logprobs: list) -> None:
        """Log-probabilities of the prompt tokens ([None] first, then one `logprob_info` each)."""

    def token(self, token: int, logprobs) -> bool:
        """A new token (with its `logprob_info` or None); return True to stop the row here."""
        return False

    def done(self, reason: str) -> None:
        """Called once at the end: "stop", "length", "cancelled" or "error"."""


@dataclass(eq=False)
class Row:
    """One sequence to generate: `max_tokens` new tokens at most after `prompt` (token ids), drawn
    as `next_token(penalized(logits, ...), temperature, top_k, top_p, generator)` with a generator seeded
    by `seed` (the penalties and logit_bias neutral: the logits themselves).
    logprobs: None, or how many alternatives to report with each token's log-probability.
    prompt_logprobs: report the prompt tokens' log-probabilities too (OpenAI's echo + logprobs).
    constraint: each draw masked to the tokens its grammar allows (after the penalties); the row ends "stop" once its
    text is complete."""

    prompt: list
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)       # token id -> added to its logit
    logprobs: int | None = None
    prompt_logprobs: bool = False
    sink: Sink = field(default_factory=Sink)
    cancelled: bool = False          # set from any thread; the row leaves at the next step
    finished: bool = False
    tokens: list = field(default_factory=list)
    submitted: float = 0.0           # time.perf_counter() at submit()
    times: list = field(default_factory=list)     # and when each token was drawn
    n: int = 0                       # positions of this row in the cache
    generator: torch.Generator | None = None
    cache: KVCache | None = None     # batch_invariant: the row's own cache
    constraint: Constraint | None = None     # structured output: the grammar its text must follow


def packed_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of prompts (their lengths, in arrival order) cut into consecutive groups of at most `budget` tokens in
    all (one packed forward each: serve/prefill.py); a prompt longer than the budget is a group alone.

    >>> packed_groups([3, 5, 9, 2], 12)
    [[0, 1], [2, 3]]
    """
    groups, total = [], budget
    for i, n in enumerate(lengths):
        if total + n <= budget:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups
