"""BERT's routes: POST /v1/embeddings (OpenAI's, pooled as the checkpoint was trained), POST /v1/fill-mask and, for a
BERT with its masked-LM head, POST /v1/completions as clients send it to score text (max_tokens 0, echo, logprobs:
lm-evaluation-harness's and the openai client's way): each token's pseudo-log-likelihood term. Their requests run in
batches by the encoders.EncoderWorker.

A route of this kind validates its body, builds its items (tokenizing, in a worker thread) and
awaits `worker.submit(fn, items)`, fn a batched function items -> results made once per app (jobs for
the same fn that arrive together run as one call).
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from duolm.models import BertForPreTraining
from duolm.serve.completions import to_id_lists
from duolm.serve.deps import Served
from duolm.serve.encoders import embed
from duolm.evaluation.scoring import score_sentences
from duolm.serve.schemas import MAX_INPUTS, APIError, CompletionRequest, EmbeddingRequest, FillMaskRequest
from duolm.textgen import fill_mask_text


async def run_batch(s: Served, fn, inputs) -> tuple[list, list]:
    """(items, fn's results for them): inputs() builds the items in a worker thread, then they run
    in a batch on the served model's EncoderWorker."""
    items = await run_in_threadpool(inputs)
    return items, await asyncio.wrap_future(s.worker.submit(fn, items))


def router(s: Served) -> APIRouter:
    """POST /v1/embeddings for any BERT, POST /v1/fill-mask for one with its masked-LM head; a 400
    for any other model."""
    r = APIRouter()
    model, tok, cfg = s.model, s.tokenizer, s.model.config
    bert, mlm = s.family == "bert", isinstance(s.model, BertForPreTraining)

    def embed_fn(ids):
        return embed(model, ids, s.pooling)

    @r.post("/v1/embeddings", **s.model_route(bert, "a BERT model"))
    async def embeddings(body: EmbeddingRequest):
        """OpenAI's embeddings: one vector per input, pooled as GET /v1/models says."""
        s.check_model(body.model)
        if body.dimensions is not None and body.dimensions != cfg.n_embd:
            raise APIError(400, f"dimensions: this model's embeddings have {cfg.n_embd} dimensions", "dimensions")
        limit = s.pooling.max_length or cfg.block_size
        keep = limit if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
        if keep is not None and not 2 <= keep <= limit:
            raise APIError(400, f"truncate_prompt_tokens={keep}: cut inputs to 2 to {limit} tokens (-1: {limit})",
                           "truncate_prompt_tokens")
        lengths = []

        def inputs():
            ids = bert_inputs(body.input, tok, limit if keep is None else None)
            lengths.extend(map(len, ids))
            return ids if keep is None else [truncated(x, keep) for x in ids]
        ids, vecs = await run_batch(s, embed_fn, inputs)
        if body.encoding_format == "base64":
            data = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vecs]
        else:
            data = [v.tolist() for v in vecs]
        n = sum(map(len, ids))
        items = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)]
        for item, x, n_in in zip(items, ids, lengths):
            if len(x) < n_in:
                item["truncated"] = True
        return {"object": "list", "model": s.name, "usage": {"prompt_tokens": n, "total_tokens": n}, "data": items}

    def fill_fn(items):
        return [fill_mask_text(model, tok, text, top_k) for text, top_k in items]

    @r.post("/v1/fill-mask", **s.model_route(bert and mlm, "a BERT model with its masked-LM head"))
    async def fill_mask(body: FillMaskRequest):
        """The top_k fillers of each [MASK] with their probabilities, and the text with the best ones."""
        s.check_model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input

        def inputs():        # checked here, so that one bad input never fails a batch
            for i, ids in enumerate(bert_inputs(texts, tok, cfg.block_size)):
                if tok.mask_id not in ids:
                    raise APIError(400, f"input[{i}] has no [MASK] to fill", "input")
            return [(t, body.top_k) for t in texts]
        _, results = await run_batch(s, fill_fn, inputs)
        data = [{"index": i, "text": filled, "masks": [
                    [{"token": tok.vocab[piece], "token_str": piece, "score": p} for piece, p in fillers]
                    for fillers in masks]}
                for i, (masks, filled) in enumerate(results)]
        return {"object": "list", "model": s.name, "data": data}

    if mlm:
        score_route(r, s)
    return r


def score_route(r: APIRouter, s: Served) -> None:
    """POST /v1/completions on a BERT with its masked-LM head, as clients send it to score text."""
    model, tok, cfg = s.model, s.tokenizer, s.model.config

    def pll_fn(texts):
        return score_sentences(model, tok, texts)

    @r.post("/v1/completions", **s.model_route(True, "a BERT model with its masked-LM head"))
    async def score(body: CompletionRequest):
        """Scoring text: each prompt's tokens with their pseudo-log-likelihood terms (log p(token | the text with
        it masked)), as logprobs of an echoed completion of no new tokens."""
        s.check_model(body.model)
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if body.max_tokens != 0 or not body.echo or not all(isinstance(t, str) for t in texts):
            raise APIError(400, "prompt: a BERT model scores text and writes none: send texts with max_tokens 0 "
                                "and echo true", "max_tokens" if body.max_tokens != 0 else "prompt")

        def inputs():          # checked here, so that one bad prompt never fails a batch
            for i, t in enumerate(texts):
                if not t.strip():
                    raise APIError(400, f"prompt[{i}] is empty: there is nothing to score", "prompt")
            bert_inputs(texts, tok, cfg.block_size)
            return texts
        _, scores = await run_batch(s, pll_fn, inputs)
        choices = [{"index": i, "text": t, "finish_reason": "length", "logprobs": {
            "tokens": r["tokens"], "token_logprobs": r["token_scores"], "top_logprobs": None, "text_offset": None}}
                   for i, (t, r) in enumerate(zip(texts, scores))]
        n = sum(len(r["tokens"]) + 2 for r in scores)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": s.name, "choices": choices,
                "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


def bert_inputs(value, tokenizer, limit: int | None) -> list:
    """Texts -> [CLS] pieces [SEP]; token-id lists (word pieces) get [CLS] and [SEP] around them.
    More than MAX_INPUTS inputs, or one longer than `limit` tokens (None: no limit), raise APIError(400)."""
    ids = to_id_lists(value, "input", tokenizer.encode, tokenizer.vocab_size)
    if len(ids) > MAX_INPUTS:
        raise APIError(400, f"input: {len(ids)} inputs, at most {MAX_INPUTS} per request", "input")
    raw = isinstance(value, list) and value and not isinstance(value[0], str)
    if raw:
        ids = [[tokenizer.cls_id, *x, tokenizer.sep_id] for x in ids]
    for i, x in enumerate(ids):
        if limit is not None and len(x) > limit:
            which = f" (input {i})" if len(ids) > 1 else ""
            raise APIError(400, f"input has {len(x)} tokens, limit {limit}{which}", "input")
    return ids


def truncated(ids: list, keep: int) -> list:
    """[CLS] pieces [SEP] of more than `keep` tokens cut to the first keep - 1 and [SEP] (HF's and
    sentence-transformers' truncation); shorter ones as they are."""
    return ids if len(ids) <= keep else ids[:keep - 1] + ids[-1:]
