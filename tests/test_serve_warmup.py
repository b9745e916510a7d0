"""duolm serve --compile builds every shape before it serves (serve/warmup.py): /health answers 503 with the progress
and the model's routes 503 with Retry-After until the shapes are built, 200 after; then a row joining with new shapes
(a longer prompt's bucketed prefill, the batch of 2) compiles nothing and leaves no gap in a running row's tokens."""
import logging
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters   # test-only: dynamo's own count of the graphs it compiled

import duolm
from duolm.generation import static
from duolm.serve import warmup
from duolm.serve.scheduler import Row, Scheduler, Sink
from test_serve import tiny_gpt2

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from duolm.serve import ServeConfig  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# The longest gap allowed between two tokens of a running row while another joins with new shapes. A step of these
# tiny models takes about a millisecond; compiling one shape takes seconds (an AOTInductor package or a compiled
# prefill: 5-30 s on this 2-core CPU, ~1 s at the least from inductor's warm on-disk cache). 2 s leaves a loaded
# machine's scheduling hiccups room and still catches a compilation on the path; the counts of graphs and packages
# built (no wall clock) catch one however fast.
GAP_BOUND_S = 2.0


def compiled() -> tuple:
    """Graphs dynamo compiled and AOTInductor packages built in this process."""
    return counters["stats"]["unique_graphs"], sum(len(v) for v in static._PACKAGES.values())


def shapes_of_tiny():
    """warmup.shapes of a 2-row scheduler over a 32-token window: one cache length, two batches, two prompt lengths."""
    return [("step", 1, 32), ("step", 2, 32), ("prefill", 1, 16), ("prefill", 1, 32)]


def test_shapes_worked_example():
    assert warmup.shapes(2, 32) == shapes_of_tiny()
    assert warmup.shapes(5, 160) == [("step", b, n) for n in (64, 128, 160) for b in (1, 2, 4, 5)] + \
        [("prefill", 1, n) for n in (16, 32, 64, 128, 160)]
    assert [warmup.batch_bucket(b, 5) for b in range(1, 6)] == [1, 2, 4, 4, 5]


class _Lines(logging.Handler):
    """The messages of duolm.serve's own records (not its children's), WARNING and above."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        if record.name == "duolm.serve":
            self.lines.append(record.getMessage())


BODY = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def warmed(data_dir):
    """(client, scheduler, seen): a --compile app of a 2-row tiny GPT-2 over a 32-token window (a structure no other
    test of this process compiles), one warm-up for both tests below (each shape takes seconds to build). The warm-up
    waits until /health and a completion were asked first; `seen` holds those answers, the statuses /health gave
    while it ran, and duolm.serve's log lines until it was done."""
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    gate, real, made, log = threading.Event(), warmup.warm_up, [], _Lines()

    def held(sched):           # the warm-up waits for the fixture to look first
        assert gate.wait(60)
        real(sched)

    class Kept(Scheduler):      # the app's scheduler, which test_a_new_shape_stalls_no_running_row gives rows
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    logging.getLogger("duolm.serve").addHandler(log)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("duolm.serve.scheduler.warm_up", held)
        mp.setattr("duolm.serve.app.Scheduler", Kept)
        mp.setattr(static.StaticDecoder, "keep_faster", False)   # conftest's compiled_steps_kept, for the module
        torch.set_num_threads(1)                                 # and its one_thread
        try:
            with TestClient(create_app(tiny_gpt2(block_size=32), tok,
                                       ServeConfig(max_concurrency=2, compile=True))) as c:
                seen = {"health": c.get("/health"), "completion": c.post("/v1/completions", json=BODY), "during": []}
                gate.set()
                deadline = time.monotonic() + 600
                while (r := c.get("/health")).status_code == 503 and time.monotonic() < deadline:
                    seen["during"].append(r.json()["status"])
                    time.sleep(0.05)
                seen["ready"], seen["lines"] = r, list(log.lines)
                yield c, made[0], seen
        finally:
            gate.set()
            torch.set_num_threads(threads)
            logging.getLogger("duolm.serve").removeHandler(log)


def test_health_is_503_until_the_shapes_are_built(warmed):
    c, _, seen = warmed
    r = seen["health"]
    assert r.status_code == 503 and r.json() == {"status": "warming up", "detail": "not started"}
    r = seen["completion"]
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["message"].startswith("the server is warming up: not started")
    assert set(seen["during"]) <= {"warming up"} and seen["ready"].json() == {"status": "ok"}
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    lines = seen["lines"]
    assert [line.split(" (")[0] for line in lines if line.startswith("duolm serve: compiled")] == [
        "duolm serve: compiled 1/4: the decode step of batch 1, cache length 32",
        "duolm serve: compiled 2/4: the decode step of batch 2, cache length 32",
        "duolm serve: compiled 3/4: the prefill of prompt length 16",
        "duolm serve: compiled 4/4: the prefill of prompt length 32"]
    assert lines[-1].startswith("duolm serve: ready (4 shapes compiled in ")


class _Done(Sink):
    def __init__(self):
        self.reason = None
        self.event = threading.Event()

    def done(self, reason):
        self.reason = reason
        self.event.set()


def test_a_new_shape_stalls_no_running_row(warmed):
    """Row A streams (prompt bucket 16, batch 1); after its third token row B joins with a 20-token prompt (bucket 32)
    and makes the batch 2: both new shapes, built at warm-up (`warmed`'s scheduler, of a structure no other test of
    this process compiled). Nothing is compiled after the scheduler is ready and no gap between A's tokens (when each
    was drawn) exceeds GAP_BOUND_S."""
    _, sched, _ = warmed
    a = Row(prompt=[5, 6, 7], max_tokens=26, temperature=0.0, sink=_Done())
    b = Row(prompt=list(range(1, 21)), max_tokens=4, temperature=0.0, sink=_Done())
    assert sched.warming is None
    before = compiled()
    sched.submit([a])
    while len(a.tokens) < 3 and not a.finished:
        time.sleep(0.001)
    sched.submit([b])
    assert a.sink.event.wait(120) and b.sink.event.wait(120)
    assert a.sink.reason == b.sink.reason == "length" and len(a.tokens) == 26
    assert a.times[2] < b.times[0] < a.times[-1]            # B drew its tokens while A ran
    assert compiled() == before
    gaps = [t - s for s, t in zip(a.times, a.times[1:])]
    assert max(gaps) < GAP_BOUND_S, gaps
