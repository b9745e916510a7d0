"""POST /v1/score (vLLM's) and POST /v1/rerank, /rerank (Jina's and Cohere's, as vLLM serves them): how relevant
each text is to one text (the query), for

- a fine-tuned pair head, a cross-encoder: tasks.sentence.pair_scores, the function `duolm predict --score` runs
  (a regressor's value; a 2-label classifier's probability of its second label);
- a BERT without a head, an embedding model: the cosine of the two texts' embeddings, pooled as /v1/embeddings
  pools them (encoders.embed).

Inputs over the model's limit are refused (400) unless the request sends vLLM's truncate_prompt_tokens: -1 (a pair
loses tokens from its longer text first, as the head was fine-tuned; an embedded text keeps its first tokens).
Requests run in batches on the encoders.EncoderWorker like every BERT route's.
"""
from __future__ import annotations

import time
import uuid

import torch
import torch.nn.functional as F
from fastapi import APIRouter

from duolm.serve.bert import run_batch, truncated
from duolm.serve.deps import Served
from duolm.serve.encoders import embed
from duolm.serve.schemas import APIError, RerankRequest, ScoreRequest
from duolm.tasks.sentence import pair_scores, scores_pairs

PATHS = ("/v1/rerank", "/rerank")


def router(s: Served) -> APIRouter:
    """The score and rerank routes: for a pair head or a BERT embedding model; a 400 for any other model."""
    r = APIRouter()
    head, tok = s.head, s.tokenizer
    pairs = head is not None and scores_pairs(head)
    ok = pairs or (head is None and s.family == "bert")
    what = "a fine-tuned pair classifier of 2 labels or regressor, or a BERT embedding model"
    limit = head.max_length if head is not None else s.pooling.max_length or s.model.config.block_size

    def pair_fn(items):
        return pair_scores(s.model, tok, items)

    def embed_fn(ids):
        return embed(s.model, ids, s.pooling)

    def embed_inputs(query: str, texts: list[str], names: tuple[str, str], cut: bool) -> list:
        ids = [tok.encode(t) for t in [query, *texts]]
        long = next((i for i, x in enumerate(ids) if len(x) > limit), None)
        if long is not None and not cut:
            field, name = (names[0], names[0]) if long == 0 else (names[1], f"{names[1]}[{long - 1}]")
            raise APIError(400, f"{name} has {len(ids[long])} tokens, limit {limit}; send truncate_prompt_tokens: -1 "
                                "to cut it", field)
        return [truncated(x, limit) for x in ids]

    async def relevance(query: str, texts: list[str], names: tuple[str, str], cut: bool) -> tuple[list[float], int]:
        """Each text's score against the query, and the number of tokens the model read."""
        if not pairs:
            ids, vecs = await run_batch(s, embed_fn, lambda: embed_inputs(query, texts, names, cut))
            return F.cosine_similarity(vecs[0][None], torch.stack(vecs[1:])).tolist(), sum(map(len, ids))
        _, results = await run_batch(s, pair_fn, lambda: [(query, t) for t in texts])
        long = next((i for i, x in enumerate(results) if x.get("truncated")), None)
        if long is not None and not cut:
            raise APIError(400, f"{names[0]} and {names[1]}[{long}] are longer than {limit} tokens together, the "
                                "model's limit; send truncate_prompt_tokens: -1 to cut such pairs", names[1])
        return [x["score"] for x in results], sum(x["tokens"] for x in results)

    @r.post("/v1/score", **s.model_route(ok, what))
    async def score(body: ScoreRequest):
        """vLLM's score: text_1 against text_2, or against each text of a list."""
        s.check_model(body.model)
        texts = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        values, n = await relevance(body.text_1, texts, ("text_1", "text_2"), body.truncate_prompt_tokens == -1)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": s.name,
                "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    async def rerank(body: RerankRequest):
        """The documents by relevance to the query, highest first (the first top_n); each with its index in the
        request and, unless return_documents is false, its text."""
        s.check_model(body.model)
        texts = body.texts()
        values, n = await relevance(body.query, texts, ("query", "documents"), body.truncate_prompt_tokens == -1)
        order = sorted(range(len(texts)), key=lambda i: -values[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": values[i]} for i in order]
        if body.return_documents:
            for x in results:
                x["document"] = {"text": texts[x["index"]]}
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": s.name, "usage": {"total_tokens": n}, "results": results}

    for path in PATHS:
        r.add_api_route(path, rerank, methods=["POST"], **s.model_route(ok, what))
    return r
