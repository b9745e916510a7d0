"""The routes every server answers, whatever its model: GET /health (open, for load balancers; 503 until the model
is ready and while draining),
GET /metrics (Prometheus' text format, or JSON; open while draining, to watch the drain) and GET /v1/models (OpenAI's model list: the
one model's card)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from duolm.serve.deps import Served
from duolm.serve.metrics import CONTENT_TYPE


def router(s: Served) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health(request: Request):
        """200 {"status": "ok"}; 503 {"status": "draining"} after SIGTERM, {"status": "warming up", "detail": how far}
        while the worker compiles its shapes (serve --compile: warmup.py)."""
        if request.app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if s.worker.warming is not None:
            return JSONResponse({"status": "warming up", "detail": s.worker.warming}, status_code=503)
        return {"status": "ok"}

    @r.get("/metrics", dependencies=[Depends(s.authorized)])
    async def metrics(format: Literal["prometheus", "json"] = "prometheus"):
        """Prometheus' text format (vLLM's names where the quantity is vLLM's), or with ?format=json the
        same for people: requests by route and status, latency percentiles, admission, the worker's stats."""
        if format == "json":
            return s.metrics.report()
        return Response(s.metrics.text(), media_type=CONTENT_TYPE)

    @r.get("/v1/models", dependencies=[Depends(s.accepting), Depends(s.authorized)])
    async def models():
        """The served model's card: its id, family and context length; BERT's pooling; a
        fine-tuned head's kind, labels, task and max_length."""
        card = {"id": s.name, "object": "model", "created": int(s.metrics.started), "owned_by": "duolm",
                "family": s.family, "context_length": s.model.config.block_size}
        if s.family == "bert":
            card["pooling"] = vars(s.pooling)
        head = s.head
        if head is not None:
            card["head"] = {"kind": head.kind, "labels": head.labels, "task": head.task, "max_length": head.max_length}
        return {"object": "list", "data": [card]}
    return r
