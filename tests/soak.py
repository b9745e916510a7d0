"""A bounded serving soak, shared by tests/test_serve_soak.py and `benchmarks/serve.py --soak N`.

`clients` asyncio clients on 127.0.0.1 take jobs from one list until it is empty: good requests (GPT-2:
plain or streamed completions; BERT: embeddings and a fine-tuned head's /v1/classify), requests the client
leaves at a random point (a stream after a few events, any other request after a few milliseconds),
malformed bodies, and, when asked, slow clients that send part of a request (its headers, or part of its body) and
then nothing until the server closes the connection (the 408 of its --header-timeout or --body-timeout). Every good
request is one of a small pool (`Goods`), so what comes back can be compared
with the same request sent alone. Every request has a timeout and the whole soak a time limit.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx2 as httpx          # what the test extra installs
except ImportError:
    import httpx
import numpy as np
import torch

import duolm
from duolm.models import GPT2, BertConfig, GPT2Config
from duolm.models.heads import HeadConfig, head_model

WORDS = "the a of to in and that it was for on are with as his they be at one have movie good bad".split()
MAX_BODY = 4096          # the servers' --max-body-bytes: a 413 costs a few kB


# --- the models: tiny, with GPT-2's and BERT's real vocabularies ---------------------------------------

def _sharpen(model, seed=0):
    """Weights N(0, 0.3) instead of N(0, 0.02): outputs far from uniform, so that a mix-up shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def tiny_models(data: Path, out: Path) -> tuple[Path, Path]:
    """(a tiny GPT-2, a tiny BERT with a 3-label classify head) saved as model directories under `out`."""
    bpe = duolm.ByteLevelBPE.from_files(data / "gpt2" / "encoder.json", data / "gpt2" / "vocab.bpe")
    gpt2 = GPT2(GPT2Config(vocab_size=bpe.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=32))
    wp = duolm.WordPiece.from_vocab(data / "bert-vocab" / "bert-base-uncased-vocab.txt")
    cfg = BertConfig(vocab_size=wp.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32, n_inner=64)
    head = head_model("bert", cfg, HeadConfig("classify", ["negative", "positive", "neutral"], max_length=32))
    return (duolm.save(_sharpen(gpt2), out / "tiny-gpt2", bpe),
            duolm.save(_sharpen(head), out / "tiny-bert-clf", wp))


# --- the requests ---------------------------------------------------------------------------------------

def _text(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@dataclass
class Goods:
    """The pool of good requests (route, body), and the malformed ones (route, raw body, the status it must get)."""
    good: list
    bad: list


def gpt2_goods(n=40, seed=0) -> Goods:
    rng = random.Random(seed)
    good = [("/v1/completions", {"prompt": _text(rng, 1, 12), "max_tokens": rng.randint(2, 12), "seed": i,
                                 "temperature": rng.choice([0.0, 0.8, 1.0]), "top_p": rng.choice([1.0, 0.9])})
            for i in range(n)]
    bad = [("/v1/completions", b'{"prompt": "unclosed', 400),                        # not JSON
           ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400),        # a field of the wrong type
           ("/v1/completions", b'{"prompt": "x", "top_p": 1.5}', 400),                # out of range
           ("/v1/completions", b'{"prompt": [[1, 99999999]]}', 400),                  # a token id past the vocabulary
           ("/v1/completions", json.dumps({"prompt": "x" * MAX_BODY}).encode(), 413)]  # too large
    return Goods(good, bad)


def bert_goods(n=40, seed=0) -> Goods:
    rng = random.Random(seed)
    good = []
    for i in range(n):
        texts = [_text(rng, 1, 10) for _ in range(rng.randint(1, 3))]
        good.append(("/v1/embeddings", {"input": texts}) if i % 2 else ("/v1/classify", {"input": texts}))
    bad = [("/v1/embeddings", b"[1, 2", 400),
           ("/v1/embeddings", b'{"input": 5}', 400),
           ("/v1/classify", b'{"input": []}', 400),
           ("/v1/embeddings", json.dumps({"input": "word " * 100}).encode(), 400),    # past the 64-token context
           ("/v1/classify", json.dumps({"input": "x" * MAX_BODY}).encode(), 413)]
    return Goods(good, bad)


@dataclass
class Job:
    route: str
    body: bytes            # the raw body sent
    key: int | None        # the good request it is (index in Goods.good); None: malformed
    stream: bool = False
    leave_after: float = 0  # > 0: the client leaves after this many stream events (or milliseconds)
    expect: int = 200      # the status a malformed body must get (or 429)
    slow: bool = False     # body is the part of a request a slow client sends (and then nothing)


def _partial(rng, route: str, body: bytes) -> bytes:
    """The part of a POST a slow client sends: its request line and one header, or its headers and half its body."""
    head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    if rng.random() < 0.5:
        return head
    return head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2]


def jobs(goods: Goods, n: int, seed: int, leave=0.2, bad=0.1, slow=0.0) -> list[Job]:
    """n jobs: ~`slow` slow clients, ~`bad` malformed, ~`leave` left at a random point, the rest good (streamed or
    not for GPT-2)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if slow and rng.random() < slow:
            route, body = rng.choice(goods.good)
            out.append(Job(route, _partial(rng, route, json.dumps(body).encode()), None, expect=408, slow=True))
            continue
        u = rng.random()
        if u < bad:
            route, body, expect = rng.choice(goods.bad)
            out.append(Job(route, body, None, expect=expect))
            continue
        key = rng.randrange(len(goods.good))
        route, body = goods.good[key]
        stream = route == "/v1/completions" and (u < bad + leave or rng.random() < 0.5)
        if stream:
            body = {**body, "stream": True, "max_tokens": body["max_tokens"] + (16 if u < bad + leave else 0)}
        # a stream is left after 1-6 events; any other request after 1-20 ms
        left = (rng.randint(1, 6) if stream else rng.uniform(1, 20)) if u < bad + leave else 0
        out.append(Job(route, json.dumps(body).encode(), key, stream, left))
    return out


# --- the clients ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    job: Job
    status: int | None        # None: the client left before the status line
    seconds: float
    answer: object = None     # a complete 200's answer (see answer())
    left: bool = False


def answer(route: str, body: dict):
    """What a request's 200 says, in a form to compare: (text, finish_reason) for a completion, the data
    list (embeddings as float arrays) otherwise."""
    if route == "/v1/completions":
        c = body["choices"][0]
        return c["text"], c["finish_reason"]
    if route == "/v1/embeddings":
        return [np.array(d["embedding"], dtype=np.float32) for d in sorted(body["data"], key=lambda d: d["index"])]
    return body["data"]


def same(a, b) -> bool:
    """A complete answer equals the one alone: a completion exactly, a head's labels exactly, embeddings and
    probabilities within 1e-6. Not bit-equal: BERT requests that arrive together run as one batch, padded to
    another length, and the CPU's GEMM kernels block other shapes differently (see test_serve_e2e's
    embeddings test); a GPT-2 row decodes as it would alone, so its text is equal."""
    if isinstance(a, tuple):
        return a == b
    if len(a) != len(b):
        return False
    if isinstance(a[0], np.ndarray):
        return all(np.abs(x - y).max() < 1e-6 for x, y in zip(a, b))
    return all(x["label"] == y["label"] and x["probabilities"].keys() == y["probabilities"].keys()
               and all(abs(x["probabilities"][k] - y["probabilities"][k]) < 1e-6 for k in x["probabilities"])
               for x, y in zip(a, b))


async def stall(url: str, partial: bytes, timeout: float = 60) -> tuple[bytes, float]:
    """A slow client: sends `partial` on a new connection and nothing more; (what the server sent until it closed
    the connection, the seconds until then). Waits `timeout` seconds at most."""
    host, port = url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(partial)
    t0 = time.perf_counter()
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return data, time.perf_counter() - t0


async def _send(c: httpx.AsyncClient, url: str, job: Job) -> Outcome:
    t0 = time.perf_counter()
    if job.slow:
        data, seconds = await stall(url, job.body)
        return Outcome(job, int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None, seconds)
    headers = {"Content-Type": "application/json"}
    if job.stream:
        text, reason, events = "", None, 0
        async with c.stream("POST", url + job.route, content=job.body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(job, r.status_code, time.perf_counter() - t0)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                if job.leave_after and events >= job.leave_after:
                    # leaving the block closes the connection mid-stream
                    return Outcome(job, 200, time.perf_counter() - t0, left=True)
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["text"]
                    reason = ch["finish_reason"] or reason
        return Outcome(job, 200, time.perf_counter() - t0, (text, reason))
    send = c.post(url + job.route, content=job.body, headers=headers)
    if job.leave_after:
        try:         # the client gives up after a few milliseconds: its connection is closed
            r = await asyncio.wait_for(send, job.leave_after / 1000)
        except asyncio.TimeoutError:
            return Outcome(job, None, time.perf_counter() - t0, left=True)
    else:
        r = await send
    ok = r.status_code == 200 and job.key is not None
    return Outcome(job, r.status_code, time.perf_counter() - t0, answer(job.route, r.json()) if ok else None)


async def _run(url: str, todo: list[Job], clients: int, time_limit: float) -> list[Outcome]:
    queue = list(reversed(todo))
    outcomes = []

    async def client():
        # one connection pool per client: a client that leaves closes its own connection only
        async with httpx.AsyncClient(timeout=60) as c:
            while queue:
                outcomes.append(await _send(c, url, queue.pop()))
                if outcomes[-1].status == 429:
                    await asyncio.sleep(0.01)       # not the Retry-After second: the soak keeps the pressure on
    await asyncio.wait_for(asyncio.gather(*[client() for _ in range(clients)]), time_limit)
    return outcomes


def soak(url: str, goods: Goods, n: int, clients: int = 32, seed: int = 0, time_limit: float = 600,
         slow: float = 0.0) -> list[Outcome]:
    """n jobs (see jobs(); `slow`: the share of slow clients) sent by `clients` concurrent clients; their outcomes."""
    return asyncio.run(_run(url, jobs(goods, n, seed, slow=slow), clients, time_limit))


def alone(url: str, goods: Goods) -> list:
    """The answer to each good request sent alone, one after another."""
    with httpx.Client(timeout=60) as c:
        out = []
        for route, body in goods.good:
            r = c.post(url + route, json=body)
            r.raise_for_status()
            out.append(answer(route, r.json()))
        return out


# --- the server's state ---------------------------------------------------------------------------------

def rss_kb(pid: int) -> int:
    """The process's resident set size (VmRSS), in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no VmRSS")


def open_fds(pid: int) -> int:
    """How many file descriptors the process has open."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def fds_back(pid: int, count: int, timeout: float = 10) -> int:
    """The process's open file descriptors once they are back to `count` or fewer (a socket the client closed
    goes when the server reads its end), or after `timeout` seconds, for the caller to fail on."""
    deadline = time.monotonic() + timeout
    while open_fds(pid) > count and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_fds(pid)


def settled(url: str, timeout: float = 30) -> dict:
    """GET /metrics once nothing is in flight, running or waiting, and no connection is open but the scrape's (a
    left client's rows leave at the next step, its connection when the server reads its end; the bound only prevents
    a hang, and then the last metrics are returned for the caller to fail on)."""
    deadline = time.monotonic() + timeout
    while True:
        m = httpx.get(url + "/metrics?format=json", timeout=10).json()
        if (m["in_flight"], m["running"], m["queue_depth"], m["connections"]) == (0, 0, 0, 1) or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@dataclass
class Figures:
    requests: int
    left: int
    statuses: dict = field(default_factory=dict)
    p50_s: float = 0.0
    p99_s: float = 0.0

    def line(self) -> str:
        counts = ", ".join(f"{k} x {v}" for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0])))
        return (f"{self.requests} requests, {self.left} left by their client; statuses {counts}; "
                f"200s p50 {self.p50_s * 1e3:.1f} ms, p99 {self.p99_s * 1e3:.1f} ms")


def figures(outcomes: list[Outcome]) -> Figures:
    """Counts by status ("left" for a client that left before the status), and the latency percentiles of
    the complete 200s."""
    statuses = {}
    for o in outcomes:
        k = "left" if o.status is None else o.status
        statuses[k] = statuses.get(k, 0) + 1
    lat = [o.seconds for o in outcomes if o.status == 200 and not o.left] or [0.0]
    p50, p99 = np.percentile(lat, (50, 99)).tolist()
    return Figures(len(outcomes), sum(o.left for o in outcomes), statuses, p50, p99)
