"""How a GPT-2 row's next token is drawn in the server: OpenAI's presence and frequency penalties and logit_bias on
the logits, the log-probabilities reported beside a token, and a decode step's draws, each row's own, read to the host
together."""
from __future__ import annotations

import torch

from duolm.generation import next_token
from duolm.generation.grammar import constrain


def logprob_info(logits: torch.Tensor, tokens: list, k: int, at: torch.Tensor | None = None) -> list:
    """logits (N, V) and the tokens that followed, token i after row at[i] of the logits (at None: row i) -> per token
    (log p(token), [(id, log p) of the k most likely ids, most likely first]), log p from the raw logits (before
    penalties, temperature and filters). The token's log p and the alternatives' come from one log-softmax: a token
    that is the most likely has exactly the first alternative's value. Rows shared by several tokens (prompts that
    share a prefix) are computed once.

    >>> logprob_info(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), [1], 1)
    [(-1.3862943649291992, [(0, -0.6931471824645996)])]
    >>> logprob_info(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), [1, 0], 0, torch.tensor([0, 0]))
    [(-1.3862943649291992, []), (-0.6931471824645996, [])]
    """
    lp = logits.float().log_softmax(-1)
    at = torch.arange(len(tokens), device=lp.device) if at is None else at.to(lp.device)
    chosen = lp[at, torch.tensor(tokens, device=lp.device)].tolist()
    if not k:
        return [(c, []) for c in chosen]
    top = lp.topk(min(k, lp.shape[-1]))
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top.indices[at].tolist(), top.values[at].tolist())]


def penalized(logits: torch.Tensor, tokens: list, presence: float = 0.0, frequency: float = 0.0,
              bias: dict | None = None) -> torch.Tensor:
    """OpenAI's presence / frequency penalties and logit_bias on the logits (1, V) of a row's next draw:
    each token t drawn so far (`tokens`) loses frequency * count(t) + presence * [count(t) > 0], and
    token t gains bias[t]. Neutral values return `logits` itself.

    >>> penalized(torch.zeros(1, 4), [2, 2, 0], presence=0.5, frequency=1.0, bias={3: 5.0}).tolist()
    [[-1.5, 0.0, -2.5, 5.0]]
    """
    if tokens and (presence or frequency):
        counts = torch.bincount(torch.tensor(tokens, device=logits.device), minlength=logits.shape[-1]).to(logits)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits)
    if bias:
        ids = torch.tensor(list(bias), device=logits.device)
        logits = logits.index_add(1, ids, torch.tensor([list(bias.values())], dtype=logits.dtype, device=logits.device))
    return logits


def next_tokens(rows: list, logits: torch.Tensor) -> list[int]:
    """Each row's (scheduler.Row) next token drawn from its row of logits (B, V) as next_token draws it for the row
    alone (its penalties, constraint, settings and generator), read to the host in one transfer: one wait for the device a step,
    not one a row. The greedy rows without penalties or bias take their argmax together (a row's argmax is its own)."""
    plain = [j for j, r in enumerate(rows) if r.temperature == 0 and
             not (r.presence_penalty or r.frequency_penalty or r.logit_bias or r.constraint is not None)]
    if len(plain) == len(rows):
        return next_token(logits, 0).tolist()
    ids = dict(zip(plain, next_token(logits[plain], 0))) if plain else {}
    rest = [j for j in range(len(rows)) if j not in ids]
    # structured output: the tokens each row's grammar allows, every such row in one call (before or after the
    # penalties and bias, the same numbers: they are finite, the mask's -inf stays -inf)
    masked = constrain(logits if len(rest) == len(rows) else logits[rest], [rows[j].constraint for j in rest])
    for k, j in enumerate(rest):
        r = rows[j]
        adjusted = penalized(masked[k:k + 1], r.tokens, r.presence_penalty, r.frequency_penalty, r.logit_bias)
        ids[j] = next_token(adjusted, r.temperature, r.top_k, r.top_p, r.generator)[0]
    return torch.stack([ids[j] for j in range(len(rows))]).tolist()
