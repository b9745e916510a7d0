"""What GET /metrics reports: request counts by route and status, latency percentiles, and the
admission counter that turns requests beyond capacity into fast 429s."""
from __future__ import annotations

import collections
import math


def percentile(values, q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between the closest ranks
    (numpy's default): the value at fractional rank (n - 1) * q / 100 of the sorted values.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    >>> percentile([10, 20, 30], 90)
    28.0
    """
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    r = (len(xs) - 1) * q / 100
    lo, hi = math.floor(r), math.ceil(r)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (r - lo))


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


class Metrics:
    """Counts by route and status, and the latencies of the last `window` requests per route."""

    def __init__(self, window: int = 10000):
        self.counts = collections.defaultdict(collections.Counter)
        self.latency = collections.defaultdict(lambda: collections.deque(maxlen=window))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.counts[route][str(status)] += 1
        self.latency[route].append(seconds)

    def report(self) -> dict:
        lat = {route: {"count": len(xs), **{f"p{q}": percentile(xs, q) for q in (50, 90, 99)}}
               for route, xs in self.latency.items() if xs}
        return {"requests": {r: dict(c) for r, c in self.counts.items()}, "latency_s": lat}
