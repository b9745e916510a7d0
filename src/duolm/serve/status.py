"""The routes every server answers, whatever its model: GET /health (open, for load balancers),
GET /metrics (open while draining, to watch the drain) and GET /v1/models (OpenAI's model list: the
one model's card)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from duolm.serve.deps import Served


def router(s: Served) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health(request: Request):
        """200 {"status": "ok"}, or 503 {"status": "draining"} after SIGTERM."""
        if request.app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @r.get("/metrics", dependencies=[Depends(s.authorized)])
    async def metrics():
        """Requests by route and status, latency percentiles, admission, the worker's stats."""
        return {**s.metrics.report(), **s.admission.stats(), **s.worker.stats(), "uptime_s": time.time() - s.started}

    @r.get("/v1/models", dependencies=[Depends(s.accepting), Depends(s.authorized)])
    async def models():
        """The served model's card: its id, family and context length; BERT's pooling; a
        fine-tuned head's kind, labels, task and max_length."""
        card = {"id": s.name, "object": "model", "created": int(s.started), "owned_by": "duolm",
                "family": s.family, "context_length": s.model.config.block_size}
        if s.family == "bert":
            card["pooling"] = vars(s.pooling)
        head = s.head
        if head is not None:
            card["head"] = {"kind": head.kind, "labels": head.labels, "task": head.task, "max_length": head.max_length}
        return {"object": "list", "data": [card]}
    return r
