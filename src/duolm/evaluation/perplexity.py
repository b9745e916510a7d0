"""Log-probability of a long text under a causal LM: sliding windows, batched, streamed.

A model sees at most `block` tokens, so a long text is scored in windows of `block` tokens that start
every `stride` tokens; each token is scored exactly once, in the first window that reaches it, with
the context that window gives it (at least block - stride tokens once past the first window). This is
the arithmetic of HF's perplexity guide, done in batches of windows and with the output layer applied
to the scored positions only. Nothing holds the whole token list: text is encoded in pieces cut where
the byte-level BPE always ends a piece, and only the current windows are kept.

Normalisers turn the total negative log-likelihood (nats) into the paper's units:
perplexity per word / token = exp(nll / count), bits per byte / character = nll / (count ln 2).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Sequence

import regex
import torch
import torch.nn.functional as F


# --- window arithmetic -----------------------------------------------------------------------------

def windows(chunks: Iterable[Sequence[int]], block: int, stride: int) -> Iterator[tuple[list[int], int, int]]:
    """Sliding windows over a stream of token-id chunks -> (window ids, index in the window of its
    first scored token, absolute position of the window's first token).

    A window feeds tokens [begin, min(begin + block, N)) and scores those past the previous window's
    end (token 0 has no context and is never scored); the next window begins `stride` tokens later,
    but at most one token before that end, so every token is scored with some context. (With stride =
    block, HF's perplexity guide leaves each window's first token unscored; here it is scored after
    the last token of the window before.) The last window is the first to reach N. Only about
    block + stride tokens (plus one incoming chunk) are held at a time."""
    if block < 2 or not 1 <= stride <= block:
        raise ValueError(f"stride={stride} must be in [1, block={block}] (and block >= 2): a larger stride skips tokens")
    it = iter(chunks)
    buf: list[int] = []          # tokens from absolute position `base` on
    base = begin = prev_end = 0
    done = False
    while True:
        # Read until this window is known not to be the last (a token exists past it) or input ends.
        while not done and base + len(buf) <= begin + block:
            nxt = next(it, None)
            if nxt is None:
                done = True
            else:
                buf.extend(nxt)
        known = base + len(buf)
        end = min(begin + block, known)
        if end <= begin:
            return
        first = max(prev_end, begin + 1)
        if first < end:
            yield buf[begin - base:end - base], first - begin, begin
        if done and end == known:
            return
        prev_end, begin = end, min(begin + stride, end - 1)
        del buf[:begin - base]
        base = begin


def sliding_windows(n_tokens: int, block: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over n_tokens tokens as (begin, end, first scored position); token p of a window
    is predicted from tokens [begin, p). Worked example, 10 tokens, block 4, stride 2:

    >>> sliding_windows(10, 4, 2)
    [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]

    Token 1 sees 1 token of context, 2 sees 2, 3 sees 3, then 4 sees 2 (tokens 2-3), 5 sees 3, 6 sees
    2, 7 sees 3, 8 sees 2, 9 sees 3: every token from 1 on is scored once. With stride = block:

    >>> sliding_windows(10, 4, 4)
    [(0, 4, 1), (3, 7, 4), (6, 10, 7)]
    """
    return [(b, b + len(ids), b + f) for ids, f, b in windows([range(n_tokens)], block, stride)]


# --- streamed encoding -------------------------------------------------------------------------------

# Positions where GPT-2's pre-tokenizer ends a piece whatever follows: after a newline that sits between
# two visible characters or before " X"; before a single space between two visible characters.
_CUT = regex.compile(r"(?<=\S\n)(?=\S)|(?<=\n)(?= \S)|(?<=\S)(?= \S)")


def encode_stream(tokenizer, texts: Iterable[str], chunk_chars: int = 1 << 16) -> Iterator[list[int]]:
    """Encode the concatenation of `texts` in pieces -> token-id chunks whose concatenation equals
    tokenizer.encode_ordinary("".join(texts)). Pieces are cut at _CUT positions, about chunk_chars
    characters apart; special-token text is encoded as plain text."""
    buf = ""
    for text in texts:
        buf += text
        if len(buf) >= 2 * chunk_chars:
            cut = None
            for m in _CUT.finditer(buf, chunk_chars, len(buf) - 1):
                cut = m.start()
                break
            if cut:
                yield tokenizer.encode_ordinary(buf[:cut])
                buf = buf[cut:]
    if buf:
        yield tokenizer.encode_ordinary(buf)


# --- scoring -----------------------------------------------------------------------------------------

def token_nll(model, hidden: torch.Tensor, targets: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """Negative log-likelihood (float64, nats) of each target id given the hidden state before it:
    hidden (N, C), targets (N,) -> (N,). The output layer runs on `rows` positions at a time, in fp32."""
    out = []
    for i in range(0, hidden.shape[0], rows):
        logits = model.head(hidden[i:i + rows]).float()
        out.append(F.cross_entropy(logits, targets[i:i + rows], reduction="none").double())
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float64)


def score_stream(model, chunks: Iterable[Sequence[int]], stride: int | None = None, batch_size: int = 8,
                 on_batch: Callable[[float, int], None] | None = None) -> tuple[float, int]:
    """Total negative log-likelihood (nats) of a token stream and the number of tokens scored, with
    windows of the model's block size every `stride` tokens (default: half the block), `batch_size`
    windows per forward. on_batch(nll so far, tokens so far) is called after each forward."""
    block = model.config.block_size
    stride = block // 2 if stride is None else stride
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batch: list[tuple[list[int], int]] = []

    def flush():
        nonlocal total, count
        idx = torch.tensor([ids for ids, _ in batch], dtype=torch.long, device=device)
        T = idx.shape[1]
        h = model.hidden(idx)                                         # (B, T, C)
        # the state at position p predicts token p + 1: rows first-1 .. T-2 score tokens first .. T-1
        hs = torch.cat([h[b, f - 1:T - 1] for b, (_, f) in enumerate(batch)])
        tg = torch.cat([idx[b, f:] for b, (_, f) in enumerate(batch)])
        total += float(token_nll(model, hs, tg).sum())
        count += tg.numel()
        batch.clear()
        if on_batch is not None:
            on_batch(total, count)

    with torch.inference_mode():
        for ids, first, _ in windows(chunks, block, stride):
            if batch and (len(batch) == batch_size or len(ids) != len(batch[0][0])):
                flush()
            batch.append((ids, first))
        if batch:
            flush()
    return total, count


# --- normalisers ---------------------------------------------------------------------------------------

def perplexity(nll: float, units: int) -> float:
    """exp(nll / units): nats over words (or tokens) -> perplexity. perplexity(2 * math.log(4), 2) == 4.0"""
    if units <= 0:
        raise ValueError(f"cannot normalise by {units} units")
    return math.exp(nll / units)


def bits_per_unit(nll: float, units: int) -> float:
    """nll / (units ln 2): nats over bytes (or characters) -> bits per byte (character).
    bits_per_unit(3 * math.log(2), 2) == 1.5"""
    if units <= 0:
        raise ValueError(f"cannot normalise by {units} units")
    return nll / (units * math.log(2))


def count_words(lines: Iterable[str]) -> int:
    """Words of a tokenized corpus as its published counts give them: whitespace-separated tokens plus
    one end-of-line per line. count_words([" a b \\n", " \\n"]) == 4"""
    return sum(len(line.split()) + 1 for line in lines)
