"""Structured output: the tokens drawn must spell a text of a grammar (one of a list of strings, a regular expression,
a JSON schema, any JSON object), as a mask on each draw's logits: the tokens that cannot continue a text of the
grammar get -inf, so a draw (greedy or sampled, with any filter) picks among the others.

The grammar engine is llguidance (the optional extra `grammar`), fed the model's byte-level vocabulary: the bytes of
every token, end of text as its end. It computes a draw's mask when it is needed, from its lexer and Earley parser
over a trie of the tokens' bytes (benchmarks/serve_prefix.py times it for GPT-2's 50,257 tokens), with no index of
the vocabulary built ahead for each grammar (outlines-core builds one: seconds for a JSON schema), and needs no other
package (xgrammar needs transformers). docs/serving.md says more.

    vocab = Vocabulary.of(tokenizer, model.config.vocab_size)
    grammar = Grammar("json", {"type": "object", ...})
    constraint = vocab.constraint(grammar)      # one per sequence: its state is the text so far
    logits = constraint.mask(logits)            # (1, V): disallowed tokens -inf
    done = constraint.advance(token)            # True: the text is complete, nothing may follow

A draw's mask is llguidance's walk of the trie, written as bits into the sequence's own int32 buffer (no copy), as
soon as the text is known (a Constraint's creation, each advance()), while the parser's and the trie's memory is
still in the CPU's caches; not after the model's forward, which leaves them cold, nor beside it on a thread of its
own, which on a CPU whose cores torch's threads use slowed the forward by more than the walk costs (docs/serving.md).
At the draw the bits mask the logits in one call (constrain: every constrained row of a batch at once, the others
copied as they are): duolm.kernels.masked_logits on the CPU where duolm's kernels run (any call right after a forward
pays for the caches the forward emptied, so one call, not several), else the bits unpacked to a penalty of 0 or -inf
a token (penalty_rows) and added.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from duolm import kernels

KINDS = ("choice", "regex", "json", "json_object")
# OpenAI's structured outputs write compact JSON: no whitespace between tokens, "," and ":" alone
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class Grammar:
    """What the output must be: kind "choice" (value: a list of strings, the output one of them), "regex" (a regular
    expression, Rust's regex syntax, matched by the whole output), "json" (a JSON schema, a dict or its text: compact
    JSON valid under it) or "json_object" (value None: any JSON object)."""

    kind: str
    value: object = None

    def source(self) -> str:
        """The grammar in llguidance's form (a ValueError for a value of the wrong type)."""
        import llguidance

        m = llguidance.LLMatcher
        if self.kind == "choice":
            if not (isinstance(self.value, (list, tuple)) and self.value and
                    all(isinstance(c, str) and c for c in self.value)):
                raise ValueError("a choice needs a non-empty list of non-empty strings")
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if self.kind == "regex":
            if not isinstance(self.value, str):
                raise ValueError("a regex must be a string")
            return m.grammar_from_regex(self.value)
        if self.kind in ("json", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return m.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        raise ValueError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # tokenizer -> {vocab_size: Vocabulary}


class Vocabulary:
    """A tokenizer's tokens as llguidance sees them (their bytes; `eot_id` ends a text) for a model of `vocab_size`
    logits (ids past the tokenizer's never allowed). Built once per tokenizer and size (~0.2 s for GPT-2's): of();
    `kernel`: whether duolm.kernels.masked_logits runs here (kernels.ready(): the kernels built now where they
    were not, once a machine)."""

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import llguidance
        except ImportError:
            raise ImportError("structured output needs the 'grammar' extra: pip install 'duolm[grammar]'") from None
        n = tokenizer.vocab_size
        if n > vocab_size:
            raise ValueError(f"the tokenizer has {n} tokens, the model {vocab_size} logits")

        class Tokens:                       # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = tokenizer.eot_id, None
            tokens = [tokenizer.decode_bytes([i]) for i in range(n)]
            special_token_ids = list(tokenizer.special_tokens.values())

            def __call__(self, text: bytes) -> list:
                return tokenizer.encode(text.decode("utf-8", "replace"), disallowed_special=())

        self.vocab_size, self.eot_id = vocab_size, tokenizer.eot_id
        self.words = (vocab_size + 31) // 32            # a bitmask's int32 words: 32 tokens each
        self.llg_bytes = 4 * ((n + 31) // 32)           # the words llguidance writes: the tokenizer's (the rest stay 0)
        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()))
        self._llguidance = llguidance
        self.kernel = kernels.ready()       # constrain's kernel runs here: built now (once a machine), not at a draw

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> "Vocabulary":
        """The tokenizer's Vocabulary for a model of vocab_size logits, built on first use and kept with it."""
        sizes = _VOCABULARIES.setdefault(tokenizer, {})
        if vocab_size not in sizes:
            sizes[vocab_size] = cls(tokenizer, vocab_size)
        return sizes[vocab_size]

    def compile(self, grammar: Grammar) -> str:
        """The grammar checked against this vocabulary, in llguidance's form: a ValueError saying what is wrong for a
        grammar it cannot compile (a regex or schema it does not support, a value of the wrong type)."""
        source = grammar.source()
        failed, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(source, self.llg)
        if failed:
            raise ValueError(" ".join(" ".join(messages).split()))      # (a regex error spans lines)
        return source

    def constraint(self, grammar: Grammar | str) -> "Constraint":
        """A new sequence's Constraint under `grammar` (a Grammar, or what compile() returned)."""
        return Constraint(self, self.compile(grammar) if isinstance(grammar, Grammar) else grammar)


class Constraint:
    """One sequence's state under a grammar: mask() the logits of its next draw, advance() by the token drawn."""

    def __init__(self, vocab: Vocabulary, source: str):
        self.vocab = vocab
        self.matcher = vocab._llguidance.LLMatcher(vocab.llg, source, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self._bitmask = torch.zeros(1, vocab.words, dtype=torch.int32)     # rewritten for each text
        self._compute()

    def _compute(self) -> None:
        """The mask of the text so far, computed as soon as the text is known (here and in advance()): the parser and
        the trie have just been used, and are still in the CPU's caches, which the model's forward then fills with its
        weights (walked at the draw, after the forward, the same mask took several times as long)."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self.vocab.llg_bytes)
        self._penalty = None

    def bitmask(self) -> torch.Tensor:
        """(1, W) int32, bit t % 32 of word t // 32 set when token t may come next (end of text when the text so far
        is complete; ids past the tokenizer's never): this sequence's buffer, computed once for the text so far."""
        return self._bitmask

    def penalty(self) -> torch.Tensor:
        """(1, V) float32: 0 where bitmask() allows the token, -inf elsewhere (penalty_rows), once a text."""
        if self._penalty is None:
            self._penalty = penalty_rows(self._bitmask, self.vocab.vocab_size)
        return self._penalty

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) of this sequence's next draw -> a copy with the disallowed tokens at -inf."""
        return constrain(logits, [self])

    def advance(self, token: int) -> bool:
        """The token drawn (one mask() allowed); True when the text is complete and nothing may follow it."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not continue the grammar: {self.matcher.get_error()}")
        self._compute()
        return self.matcher.is_stopped()


NEG_INF_BITS = -(1 << 23)   # float32 -inf as an int32 (0xff800000); 0 is 0.0


def penalty_rows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask (K, W) int32 (Constraint.bitmask's rows) -> (K, vocab_size) float32 of 0 (token allowed) and -inf: the
    words' bits inverted and unpacked, little-endian (byte k of word w holds tokens 32w + 8k to 32w + 8k + 7, its bit i
    the token 32w + 8k + i), one byte a token, times -inf's bits as an int32 viewed as float32, in numpy (a bool mask
    filled or a table looked up per token is several times slower; torch's ops would wake its threads). The word 5 has bits 0 and 2: tokens 0 and 2
    allowed.

    >>> penalty_rows(torch.tensor([[5]], dtype=torch.int32), 4).tolist()
    [[0.0, -inf, 0.0, -inf]]
    """
    off = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(np.multiply(off, NEG_INF_BITS, dtype=np.int32).view(np.float32))


def constrain(logits: torch.Tensor, constraints) -> torch.Tensor:
    """logits (B, V) with each row masked by its constraint (a Constraint, or None: left as it is): a new tensor, the
    disallowed tokens at -inf; `logits` itself when no row has one."""
    rows = [j for j, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    if logits.is_cpu and logits.dtype is torch.float32 and constraints[rows[0]].vocab.kernel:   # (cheap to ask after a
        return kernels.masked_logits(logits, [constraints[j].bitmask() for j in rows], rows)    # forward: no device)
    bias = torch.cat([constraints[j].penalty() for j in rows]) if len(rows) > 1 else constraints[rows[0]].penalty()
    bias = bias.to(logits.device, logits.dtype)
    if len(rows) == len(logits):
        return logits + bias
    return logits.index_add(0, torch.tensor(rows, device=logits.device), bias)
