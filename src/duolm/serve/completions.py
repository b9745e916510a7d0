"""POST /v1/completions in OpenAI's shape: prompts to rows for the scheduler, rows' tokens back to
text (UTF-8 safe, stop strings, end of text), the response body and its server-sent-event chunks.

Choice i * n + j is the j-th sample for prompt i, drawn with seed `seed + i * n + j` (a random seed
when the request gives none), so one prompt with `seed` gives the text and the end that
`duolm.generation.generate_text(model, tokenizer, prompt, max_tokens, ..., stop=stop, seed=seed)`
gives. presence_penalty, frequency_penalty and logit_bias change the logits each draw is made from
(draws.penalized); log-probabilities are those of the raw model (before penalties, temperature,
top-k and top-p).
"""
from __future__ import annotations

import json
import random
import time

from duolm.textgen import TextStream
from duolm.serve.rows import Row, Sink
from duolm.serve.schemas import APIError, CompletionRequest

DEFAULT_MAX_TOKENS = 16
MAX_ROWS = 128      # prompts x n in one request
# The seeds of requests that give none and the responses' ids: drawn from a generator seeded once from the system's
# randomness, not from it at each request (a system call, which gives the GIL away to the decode thread).
_RANDOM = random.Random()


def to_id_lists(value, field: str, encode, vocab_size: int) -> list:
    """An OpenAI prompt / input (a string, list of strings, ids, list of id lists) -> id lists;
    texts through encode(text). Empty inputs and ids outside [0, vocab_size) raise APIError(400)."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise APIError(400, f"{field} must not be empty", field)
    if isinstance(value[0], int):
        value = [value]
    out = []
    for i, x in enumerate(value):
        where = field if len(value) == 1 else f"{field}[{i}]"
        ids = encode(x) if isinstance(x, str) else list(x)
        if not ids:
            raise APIError(400, f"{where} is empty", field)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})", field)
        out.append(ids)
    return out


def encode_text(tokenizer, text: str, allowed_special) -> list:
    """GPT-2's ids for a text of a request: special tokens spelled in it are plain text unless named in
    `allowed_special` (a list of them, or "all"); a name that is no special token raises APIError(400)."""
    try:
        return tokenizer.encode(text, allowed_special="all" if allowed_special == "all" else set(allowed_special),
                                disallowed_special=())
    except ValueError as e:
        raise APIError(400, f"allowed_special: {e}", "allowed_special") from None


def encode_prompts(req: CompletionRequest, tokenizer, config) -> list:
    """The request's prompts as token ids, checked against the model's `config`: ids in its vocabulary,
    at most block_size + 1 - max(max_tokens, 1) of them (the last token drawn is never fed back, so a
    prompt may fill the context when one token is asked for), and the request's other fields (check_fields).
    An empty text prompt means <|endoftext|>."""
    check_fields(req, config.vocab_size)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    eot = tokenizer.eot_id

    def encode(text):
        return [eot] if text == "" and eot is not None else encode_text(tokenizer, text, req.allowed_special)

    prompts = to_id_lists(req.prompt, "prompt", encode, config.vocab_size)
    block_size = config.block_size
    limit = block_size + 1 - max(max_tokens, 1)
    if limit < 1:
        raise APIError(400, f"max_tokens={max_tokens} leaves no room for a prompt in the context of "
                            f"{block_size} tokens", "max_tokens")
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            which = f" (prompt {i})" if len(prompts) > 1 else ""
            raise APIError(400, f"prompt has {len(ids)} tokens, limit {limit}{which}: the context is "
                                f"{block_size} tokens and max_tokens is {max_tokens}", "prompt")
    if len(prompts) * req.n > MAX_ROWS:
        raise APIError(400, f"n: {len(prompts)} prompts x n={req.n} is more than {MAX_ROWS} sequences", "n")
    return prompts


def check_fields(req: CompletionRequest, vocab_size: int) -> None:
    """APIError(400) naming the field for a value duolm does not do: best_of other than n (no ranking of
    extra samples), a non-empty suffix (GPT-2 does not insert text), a logit_bias key that is not a
    token id of the model. Their neutral values (best_of = n, suffix "", logit_bias {}) are accepted."""
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of={req.best_of}: only best_of = n ({req.n}) is supported; duolm does not "
                            "rank extra samples", "best_of")
    if req.suffix:
        raise APIError(400, "suffix: text after the completion is not supported (GPT-2 does not insert text)",
                       "suffix")
    for key in req.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and key == str(int(key)) and int(key) < vocab_size):
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab_size})", "logit_bias")


class Choice(Sink):
    """Turns one row's tokens into text and hands events to `put` (thread-safe) as tuples:
    ("prompt", index, logprobs), ("token", index, text, token, logprob), ("done", index, text, reason). A choice not
    streamed (stream=False) holds its token events and hands them over at its end, as ("tokens", index, [events]) before
    its "done": one event for the event loop to take a row instead of one a token."""

    def __init__(self, index: int, tokenizer, stop, put, stream: bool = True):
        self.index, self._tok, self._put = index, tokenizer, put
        self._text = TextStream(stop)
        self._held = None if stream else []

    def prompt(self, logprobs):
        self._put(("prompt", self.index, logprobs))

    def token(self, token, logprobs):
        end = token == self._tok.eot_id
        text = self._text.finish() if end else self._text.feed(self._tok.decode_bytes([token]))
        ev = ("token", self.index, text, token, logprobs)
        if self._held is None:
            self._put(ev)
        else:
            self._held.append(ev)
        return end or self._text.stopped

    def done(self, reason):
        if self._held:
            self._put(("tokens", self.index, self._held))
            self._held = []
        self._put(("done", self.index, self._text.finish(), reason))


def make_rows(req: CompletionRequest, prompts: list, tokenizer, put, constraints=None) -> list:
    """The rows of a request (choice i * n + j: prompt i's j-th), each with its constraint (structured.constraints:
    one a row, or None)."""
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    rows = []
    for i, ids in enumerate(prompts):
        for j in range(req.n):
            k = i * req.n + j
            seed = _RANDOM.getrandbits(63) if req.seed is None else (req.seed + k) % 2 ** 63
            rows.append(Row(
                prompt=ids, seed=seed,
                max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k, top_p=req.top_p, logprobs=req.logprobs,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
                prompt_logprobs=req.echo and req.logprobs is not None,
                constraint=None if constraints is None else constraints[k],
                sink=Choice(k, tokenizer, stop, put, stream=bool(req.stream))))
    return rows


class Completion:
    """Builds the response from the rows' events: `apply(event)` returns the stream chunk's choice
    for it (or None); `body()` is the whole non-streamed response."""

    def __init__(self, req: CompletionRequest, prompts: list, tokenizer, model_name: str):
        self.req, self.tok, self.model = req, tokenizer, model_name
        self.id = f"cmpl-{_RANDOM.getrandbits(128):032x}"
        self.created = int(time.time())
        self.prompt_tokens = sum(map(len, prompts))
        n = len(prompts) * req.n
        self.prompts = [prompts[k // req.n] for k in range(n)]
        self.text = [""] * n
        self.tokens = [[] for _ in range(n)]
        self.lp = [None if req.logprobs is None else _Logprobs() for _ in range(n)]
        self.reason = [None] * n
        self.pending = n

    def start(self) -> list:
        """Chunk choices to send first: the echoed prompts (those with logprobs come with them)."""
        if not self.req.echo or self.req.logprobs is not None:
            return []
        return [self.apply(("prompt", k, None)) for k in range(len(self.text))]

    def apply(self, ev):
        kind, k = ev[0], ev[1]
        lp = self.lp[k]
        if kind == "prompt":
            text = self.tok.decode(self.prompts[k])
            if ev[2] is not None:
                for t, info in zip(self.prompts[k], ev[2]):
                    lp.add(self.tok, t, info)
            return self._piece(k, text, lp.since() if lp else None)
        if kind == "tokens":           # a choice not streamed: its token events at its end
            for e in ev[2]:
                self.apply(e)
            return None
        if kind == "token":
            _, _, text, token, info = ev
            self.tokens[k].append(token)
            if lp is not None:
                lp.add(self.tok, token, info)
            return self._piece(k, text, lp.since() if lp else None) if text or lp else None
        _, _, text, reason = ev
        self.reason[k] = reason
        self.pending -= 1
        choice = self._piece(k, text, None)
        choice["finish_reason"] = "stop" if reason == "stop" else "length"
        return choice

    def _piece(self, k, text, logprobs):
        self.text[k] += text
        return {"index": k, "text": text, "logprobs": logprobs, "finish_reason": None}

    def usage(self) -> dict:
        done = sum(map(len, self.tokens))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def chunk(self, choices, usage=None) -> str:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def body(self) -> dict:
        choices = [{"index": k, "text": self.text[k], "finish_reason": "stop" if self.reason[k] == "stop" else "length",
                    "logprobs": None if self.lp[k] is None else self.lp[k].all()} for k in range(len(self.text))]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


class _Logprobs:
    """OpenAI's logprobs object for one choice, built token by token."""

    def __init__(self):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self._offset = self._sent = 0

    def add(self, tok, token, info):
        self.tokens.append(token_name(tok, token))
        self.token_logprobs.append(None if info is None else info[0])
        self.top_logprobs.append(None if info is None else {token_name(tok, i): v for i, v in info[1]})
        self.text_offset.append(self._offset)
        self._offset += len(tok.decode([token]))

    def since(self) -> dict:
        """The entries added since the last call (a stream chunk's share)."""
        a, self._sent = self._sent, len(self.tokens)
        return self._slice(a, self._sent)

    def all(self) -> dict:
        return self._slice(0, len(self.tokens))

    def _slice(self, a, b) -> dict:
        return {"tokens": self.tokens[a:b], "token_logprobs": self.token_logprobs[a:b],
                "top_logprobs": self.top_logprobs[a:b], "text_offset": self.text_offset[a:b]}


def token_name(tokenizer, token: int) -> str:
    """How `logprobs` names a token (in its "tokens" and the keys of "top_logprobs"): its text, or, when its
    bytes are not UTF-8 on their own (part of a character), "bytes:" and their escapes as OpenAI writes
    them, so that no two tokens share a name (two such tokens both decode to U+FFFD).

    >>> from duolm.tokenizers import ByteLevelBPE
    >>> tok = ByteLevelBPE({bytes([i]): i for i in range(256)}, {})
    >>> print(*[token_name(tok, i) for i in (104, 0xe2, 0x82)])
    h bytes:\\xe2 bytes:\\x82
    """
    b = tokenizer.decode_bytes([token])
    try:
        text = b.decode("utf-8")
        if not text.startswith("bytes:"):          # a token spelled "bytes:..." is named by its bytes too
            return text
    except UnicodeDecodeError:
        pass
    return "bytes:" + "".join(f"\\x{c:02x}" for c in b)
