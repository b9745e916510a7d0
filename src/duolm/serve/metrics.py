"""What GET /metrics reports: request counts by route and status, latency percentiles, and the
admission counter that turns requests beyond capacity into fast 429s."""
from __future__ import annotations

import collections

import numpy as np


class Admission:
    """At most `limit` requests in the server at once (served or waiting); enter() says no beyond."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = self.peak = self.rejected = 0

    def enter(self) -> bool:
        if self.active >= self.limit:
            self.rejected += 1
            return False
        self.active += 1
        self.peak = max(self.peak, self.active)
        return True

    def leave(self) -> None:
        self.active -= 1

    def stats(self) -> dict:
        return {"in_flight": self.active, "peak_in_flight": self.peak, "capacity": self.limit,
                "rejected": self.rejected}


class Metrics:
    """Counts by route and status, and the latencies of the last `window` requests per route."""

    def __init__(self, window: int = 10000):
        self.counts = collections.defaultdict(collections.Counter)
        self.latency = collections.defaultdict(lambda: collections.deque(maxlen=window))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.counts[route][str(status)] += 1
        self.latency[route].append(seconds)

    def report(self) -> dict:
        """{"requests": {route: {status: count}}, "latency_s": {route: {"count", "p50", "p90", "p99"}}},
        the percentiles numpy's (linear interpolation) over the window."""
        lat = {route: {"count": len(xs), **dict(zip(("p50", "p90", "p99"), np.percentile(xs, (50, 90, 99)).tolist()))}
               for route, xs in self.latency.items() if xs}
        return {"requests": {r: dict(c) for r, c in self.counts.items()}, "latency_s": lat}
