"""Automatic prefix caching: the keys and values of recent prompts, found again by their tokens, so that a prompt which
shares a prefix with a recent one computes only the rest (lm-evaluation-harness sends each choice of an item, its
context repeated, as a request of its own).

A radix tree over token ids, as SGLang keeps it: each node an edge of tokens with their keys and values (all layers,
one tensor (2 * n_layer, n_head, tokens, head_dim)) and, where a prompt asked for them, the log-probabilities reported
for its tokens (`logprob_info`, with the number of alternatives they hold). A match is token-exact (a prompt reuses
every token it shares, not whole blocks of 16 as vLLM's hashed blocks do: a short multiple-choice context reuses all
of itself), and a shared prefix is stored once however many prompts continue it. Bounded in bytes: after each insert
the least recently used leaves go until the tree fits.
"""
from __future__ import annotations

import itertools

import torch


class _Node:
    __slots__ = ("tokens", "kv", "infos", "k", "children", "parent", "used")

    def __init__(self, tokens: tuple, kv, infos, k: int, parent):
        self.tokens, self.kv, self.infos, self.k, self.parent = tokens, kv, infos, k, parent
        self.children: dict = {}
        self.used = 0

    def split(self, at: int) -> None:
        """Keep the first `at` tokens here; the rest become the one child."""
        rest = _Node(self.tokens[at:], self.kv[:, :, at:], None if self.infos is None else self.infos[at:], self.k,
                     self)
        rest.children, rest.used = self.children, self.used
        for child in rest.children.values():
            child.parent = rest
        self.tokens, self.kv = self.tokens[:at], self.kv[:, :, :at]
        self.infos = None if self.infos is None else self.infos[:at]
        self.children = {rest.tokens[0]: rest}


def common(a, b) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Up to `budget` bytes of keys and values, found by token prefix. match() finds the longest cached prefix of a
    prompt, insert() adds a prompt's; hits, misses and the tokens reused are counted for /metrics."""

    def __init__(self, budget: int):
        self.budget = budget
        self.root = _Node((), None, None, 1 << 30, None)
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = self.evicted = 0
        self.shared_tokens = 0       # prompt tokens computed once for several rows of one forward (prefill.py)
        self._clock = itertools.count(1)

    def stats(self) -> dict:
        return {"prefix_cache_hits": self.hits, "prefix_cache_misses": self.misses,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_shared_tokens": self.shared_tokens,
                "prefix_cache_bytes": self.bytes,
                "prefix_cache_evicted": self.evicted}

    def match(self, tokens: list, k: int | None) -> tuple[int, torch.Tensor | None, list]:
        """(m, keys and values (2 * n_layer, n_head, m, head_dim), infos of those m tokens) of the longest cached
        prefix of `tokens`; k: the alternatives each token's log-probability must come with (None: none needed, a
        prefix cached without them serves too)."""
        pos, parts = self._walk(tokens, k)
        if not pos:
            return 0, None, []
        kv = torch.cat([c.kv[:, :, :n] for c, n in parts], 2) if len(parts) > 1 else parts[0][0].kv[:, :, :pos]
        infos = [] if k is None else [_top(i, k) for c, n in parts for i in c.infos[:n]]
        return pos, kv, infos

    def matched(self, tokens: list, k: int | None) -> int:
        """The length of match(tokens, k)'s prefix (nothing copied)."""
        return self._walk(tokens, k)[0]

    def _walk(self, tokens: list, k: int | None) -> tuple[int, list]:
        """-> (m, [(node, how many of its tokens)]) along the longest cached prefix of `tokens`; its nodes used now."""
        node, pos, parts, now = self.root, 0, [], next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or (k is not None and (child.infos is None or child.k < k)):
                break
            n = common(child.tokens, tokens[pos:])
            child.used = now
            parts.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos, parts

    def count(self, reused: int) -> None:
        """A prompt reused `reused` tokens of the cache (0: a miss)."""
        self.hits += reused > 0
        self.misses += reused == 0
        self.hit_tokens += reused

    def insert(self, tokens: list, kv: torch.Tensor, infos: list | None, k: int) -> None:
        """A prompt's keys and values (2 * n_layer, n_head, len(tokens), head_dim) and its tokens' infos (None where it
        asked for none; else with k alternatives each), then the least recently used leaves evicted to the budget."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tuple(tokens[pos:]), kv[:, :, pos:].clone(), None if infos is None else infos[pos:], k,
                             node)
                leaf.used = now
                node.children[tokens[pos]] = leaf
                self.bytes += _size(leaf)
                break
            n = common(child.tokens, tokens[pos:])
            if n < len(child.tokens):
                child.split(n)
            if infos is not None and (child.infos is None or child.k < k):
                child.infos, child.k = infos[pos:pos + n], k
            child.used = now
            pos += n
            node = child
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.budget:
            leaves = [n for n in _nodes(self.root) if not n.children and n is not self.root]
            if not leaves:
                return
            for leaf in sorted(leaves, key=lambda n: n.used):
                del leaf.parent.children[leaf.tokens[0]]
                self.bytes -= _size(leaf)
                self.evicted += 1
                if self.bytes <= self.budget:
                    return


def _size(node: _Node) -> int:
    return node.kv.nelement() * node.kv.element_size()


def _nodes(root: _Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _top(info, k: int):
    """A token's logprob_info with its first k alternatives (None, the first token's, stays None)."""
    return info if info is None else (info[0], info[1][:k])
