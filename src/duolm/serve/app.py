"""The HTTP application: OpenAI-compatible routes over one model, with limits in front of them.

    GPT-2: POST /v1/completions (continuous batching, scheduler.py)
    BERT:  POST /v1/embeddings, POST /v1/fill-mask (collected into batches, encoders.py)
    a fine-tuned head (duolm.tasks.predict, batched alike): POST /v1/classify (classify,
           regress), /v1/ner (tag), /v1/qa (span); only the one its head answers
    both:  GET /v1/models, GET /health, GET /metrics

In front of every route (the `_Gate` middleware): while draining (SIGTERM) 503; with an API key,
`Authorization: Bearer KEY` on every route but /health (401 otherwise, compared in constant time);
bodies over `max_body_bytes` 413. Inside: a bad field 400 naming it; a route of the other model
family 400; more than max_concurrency + max_queue requests in the server 429 with Retry-After.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from duolm.textgen import fill_mask_text
from duolm.models import GPT2
from duolm.models.heads import HEAD_MODELS, GPT2ForSequence
from duolm.serve import ServeConfig
from duolm.serve.completions import Completion, encode_prompts, make_rows, to_id_lists
from duolm.serve.encoders import EncoderWorker, Pooling, embed
from duolm.serve.metrics import Admission, Metrics
from duolm.serve.scheduler import Scheduler
from duolm.serve.schemas import (MAX_INPUTS, APIError, ClassifyRequest, CompletionRequest, EmbeddingRequest,
                                 FillMaskRequest, NERRequest, QARequest)
from duolm.tasks import predict

ROUTES = ("/v1/completions", "/v1/embeddings", "/v1/fill-mask", "/v1/classify", "/v1/ner", "/v1/qa", "/v1/models",
          "/health", "/metrics")
RETRY_AFTER_S = 1


def create_app(model, tokenizer, config: ServeConfig | None = None, pooling: Pooling | None = None) -> FastAPI:
    """A FastAPI app serving `model` (GPT2, Bert, BertForPreTraining or a head model of duolm.models.heads,
    in eval mode) with its tokenizer, as `config` says (its model_name, api_key, max_concurrency, max_queue,
    max_body_bytes, batch_window_s). pooling: how BERT embeddings are pooled (encoders.read_pooling;
    default [CLS], normalised). The model's worker thread runs while the app's lifespan does."""
    opts = config or ServeConfig()
    name = opts.model_name or "duolm"
    pooling = pooling or Pooling()
    if opts.max_concurrency < 1 or opts.max_queue < 0:
        raise ValueError(f"max_concurrency={opts.max_concurrency} must be >= 1 and max_queue={opts.max_queue} >= 0")
    family = "gpt2" if isinstance(model, (GPT2, GPT2ForSequence)) else "bert"
    head = model.head if isinstance(model, HEAD_MODELS) else None
    served = type(model).__name__ + (f", a fine-tuned {head.kind} head" if head else "")
    cfg = model.config
    worker = Scheduler(model, opts.max_concurrency) if isinstance(model, GPT2) else EncoderWorker(opts.batch_window_s)
    admission = Admission(opts.max_concurrency + opts.max_queue)
    metrics = Metrics()
    started = time.time()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop(timeout=10)

    app = FastAPI(title="duolm", lifespan=lifespan)
    app.state.draining = False
    app.add_middleware(_Gate, state=app.state, metrics=metrics, api_key=opts.api_key,
                       max_body_bytes=opts.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            return JSONResponse(APIError(400, f"body is not valid JSON: {err['msg']}").body(), status_code=400)
        loc = [str(x) for x in err["loc"] if x != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {err['msg']}"
        return JSONResponse(APIError(400, msg, loc[0] if loc else None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    def need(ok: bool, route: str, what: str):
        if not ok:
            raise APIError(400, f"{route} needs {what}; this server runs a {family} model "
                                f"({served})", "model", "model_family_mismatch")

    def check_model(asked):
        if asked is not None and asked != name:
            raise APIError(404, f"model {asked!r} does not exist; this server serves {name!r}",
                           "model", "model_not_found")

    def admit():
        if not admission.enter():
            raise APIError(429, f"the server is at capacity ({admission.limit} requests in flight); "
                                f"retry after {RETRY_AFTER_S} s", None, "rate_limit_exceeded",
                           {"Retry-After": str(RETRY_AFTER_S)})

    # --- routes for both families ---

    @app.get("/health")
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": int(started), "owned_by": "duolm",
                "family": family, "context_length": cfg.block_size}
        if family == "bert":
            card["pooling"] = vars(pooling)
        if head is not None:
            card["head"] = {"kind": head.kind, "labels": head.labels, "task": head.task, "max_length": head.max_length}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_route():
        generated = getattr(worker, "tokens_generated", 0)
        return {**metrics.report(), "in_flight": admission.active, "peak_in_flight": admission.peak,
                "capacity": admission.limit, "rejected": admission.rejected,
                "running": getattr(worker, "running", 0), "queue_depth": worker.waiting,
                "tokens_generated": generated,
                "tokens_per_s": generated / worker.busy_s if worker.busy_s else 0.0,
                "uptime_s": time.time() - started}

    # --- GPT-2 ---

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        need(isinstance(model, GPT2), "/v1/completions", "a GPT-2 language model")
        check_model(body.model)
        admit()                                 # before any work: a full server answers at once
        rows = []

        def cleanup():
            for r in rows:
                r.cancelled = True          # rows still waiting or running leave at the next step
            admission.leave()

        try:
            prompts = await run_in_threadpool(encode_prompts, body, tokenizer, cfg)
            queue: asyncio.Queue = asyncio.Queue()
            comp = Completion(body, prompts, tokenizer, name)
            rows += make_rows(body, prompts, tokenizer, _threadsafe_put(queue))
        except BaseException:
            cleanup()
            raise
        worker.submit(rows)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _Stream(_events(comp, queue, usage), cleanup)
        watch = asyncio.ensure_future(_watch_disconnect(request, queue))
        try:
            while comp.pending:
                ev = await queue.get()
                if ev[0] == "gone":
                    return Response(status_code=499)      # the client left; nobody reads this
                if ev[0] == "done" and ev[3] == "error":
                    raise APIError(500, "generation failed; the server log has the details")
                comp.apply(ev)
            return comp.body()
        finally:
            watch.cancel()
            cleanup()

    # --- BERT ---
    # A fine-tuned head's route (classify, ner, qa) follows fill_mask's pattern: a request model in
    # schemas.py, a batched function items -> results over the model, and a route that validates,
    # admits and awaits worker.submit(fn, items).

    async def run_batch(fn, inputs):
        """Admit, build the items (inputs() in a worker thread: tokenizing), run fn on them in a batch."""
        admit()
        try:
            items = await run_in_threadpool(inputs)
            return items, await asyncio.wrap_future(worker.submit(fn, items))
        finally:
            admission.leave()

    def embed_fn(ids):          # one function per app: requests for it run as one batch
        return embed(model, ids, pooling)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        need(family == "bert", "/v1/embeddings", "a BERT model")
        check_model(body.model)
        if body.dimensions is not None and body.dimensions != cfg.n_embd:
            raise APIError(400, f"dimensions: this model's embeddings have {cfg.n_embd} dimensions", "dimensions")
        limit = pooling.max_length or cfg.block_size
        ids, vecs = await run_batch(embed_fn, lambda: _bert_inputs(body.input, tokenizer, limit))
        if body.encoding_format == "base64":
            data = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vecs]
        else:
            data = [v.tolist() for v in vecs]
        n = sum(map(len, ids))
        return {"object": "list", "model": name, "usage": {"prompt_tokens": n, "total_tokens": n},
                "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)]}

    def fill_fn(items):
        return [fill_mask_text(model, tokenizer, text, top_k) for text, top_k in items]

    @app.post("/v1/fill-mask")
    async def fill(body: FillMaskRequest):
        need(family == "bert" and hasattr(model, "mlm"), "/v1/fill-mask", "a BERT model with its masked-LM head")
        check_model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input

        def inputs():        # checked here, so that one bad input never fails a batch
            for i, ids in enumerate(_bert_inputs(texts, tokenizer, cfg.block_size)):
                if tokenizer.mask_id not in ids:
                    raise APIError(400, f"input[{i}] has no [MASK] to fill", "input")
            return [(t, body.top_k) for t in texts]
        _, results = await run_batch(fill_fn, inputs)
        data = [{"index": i, "text": filled, "masks": [
                    [{"token": tokenizer.vocab[piece], "token_str": piece, "score": p} for piece, p in fillers]
                    for fillers in masks]}
                for i, (masks, filled) in enumerate(results)]
        return {"object": "list", "model": name, "data": data}

    # --- fine-tuned heads: the library's predict(), as `duolm predict` runs it ---

    def predict_fn(items):
        return predict(model, tokenizer, items)

    def heads(kinds, route: str, what: str):
        need(head is not None and head.kind in kinds, route, what)

    async def predictions(items: list) -> list:
        _, results = await run_batch(predict_fn, lambda: items)
        return results

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest):
        heads(("classify", "regress"), "/v1/classify", "a fine-tuned classifier or regressor")
        check_model(body.model)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        texts = [x if isinstance(x, str) else tuple(x) for x in inputs]
        data = [{"index": i, **r} for i, r in enumerate(await predictions(texts))]
        return {"object": "list", "model": name, "data": data}

    @app.post("/v1/ner")
    async def ner(body: NERRequest):
        heads(("tag",), "/v1/ner", "a fine-tuned token tagger")
        check_model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        data = [{"index": i, "entities": r} for i, r in enumerate(await predictions(texts))]
        return {"object": "list", "model": name, "data": data}

    @app.post("/v1/qa")
    async def qa(body: QARequest):
        heads(("span",), "/v1/qa", "a fine-tuned question answerer (span head)")
        check_model(body.model)
        data = [{"index": i, **r} for i, r in enumerate(await predictions(body.pairs()))]
        return {"object": "list", "model": name, "data": data}

    return app


def _bert_inputs(value, tokenizer, limit: int) -> list:
    """Texts -> [CLS] pieces [SEP]; token-id lists (word pieces) get [CLS] and [SEP] around them."""
    def encode(text):
        return tokenizer.encode(text).ids
    ids = to_id_lists(value, "input", encode, tokenizer.vocab_size)
    if len(ids) > MAX_INPUTS:
        raise APIError(400, f"input: {len(ids)} inputs, at most {MAX_INPUTS} per request", "input")
    raw = isinstance(value, list) and value and not isinstance(value[0], str)
    if raw:
        ids = [[tokenizer.cls_id, *x, tokenizer.sep_id] for x in ids]
    for i, x in enumerate(ids):
        if len(x) > limit:
            which = f" (input {i})" if len(ids) > 1 else ""
            raise APIError(400, f"input has {len(x)} tokens, limit {limit}{which}", "input")
    return ids


def _threadsafe_put(queue: asyncio.Queue):
    """put(event) for other threads: the event lands in `queue` on the running loop."""
    loop = asyncio.get_running_loop()

    def put(ev):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, ev)
        except RuntimeError:      # the loop is closed: the server is gone
            pass
    return put


async def _watch_disconnect(request: Request, queue: asyncio.Queue):
    """Puts ("gone",) in the queue when the client disconnects (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(("gone",))


async def _events(comp: Completion, queue: asyncio.Queue, usage: bool):
    """Server-sent events: one chunk per piece of text, the finish reasons, usage, [DONE]."""
    start = comp.start()
    if start:
        yield comp.chunk(start)
    while comp.pending:
        ev = await queue.get()
        if ev[0] == "done" and ev[3] == "error":
            yield f"data: {json.dumps(APIError(500, 'generation failed; the server log has the details').body())}\n\n"
            return
        choice = comp.apply(ev)
        if choice is not None:
            yield comp.chunk([choice])
    if usage:
        yield comp.chunk([], comp.usage())
    yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """An event stream that runs `cleanup` however it ends: done, client gone, or cancelled."""

    def __init__(self, content, cleanup):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


class _Gate:
    """ASGI middleware: draining 503, API key 401, body size 413, and the metrics of every request."""

    def __init__(self, app, state, metrics: Metrics, api_key: str | None, max_body_bytes: int):
        self.app, self.state, self.metrics = app, state, metrics
        self.key = None if api_key is None else api_key.encode()
        self.max_body = max_body_bytes

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
            error = self._refuse(scope)
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                error, receive = await self._read_body(scope, receive)
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send_)
            elif receive is None:
                status = 499                               # the client left while sending
            else:
                await self.app(scope, receive, send_)
        finally:
            self.metrics.observe(path if path in ROUTES else "other", status, time.perf_counter() - t0)

    def _refuse(self, scope) -> APIError | None:
        path = scope["path"]
        if self.state.draining and path not in ("/health", "/metrics"):
            return APIError(503, "the server is shutting down", None, "shutting_down",
                            {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if self.key is not None and path != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        return None

    async def _read_body(self, scope, receive):
        """-> (error, receive): the body read up to the limit, replayed to the app by the new receive
        (None when the client left)."""
        too_big = APIError(413, f"request body is larger than {self.max_body} bytes", None, "body_too_large",
                           {"Connection": "close"})
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return too_big, receive
        chunks, size = [], 0
        while True:
            msg = await receive()
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
