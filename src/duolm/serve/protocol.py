"""The HTTP/1.1 protocol `duolm serve` runs: uvicorn's h11 protocol with two bounds on what a client can hold.

- At most `connections.limit` connections open: one more is answered 503 (Retry-After: 1) and closed at once,
  before anything is read from it, rather than held or queued.
- A request's headers within `header_timeout` seconds: from the connection's start, or on a kept-alive connection
  from the first byte of its next request (uvicorn's keep-alive timeout bounds the silence before it). A client
  that has not sent them by then is answered 408 and closed.

The body is bounded where the app reads it (app._Gate: 408 after body_timeout), where the answer goes through the
app and is counted by route like any other. uvicorn arms no timer before a connection's first response and none
while headers trickle in: without this, a client sending a request line and one header holds its socket forever.
"""
from __future__ import annotations

import json
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from duolm.serve.metrics import Connections
from duolm.serve.schemas import APIError


def _answer(error: APIError) -> bytes:
    """`error` as a whole HTTP/1.1 response that closes the connection (written before any request is parsed)."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
            "connection: close", f"content-length: {len(body)}",
            *(f"{name}: {value}" for name, value in (error.headers or {}).items())]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


REFUSED = _answer(APIError(503, "the server has too many connections open; retry later", None, "too_many_connections",
                           {"retry-after": "1"}))


class LimitedH11Protocol(H11Protocol):
    """H11Protocol with a bound on open connections and a timeout for a request's headers; uvicorn.Config(http=
    functools.partial(LimitedH11Protocol, connections=..., header_timeout=...)) makes one per connection."""

    def __init__(self, *args, connections: Connections, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits, self.header_timeout = connections, header_timeout
        self.header_timer = None
        self.counted = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.counted = self.limits.enter()
        if not self.counted:
            transport.write(REFUSED)
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.counted:
            self.limits.leave()
            self.counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.header_timer is None:
            self._arm()                                    # the first byte of a kept-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()                                 # the headers are in: the app runs, the gate bounds the body

    def _arm(self) -> None:
        self.header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _timed_out(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.limits.header_timeouts += 1
            self.transport.write(_answer(APIError(408, f"the request's headers did not arrive within "
                                                          f"{self.header_timeout:g} s", None, "header_timeout")))
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()
