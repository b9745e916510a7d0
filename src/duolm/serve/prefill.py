"""The eager prefills of the scheduler's joining and scoring rows (scheduler.py): their prompts past the prefixes the
prefix cache holds (prefix.py), packed into one sequence and computed in one forward (GPT2.hidden's packed sequences).

Packed, no position is padding, and rows that share a prefix the cache lacks compute it once: lm-evaluation-harness
sends the choices of a multiple-choice item, their context repeated, often together. Ordered by prompt, each row
shares its longest prefix with the row before it; past its cached prefix, the tokens it shares are that row's, and
only the rest are new. The new tokens follow the rows' cached prefixes in one row of keys and values, each token
seeing its own row's columns. Worked example, nothing cached: prompts [1, 2, 3] and [1, 2, 4] are the new tokens 1, 2,
3, 4 at positions 0, 1, 2, 2; the second prompt's columns are [0, 1, 3], and token 4 sees columns 0, 1 and 3.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from duolm.generation.base import device_dtype
from duolm.models import KVCache
from duolm.serve.prefix import common


class Prefilled(NamedTuple):
    cache: KVCache        # batch 1: the rows' cached prefixes one after the other, then the new tokens
    cols: list            # each row's columns in it, a (P_j,) index
    found: list           # per row (u_j, the infos of its first u_j + 1 tokens, its prompt's keys and values for the
    #                       prefix cache or None)
    h: torch.Tensor       # (T, C) the new tokens' hidden states
    at: list              # each row's positions u_j .. P_j - 1 in h, a (P_j - u_j,) index


def prefill(model, prefix, rows: list) -> Prefilled:
    """One forward over the rows' prompts past the prefix each finds cached, packed. A row asking for its prompt's
    log-probabilities reuses one cached position less than it finds: the state before its first new token is
    computed. Rows share prefixes only where the prefix cache is on (`prefix` not None)."""
    found = []
    for r in rows:
        need = (r.logprobs or 0) if r.prompt_logprobs else None
        m, kv, infos = (0, None, []) if prefix is None else prefix.match(r.prompt, need)
        u = max(0, min(m - (need is not None), len(r.prompt) - 1))
        found.append((u, kv, infos[:u + 1] if u else [None]))
    C = sum(u for u, _, _ in found)               # cached columns, row by row; the new tokens' follow
    at = [sum(u for u, _, _ in found[:j]) for j in range(len(rows))]
    cols, ids, pos, spans, prev = [None] * len(rows), [], [], [], None
    for j in sorted(range(len(rows)), key=lambda j: rows[j].prompt):
        p, u = rows[j].prompt, found[j][0]
        c = list(range(at[j], at[j] + u))
        n = 0 if prefix is None or prev is None else common(rows[prev].prompt, p)
        while len(c) < n and cols[prev][len(c)] >= C:          # the row before's new tokens, shared
            c.append(cols[prev][len(c)])
        s = len(c)
        spans.append((j, len(ids), s))
        c += range(C + len(ids), C + len(ids) + len(p) - s)
        ids += p[s:]
        pos += range(s, len(p))
        cols[j], prev = c, j
    device, dtype = device_dtype(model)
    T = len(ids)
    cols = [torch.tensor(c, device=device) for c in cols]
    cache = KVCache(model.config, 1, max_len=C + T, device=device, dtype=dtype)
    for (u, kv, _), a in zip(found, at):
        for i, buf in enumerate(cache.k + cache.v) if u else ():
            buf[0, :, a:a + u] = kv[i, :, :u]
    cache.length = C
    ids = torch.tensor([ids], device=device)
    if len(rows) == 1:        # one prompt: generate's path (its own causal mask past the cache)
        h = model.hidden(ids, None, cache)[0]
    else:
        mask = torch.zeros(T, C + T, dtype=torch.bool, device=device)
        for j, t0, s in spans:      # row j's new tokens t0.. at positions s..: its columns before s, its own causally
            t1 = t0 + len(rows[j].prompt) - s
            mask[t0:t1, cols[j][:s]] = True
            mask[t0:t1, C + t0:C + t1] = torch.ones(t1 - t0, t1 - t0, dtype=torch.bool, device=device).tril()
        h = model.hidden(ids, mask[None], cache, torch.tensor([pos], device=device))[0]
    if prefix is not None:
        for u, _, _ in found:
            prefix.count(u)
        prefix.shared_tokens += sum(len(r.prompt) for r in rows) - C - T
    out = [(u, known, None if prefix is None else row_kv(cache, c)) for (u, _, known), c in zip(found, cols)]
    return Prefilled(cache, cols, out, h, [c[u:] - C for (u, _, _), c in zip(found, cols)])


def row_kv(cache: KVCache, cols: torch.Tensor) -> torch.Tensor:
    """A row's keys and values, all layers, from prefill's packed cache: (2 * n_layer, n_head, P, head_dim)."""
    return torch.stack([b[0].index_select(1, cols) for b in cache.k + cache.v])


def aligned(cache: KVCache, cols: list, kept: list):
    """The keys and values of the prefill's rows `kept` (their indices), right-aligned for the scheduler's _insert:
    per layer (J, n_head, T, head_dim), and which columns are each row's (J, T) (None: all)."""
    T = max(len(cols[j]) for j in kept)
    keys, values = [], []
    for src, dst in ((cache.k, keys), (cache.v, values)):
        for buf in src:
            new = buf.new_zeros(len(kept), buf.shape[1], T, buf.shape[3])
            for i, j in enumerate(kept):
                new[i, :, T - len(cols[j]):] = buf[0].index_select(1, cols[j])
            dst.append(new)
    real = torch.zeros(len(kept), T, dtype=torch.bool, device=cache.k[0].device)
    for i, j in enumerate(kept):
        real[i, T - len(cols[j]):] = True
    return keys, values, None if bool(real.all()) else real
