"""The eager prefills of the scheduler's joining and scoring rows past the prefixes the prefix cache holds (prefix.py):
which rows run together (waves), their one right-padded forward (prefill) and their keys and values laid out for the
batch (aligned).

Rows prefilled in one forward cannot share with each other: each finds only what earlier forwards cached. The rows
lm-evaluation-harness sends for one multiple-choice item (the context, then each choice) often arrive together, so
`waves` runs a step's rows that share a prefix the cache lacks in forwards one after the other: the first row of each
such run, whose prompt is then cached, then the others past it. The context is computed once instead of once a row.
"""
from __future__ import annotations

import torch

from duolm.generation.base import device_dtype
from duolm.models import KVCache
from duolm.serve.prefix import common

SHARED_MIN = 8     # tokens a row must share with an earlier row of its step, past what the cache gives it, to wait


def waves(rows: list, prefix) -> list[list]:
    """`rows` (prefilled together) cut into forwards run one after the other where that saves computing a prefix again.
    Ordered by prompt, each row finds the earlier row it shares the most with (the longest common prefix is with a
    neighbour in that order; of several, the one of the earliest wave); sharing SHARED_MIN tokens or more with it past
    what `prefix` (a PrefixCache, or None) gives, it runs in the wave after that row's, else in the first. [rows]
    when none waits: 4 rows of one context -> [[the first], [the 3 others]]."""
    if prefix is None or len(rows) < 2:
        return [rows]
    order = sorted(rows, key=lambda r: r.prompt)
    adjacent = [0] + [common(a.prompt, b.prompt) for a, b in zip(order, order[1:])]
    wave: list[int] = []
    for i, row in enumerate(order):
        best, w, shared = -1, 0, len(row.prompt)
        for k in range(i - 1, -1, -1):        # shared with row k: the least shared by neighbours from k to i
            shared = min(shared, adjacent[k + 1])
            if shared < best:
                break
            w, best = (wave[k] if shared > best else min(w, wave[k])), shared
        need = (row.logprobs or 0) if row.prompt_logprobs else None
        wave.append(w + 1 if best - prefix.matched(row.prompt, need) >= SHARED_MIN else 0)
    if not max(wave):
        return [rows]
    return [[r for r, v in zip(order, wave) if v == n] for n in range(max(wave) + 1)]


def prefill(model, prefix, rows: list):
    """One forward over the rows' prompts past the prefix each finds cached -> (the cache: row j's u_j cached
    positions end at column M, its P_j - u_j new ones follow, right-padded; [(u_j, the infos of its first u_j + 1
    tokens, its prompt's keys and values for the prefix cache or None)]; the hidden states (J, S, C) of the new
    positions). A row asking for its prompt's log-probabilities reuses one position less than it finds: the state
    before its first new token is computed."""
    found, block = [], model.config.block_size
    device, dtype = device_dtype(model)
    for r in rows:
        need = (r.logprobs or 0) if r.prompt_logprobs else None
        m, kv, infos = (0, None, []) if prefix is None else prefix.match(r.prompt, need)
        found.append((max(0, min(m - (need is not None), len(r.prompt) - 1)), kv, infos))
    S = max(len(r.prompt) - u for r, (u, _, _) in zip(rows, found))
    if max(u for u, _, _ in found) + S > block:        # the cache's columns fit the window: reuse less
        found = [(min(u, block - S), kv, infos) for u, kv, infos in found]
    found = [(u, kv, infos[:u + 1] if u else [None]) for u, kv, infos in found]
    for u, _, _ in found if prefix is not None else ():
        prefix.count(u)
    J, M = len(rows), max(u for u, _, _ in found)
    cache = KVCache(model.config, J, max_len=M + S, device=device, dtype=dtype)
    idx = torch.zeros(J, S, dtype=torch.long, device=device)
    real = torch.zeros(J, M + S, dtype=torch.bool, device=device)
    for buf in cache.k + cache.v:        # padding columns are read (with weight 0): keep them finite
        buf[:, :, :M].zero_()
    for j, (r, (u, kv, _)) in enumerate(zip(rows, found)):
        for i, buf in enumerate(cache.k + cache.v):
            buf[j, :, M - u:M] = kv[i, :, :u] if u else 0
        idx[j, :len(r.prompt) - u] = torch.tensor(r.prompt[u:])
        real[j, M - u:M + len(r.prompt) - u] = True
    cache.length = M
    h = model.hidden(idx, None if all(u == M for u, _, _ in found) else real, cache)
    out = [(u, known, None if prefix is None else
            torch.stack([b[j, :, M - u:M + len(r.prompt) - u] for b in cache.k + cache.v]))
           for j, (r, (u, _, known)) in enumerate(zip(rows, found))]
    return cache, out, h

def aligned(cache: KVCache, M: int, kept: list):
    """The keys and values of prefill's rows kept, [(its row in the cache, Row, u)], right-aligned for the scheduler's
    _insert:
    per layer (J, n_head, T, head_dim), and which columns are each row's (J, T) (None: all)."""
    T = max(len(r.prompt) for _, r, _ in kept)
    keys, values = [], []
    for src, dst in ((cache.k, keys), (cache.v, values)):
        for buf in src:
            new = buf.new_zeros(len(kept), buf.shape[1], T, buf.shape[3])
            for j, (k, r, u) in enumerate(kept):
                new[j, :, T - len(r.prompt):] = buf[k, :, M - u:M + len(r.prompt) - u]
            dst.append(new)
    real = torch.zeros(len(kept), T, dtype=torch.bool, device=cache.k[0].device)
    for j, (_, r, _) in enumerate(kept):
        real[j, T - len(r.prompt):] = True
    return keys, values, None if bool(real.all()) else real
