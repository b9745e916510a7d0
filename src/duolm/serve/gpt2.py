"""GPT-2's route: POST /v1/completions, its rows decoded by the continuous-batching scheduler
(scheduler.py), the response built by completions.py, streamed as server-sent events on request.
A client that leaves cancels its rows: they leave the batch at the next step."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import weakref

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from duolm.models import GPT2, BertForPreTraining
from duolm.serve.completions import Completion, encode_prompts, make_rows
from duolm.serve.deps import Served
from duolm.serve.schemas import APIError, CompletionRequest
from duolm.serve.structured import constraints, requested


# Prompts of up to this many characters are tokenized on the event loop (a fraction of a millisecond), longer ones in a
# worker thread so that the loop goes on answering; a hop to a thread and back waits for the GIL twice, which the
# decode thread holds most of the time while it runs.
INLINE_CHARS = 4096


def _characters(prompt) -> int:
    """The characters a request's prompt has to tokenize: a text, texts, or token ids (none)."""
    return len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))


def router(s: Served) -> APIRouter:
    """POST /v1/completions for a GPT2 served with a scheduler.Scheduler; a 400 for any other model but a BERT with
    its masked-LM head, which answers it in bert.py (scoring text)."""
    r = APIRouter()
    if isinstance(s.model, BertForPreTraining):
        return r

    @r.post("/v1/completions", **s.model_route(isinstance(s.model, GPT2), "a GPT-2 language model"))
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's completions: text for each prompt and choice, as generate_text gives it."""
        s.check_model(body.model)
        encode = functools.partial(encode_prompts, body, s.tokenizer, s.model.config)
        prompts = encode() if _characters(body.prompt) <= INLINE_CHARS else await run_in_threadpool(encode)
        shapes = None                       # structured output: compiled in a thread (a schema may take milliseconds)
        if requested(body) is not None:
            shapes = await run_in_threadpool(constraints, body, s.tokenizer, s.model.config.vocab_size,
                                             len(prompts) * body.n)
        queue: asyncio.Queue = asyncio.Queue()
        comp = Completion(body, prompts, s.tokenizer, s.name)
        rows = make_rows(body, prompts, s.tokenizer, _threadsafe_put(queue), shapes)

        def cancel():          # rows still waiting or running leave at the next step
            for row in rows:
                row.cancelled = True

        s.worker.submit(rows)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _Stream(_events(comp, queue, usage), cancel)
        watch = asyncio.ensure_future(_watch_disconnect(request, queue))
        try:
            while comp.pending:
                ev = await queue.get()
                if ev[0] == "gone":
                    return Response(status_code=499)      # the client left; nobody reads this
                if ev[0] == "done" and ev[3] == "error":
                    raise APIError(500, "generation failed; the server log has the details")
                comp.apply(ev)
            return JSONResponse(comp.body())     # (already JSON's types: FastAPI's encoder not needed)
        finally:
            watch.cancel()
            cancel()
    return r


class _Mailbox:
    """Events from the decode thread for queues of one event loop, handed over in bursts: one call_soon_threadsafe (a
    write to the loop's wake-up pipe, and a callback) for whatever arrived since the loop last emptied the box, not one
    an event (a decode step of 64 rows hands over 64). Each queue's events keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)       # (a strong one would keep the loop, _MAILBOXES' key, alive)
        self._lock, self._box = threading.Lock(), []

    def put(self, queue: asyncio.Queue, ev) -> None:
        with self._lock:
            self._box.append((queue, ev))
            if len(self._box) > 1:           # a delivery is on its way
                return
        loop = self._loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:                 # the loop is closed: the server is gone
            pass

    def _deliver(self) -> None:
        with self._lock:
            box, self._box = self._box, []
        for queue, ev in box:
            queue.put_nowait(ev)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # event loop -> its _Mailbox


def _threadsafe_put(queue: asyncio.Queue):
    """put(event) for other threads: the event lands in `queue` on the running loop (through the loop's _Mailbox)."""
    loop = asyncio.get_running_loop()
    if loop not in _MAILBOXES:
        _MAILBOXES[loop] = _Mailbox(loop)
    return functools.partial(_MAILBOXES[loop].put, queue)


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
