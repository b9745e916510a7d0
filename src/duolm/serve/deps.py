"""What the routes share: the served model (`Served`) and the FastAPI dependencies in front of them.

In the order they run: 503 while the server drains (SIGTERM), 401 without the API key, 400 on a route
the served model cannot answer (a route of the other family, or of another head), 429 beyond
max_concurrency + max_queue requests in the server (with Retry-After). create_app puts the first two
in front of every route but /health (and /metrics, which stays open while draining); a route that puts
the model to work gets the last two from `Served.model_route`. The 503 also answers while the worker warms up
(serve --compile).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from duolm.models.heads import HEAD_MODELS
from duolm.convert.st import Pooling
from duolm.serve.metrics import Admission, Metrics
from duolm.serve.schemas import APIError

RETRY_AFTER_S = 1
_bearer = HTTPBearer(auto_error=False, description="the server's API key (duolm serve --api-key-file)")


class Worker(Protocol):
    """The thread that runs the model's work: scheduler.Scheduler (GPT-2 decoding, rows submitted by
    the completions route) or encoders.EncoderWorker (batched BERT and head jobs). Their submit()
    differs with the work; the app starts and stops them alike, and /metrics reports their stats(). `warming`: None
    once it serves, else how far its warm-up is (the server answers 503 until then)."""

    warming: str | None

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def stats(self) -> dict: ...


@dataclass(eq=False)
class Served:
    """One model served: the model (in eval mode) and its tokenizer, the id clients send (`name`),
    the worker that runs it, the admission counter, the server's metrics, the API key (None: open), and
    for BERT the embeddings' pooling. Its methods are the routes' dependencies."""

    model: object
    tokenizer: object
    name: str
    worker: Worker
    admission: Admission
    metrics: Metrics
    api_key: str | None = None
    pooling: Pooling = field(default_factory=Pooling)

    @property
    def family(self) -> str:
        return self.model.config.family

    @property
    def head(self):
        """The fine-tuned head's HeadConfig, or None."""
        return self.model.head if isinstance(self.model, HEAD_MODELS) else None

    @property
    def description(self) -> str:
        head = self.head
        return type(self.model).__name__ + (f", a fine-tuned {head.kind} head" if head else "")

    # --- dependencies: coroutines, which FastAPI runs on the event loop (a plain function goes through a thread) --

    async def accepting(self, request: Request) -> None:
        """503 while the server drains (run() sets app.state.draining on SIGTERM) and while the worker warms up (serve
        --compile compiles its shapes before the first request: no request waits for a compilation)."""
        if request.app.state.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if self.worker.warming is not None:
            raise APIError(503, f"the server is warming up: {self.worker.warming}; GET /health answers 200 when it is "
                                "ready", None, "warming_up", {"Retry-After": str(RETRY_AFTER_S)})

    async def authorized(self, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        """401 unless the request sends `Authorization: Bearer KEY` (compared in constant time)."""
        if self.api_key is None:
            return
        given = b"" if credentials is None else credentials.credentials.encode("latin-1")   # the header's bytes
        if not hmac.compare_digest(given, self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                           None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def model_route(self, ok: bool, what: str) -> dict:
        """The options of a route that puts the model to work and needs `what` of it (ok: the served
        model has it): a 400 naming the served model unless ok, then admission; in the docs if ok."""
        async def needs(request: Request) -> None:
            if not ok:
                raise APIError(400, f"{request.url.path} needs {what}; this server runs a "
                                    f"{self.family} model ({self.description})", "model", "model_family_mismatch")
        return {"include_in_schema": ok, "dependencies": [Depends(needs), Depends(self.admit)]}

    async def admit(self):
        """Holds one of the server's places for the request, until its response has been sent (a
        stream: to its end or the client's leaving; FastAPI >= 0.118 runs a dependency's code after
        yield then); none free: 429 at once, before any work."""
        if not self.admission.enter():
            raise APIError(429, f"the server is at capacity ({self.admission.limit} requests in flight); "
                                f"retry after {RETRY_AFTER_S} s", None, "rate_limit_exceeded",
                           {"Retry-After": str(RETRY_AFTER_S)})
        try:
            yield
        finally:
            self.admission.leave()

    def check_model(self, asked: str | None) -> None:
        """404 when the body names a model other than the one served (None: any)."""
        if asked is not None and asked != self.name:
            raise APIError(404, f"model {asked!r} does not exist; this server serves {self.name!r}",
                           "model", "model_not_found")
