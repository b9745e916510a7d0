"""The HTTP application: OpenAI-compatible routes over one model, with limits in front of them.

The routes are APIRouters: status.py and tokens.py (every model), then one module per kind of model:
gpt2.py, bert.py, heads.py (fine-tuned heads) and rerank.py (score and rerank: pair heads, embedding models).
Every route is mounted; one the served model cannot answer is a 400 naming the model and stays out of the
OpenAPI docs: GET /openapi.json (and /docs) lists the routes this server answers, as a 404's message does.

In front of the app (the `_Gate` middleware): bodies over `max_body_bytes` 413, bodies not in within `body_timeout`
408, and the metrics of every request. Then the dependencies (deps.py): while draining (SIGTERM) 503; with an API key,
`Authorization: Bearer KEY` on every route but /health (401 otherwise, compared in constant time); a
route for another model 400; more than max_concurrency + max_queue requests in the server 429 with
Retry-After. Inside: a bad field 400 naming it.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import torch
from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from duolm.convert.st import Pooling
from duolm.models import GPT2
from duolm.precision import quantize, resolve
from duolm.serve import ServeConfig, bert, gpt2, heads, rerank, status, tokens
from duolm.serve.deps import Served
from duolm.serve.encoders import EncoderWorker
from duolm.serve.metrics import Admission, Connections, Metrics
from duolm.serve.scheduler import Scheduler
from duolm.serve.schemas import APIError


def create_app(model, tokenizer, config: ServeConfig | None = None, pooling: Pooling | None = None) -> FastAPI:
    """A FastAPI app serving `model` (GPT2, Bert, BertForPreTraining or a head model of duolm.models.heads,
    in eval mode) with its tokenizer, as `config` says (its model_name, api_key, max_concurrency, max_queue,
    max_body_bytes, batch_window_s, batch_invariant, compile (None: on for CUDA), prefix_cache(_mb), precision: duolm.precision.quantize swaps the model's linears,
    in place, for it).
    pooling: how BERT embeddings are pooled (encoders.read_pooling;
    default [CLS], normalised). The model's worker thread runs while the app's lifespan does."""
    opts = config or ServeConfig()
    if opts.max_concurrency < 1 or opts.max_queue < 0 or opts.max_connections < 1:
        raise ValueError(f"max_concurrency={opts.max_concurrency} and max_connections={opts.max_connections} must be "
                         f">= 1 and max_queue={opts.max_queue} >= 0")
    for timeout in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(opts, timeout) > 0:
            raise ValueError(f"{timeout}={getattr(opts, timeout)} must be > 0 seconds")
    name = opts.model_name or "duolm"
    metrics = Metrics(name)
    quantize(model, resolve(opts.precision, opts.device, training=False))
    compile = opts.compile if opts.compile is not None else torch.device(opts.device).type == "cuda"
    cache_mb = opts.prefix_cache_mb if opts.prefix_cache else 0
    worker = (Scheduler(model, opts.max_concurrency, metrics.sequence, opts.batch_invariant, compile, cache_mb)
              if isinstance(model, GPT2) else EncoderWorker(opts.batch_window_s))
    admission, connections = Admission(opts.max_concurrency + opts.max_queue), Connections(opts.max_connections)
    metrics.watch(admission.stats, connections.stats, worker.stats)
    s = Served(model, tokenizer, name, worker, admission, metrics, opts.api_key, pooling or Pooling())

    @asynccontextmanager
    async def lifespan(app):
        s.worker.start()
        try:
            yield
        finally:
            s.worker.stop(timeout=10)

    app = FastAPI(title="duolm", lifespan=lifespan)
    app.state.draining = False
    app.state.connections = connections          # the HTTP protocol counts into it (protocol.py)
    guard = [Depends(s.accepting), Depends(s.authorized)]       # status.py guards its own: /health is open
    routers = [(status.router(s), []), (tokens.router(s), guard), (gpt2.router(s), guard), (bert.router(s), guard),
               (heads.router(s), guard), (rerank.router(s), guard)]
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    app.state.routes = [route for router, _ in routers for route in router.routes]
    app.add_middleware(_Gate, routes=app.state.routes, metrics=s.metrics, connections=connections,
                       max_body_bytes=opts.max_body_bytes, body_timeout=opts.body_timeout)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    return app


async def _api_error(request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _invalid(request, e: RequestValidationError):
    # a union's members each fail: the one of the input's type says what is wrong (an error that is not of a type),
    # else the one that went deepest into the input ({"text": 5} in documents: Document's text, not "not a str")
    err = max(e.errors(), key=lambda x: (not x["type"].endswith("_type"), len(x["loc"])))
    if err["type"] == "json_invalid":
        return JSONResponse(APIError(400, f"body is not valid JSON: {err['msg']}").body(), status_code=400)
    loc = [str(x) for x in err["loc"][1:]]     # past where it was sent (body, query, path): a field may be "query"
    msg = f"{'.'.join(loc) or 'body'}: {err['msg']}"
    return JSONResponse(APIError(400, msg, loc[0] if loc else None).body(), status_code=400)


async def _http(request, e: HTTPException):
    message = str(e.detail)
    if e.status_code == 404:          # no route: say which there are
        routes = ", ".join(served_routes(request.app.state.routes))
        message = f"no route {request.url.path}; this server answers {routes}"
    return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)


def served_routes(routes) -> list[str]:
    """The routes (APIRoute) the model is served on, as "METHOD /path": those in the OpenAPI docs."""
    return [f"{method} {r.path}" for r in routes if r.include_in_schema for method in sorted(r.methods)]


class _Gate:
    """ASGI middleware: every request's body read before the app runs, within `body_timeout` seconds of its headers
    (else 408) and up to `max_body_bytes` (else 413, before the app reads it); and the metrics of every request, by
    route (a path of `routes`, else "other").

    The body's deadline is kept here, where the body is read, rather than in the HTTP protocol (protocol.py bounds the
    headers): the 408 is then an answer like any other, counted by route; it closes the connection, whose unread
    rest of the body would otherwise be taken for the next request."""

    def __init__(self, app, routes: list, metrics: Metrics, connections: Connections, max_body_bytes: int,
                 body_timeout: float):
        self.app, self.metrics, self.connections = app, metrics, connections
        self.paths = {r.path for r in routes}
        self.max_body, self.body_timeout = max_body_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        t0 = time.perf_counter()
        status = 500

        async def send_(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            error, receive = await self._read_body(scope, receive)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send_)
            elif receive is None:
                status = 499                               # the client left while sending
            else:
                await self.app(scope, receive, send_)
        finally:
            self.metrics.observe(path if path in self.paths else "other", status, time.perf_counter() - t0)

    async def _read_body(self, scope, receive):
        """-> (error, receive): the body read up to the limit, replayed to the app by the new receive
        (None when the client left)."""
        too_big = APIError(413, f"request body is larger than {self.max_body} bytes", None, "body_too_large",
                           {"Connection": "close"})
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return too_big, receive
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                self.connections.body_timeouts += 1
                return APIError(408, f"the request's body did not arrive within {self.body_timeout:g} s", None,
                                "body_timeout", {"Connection": "close"}), receive
            if msg["type"] == "http.disconnect":
                return None, None
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return too_big, receive
            if not msg.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()
        return None, replay
