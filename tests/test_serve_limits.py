"""What a client can hold of a real `duolm serve` on 127.0.0.1 (issue 37), with the timeouts shortened by the flags:
clients that stall in their headers or their body are answered 408 and closed within the timeouts while normal
requests are answered as usual; connections beyond --max-connections are refused at once; SIGTERM with stalled
clients still drains the running generations and exits within the drain timeout. Every wait has a bound."""
import asyncio
import json
import signal
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx2")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import soak  # noqa: E402
from duolm.serve import ServeConfig  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402
from test_serve import gpt2, gpt2_dir, library_completion, one_thread  # noqa: E402,F401
from test_serve_e2e import server, wait_healthy  # noqa: E402

TIMEOUT = 2.0            # --header-timeout and --body-timeout of the servers here
MARGIN = 15.0            # what a loaded machine may add to a timeout before the close is seen
SLOW_HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
SLOW_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"prompt\": \"")


async def _stall(url, partial: bytes) -> tuple[bytes, float]:
    return await soak.stall(url, partial, TIMEOUT + MARGIN)


def _metrics(url) -> dict:
    return httpx.get(url + "/metrics?format=json", timeout=10).json()


def test_bad_limits_are_errors_naming_them(gpt2):
    model, tok = gpt2
    for field, value in [("header_timeout", 0), ("body_timeout", -1.0), ("keep_alive_timeout", 0),
                         ("max_connections", 0)]:
        with pytest.raises(ValueError, match=field):
            create_app(model, tok, ServeConfig(**{field: value}))


def test_stalled_clients_are_closed_while_normal_requests_are_answered(gpt2_dir, gpt2, tmp_path):
    """500 connections stall in their headers and 50 in their body; 20 normal completions sent meanwhile get the
    library's answers; every stalled one gets a 408 and is closed within the timeout (plus a margin), and the
    server's connections, file descriptors and /metrics say so."""
    model, tok = gpt2
    args = ["--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--max-connections", "1000"]
    with server(gpt2_dir, tmp_path / "log", *args) as (url, proc):
        fds = soak.open_fds(proc.pid)
        prompts = [f"request {i} of twenty" for i in range(20)]

        async def main():
            stalled = [asyncio.create_task(_stall(url, SLOW_HEADER if i < 500 else SLOW_BODY))
                       for i in range(550)]
            await asyncio.sleep(0.5)                   # they are connected and stalled before the normal ones
            async with httpx.AsyncClient(timeout=60) as c:
                normal = await asyncio.gather(*[c.post(url + "/v1/completions", json=dict(
                    prompt=p, max_tokens=12, seed=i)) for i, p in enumerate(prompts)])
            return normal, await asyncio.gather(*stalled)
        normal, stalled = asyncio.run(main())

        for i, r in enumerate(normal):
            c = r.json()["choices"][0]
            assert r.status_code == 200 and (c["text"], c["finish_reason"]) == library_completion(
                model, tok, prompts[i], 12, i)
        for i, (data, _) in enumerate(stalled):          # each closed within TIMEOUT + MARGIN (_stall's bound)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), data
            assert json.loads(body)["error"]["code"] == ("header_timeout" if i < 500 else "body_timeout")
        m = _metrics(url)
        assert (m["header_timeouts"], m["body_timeouts"], m["connections"]) == (500, 50, 1), m
        assert m["peak_connections"] >= 550 and m["connections_refused"] == 0
        assert m["requests"]["/v1/completions"] == {"200": 20, "408": 50}
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}
        assert families["duolm:header_timeouts"].samples[0].value == 500
        assert families["duolm:body_timeouts"].samples[0].value == 50
        assert soak.fds_back(proc.pid, fds) <= fds


def test_connections_beyond_the_bound_are_refused_at_once(gpt2_dir, tmp_path):
    """--max-connections 8: 8 held connections; a ninth is answered 503 and closed long before any timeout, and a
    client's request on one gets the 503 or a closed connection; once they go, requests are served again. And a
    connection idle after its response is closed after --keep-alive-timeout."""
    args = ["--max-connections", "8", "--header-timeout", "30", "--keep-alive-timeout", "1"]
    with server(gpt2_dir, tmp_path / "log", *args) as (url, proc):
        async def main():
            held = [await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1])) for _ in range(8)]
            t0 = time.monotonic()
            refused, _ = await _stall(url, b"")
            async with httpx.AsyncClient(timeout=10) as c:
                try:
                    status = (await c.get(url + "/health")).status_code
                except httpx.TransportError:
                    status = "closed"
            for _, writer in held:
                writer.close()
            return refused, time.monotonic() - t0, status
        refused, seconds, status = asyncio.run(main())
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), refused
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert seconds < 10 and status in (503, "closed")          # at once: the header timeout is 30 s
        wait_healthy(url, proc, tmp_path / "log", timeout=10)                # served again once they are gone
        m = _metrics(url)
        assert m["connections_refused"] >= 2 and m["header_timeouts"] == 0 and m["peak_connections"] == 8
        answer, seconds = asyncio.run(_stall(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')
        assert seconds < 30                      # closed by the keep-alive timeout (1 s), not the header timeout


def test_sigterm_with_stalled_clients_drains_generations_and_exits(gpt2_dir, tmp_path):
    """4 streams generating, 40 connections stalled in their headers and 10 in their body; SIGTERM: the 4 finish
    all their tokens, every stalled connection is closed, and the process exits 0 within the drain timeout."""
    drain = 30                     # the default: stalled clients that held the drain would take all of it
    args = ["--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--drain-timeout", str(drain)]
    with server(gpt2_dir, tmp_path / "log", *args) as (url, proc):
        signalled = []

        async def stream(c, i, started):
            body = dict(prompt=f"stream {i}", max_tokens=200, temperature=0, stream=True,
                        stream_options={"include_usage": True})
            events, done_before_signal = [], None
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            started.release()
                        if line == "data: [DONE]":
                            done_before_signal = not signalled
            return r.status_code, events, done_before_signal

        async def main():
            started = asyncio.Semaphore(0)
            async with httpx.AsyncClient(timeout=60) as c:
                streams = [asyncio.create_task(stream(c, i, started)) for i in range(4)]
                stalled = [asyncio.create_task(_stall(url, SLOW_HEADER if i < 40 else SLOW_BODY))
                           for i in range(50)]
                for _ in range(4):
                    await asyncio.wait_for(started.acquire(), 60)
                signalled.append(True)
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                exit_code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, drain + MARGIN)
                return time.monotonic() - t0, exit_code, await asyncio.gather(*streams), await asyncio.gather(*stalled)
        seconds, exit_code, streams, stalled = asyncio.run(main())
    assert exit_code == 0 and seconds < drain
    assert "Traceback" not in (tmp_path / "log").read_text()
    for status, events, done_before_signal in streams:       # every stream was generating and finished
        assert status == 200 and events[-1] == "[DONE]" and done_before_signal is False
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 200
    assert all(data == b"" or data.startswith(b"HTTP/1.1 408 ") for data, _ in stalled[:40])  # closed
    assert all(data.startswith(b"HTTP/1.1 408 ") for data, _ in stalled[40:])
