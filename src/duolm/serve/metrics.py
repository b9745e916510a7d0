"""What GET /metrics reports: Prometheus' text format (prometheus-client), with vLLM's names where the
quantity is vLLM's, and the same as JSON for people (GET /metrics?format=json); and the admission counter
that turns requests beyond capacity into fast 429s.

Three sources: the HTTP gate observes every request (route, status, seconds); the decode loop hands
each finished sequence to `Metrics.sequence` (time to first token, between tokens, end to end); the
counters and gauges are read from the workers' and the admission's stats() when scraped (STATS).
"""
from __future__ import annotations

import collections
import time

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds; vLLM's buckets start at 1 ms (time to first token) or 10 ms (between tokens): a small model on a
# CPU steps faster
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
           40.0, 80.0, 160.0, 640.0)
# stats() key -> (metric name, kind, help); the vllm: ones carry the label model_name, as vLLM's do
STATS = {
    "running": ("vllm:num_requests_running", "gauge",
                "Sequences in the running batch (GPT-2), requests in the batch being run (BERT)"),
    "queue_depth": ("vllm:num_requests_waiting", "gauge", "Sequences (GPT-2) or requests (BERT) waiting"),
    "prompt_tokens": ("vllm:prompt_tokens", "counter", "Prompt tokens prefilled"),
    "tokens_generated": ("vllm:generation_tokens", "counter", "Tokens generated"),
    "finish_reasons": ("vllm:request_success", "counter",
                       "Sequences ended, by finished_reason (stop, length, cancelled, error)"),
    "compile_s": ("duolm:compile_seconds", "counter",
                  "Seconds spent compiling and capturing static decode steps and prefills (--compile)"),
    "prefix_cache_hits": ("duolm:prefix_cache_hits", "counter", "Prompts that reused a cached prefix (GPT-2)"),
    "prefix_cache_misses": ("duolm:prefix_cache_misses", "counter", "Prompts that found no cached prefix (GPT-2)"),
    "prefix_cache_hit_tokens": ("duolm:prefix_cache_hit_tokens", "counter",
                                "Prompt tokens whose keys and values came from the prefix cache"),
    "prefix_cache_shared_tokens": ("duolm:prefix_cache_shared_tokens", "counter",
                                   "Prompt tokens computed once for several prompts prefilled together"),
    "prefix_cache_bytes": ("duolm:prefix_cache_bytes", "gauge", "Bytes of keys and values the prefix cache holds"),
    "prefix_cache_evicted": ("duolm:prefix_cache_evicted", "counter", "Prefix cache nodes evicted (least recently "
                                                                      "used) to stay within --prefix-cache-mb"),
    "batches": ("duolm:encoder_batches", "counter", "Batches the BERT worker ran"),
    "items": ("duolm:encoder_items", "counter", "Inputs in those batches"),
    "in_flight": ("duolm:requests_in_flight", "gauge", "Requests admitted and not yet answered"),
    "capacity": ("duolm:requests_capacity", "gauge", "Requests admitted at most (max_concurrency + max_queue)"),
    "rejected": ("duolm:requests_rejected", "counter", "Requests refused with 429 (at capacity)"),
    "connections": ("duolm:connections_open", "gauge", "Client connections open"),
    "max_connections": ("duolm:connections_limit", "gauge", "Client connections open at most (max_connections)"),
    "connections_refused": ("duolm:connections_refused", "counter",
                            "Connections answered 503 and closed at once (max_connections open)"),
    "header_timeouts": ("duolm:header_timeouts", "counter",
                        "Connections closed (408) for not sending a request's headers within header_timeout"),
    "body_timeouts": ("duolm:body_timeouts", "counter",
                      "Requests answered 408 (and closed) for not sending their body within body_timeout"),
}


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


class Connections(Admission):
    """The server's client connections: at most `limit` open (enter() says no beyond, and counts it), and the
    requests cut for being slow (the HTTP protocol and the gate count them)."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self.header_timeouts = self.body_timeouts = 0

    def stats(self) -> dict:
        return {"connections": self.active, "peak_connections": self.peak, "max_connections": self.limit,
                "connections_refused": self.rejected, "header_timeouts": self.header_timeouts,
                "body_timeouts": self.body_timeouts}


class Metrics:
    """The server's metrics in one Prometheus registry (text()) and as JSON (report()): requests by route
    and status with their latencies (the last `window` per route kept for the JSON's percentiles), the
    sequences' latencies, and the stats of the sources given to watch()."""

    def __init__(self, model_name: str = "duolm", window: int = 10000):
        self.model_name = model_name
        self.started = time.time()
        self.counts = collections.defaultdict(collections.Counter)
        self.latency = collections.defaultdict(lambda: collections.deque(maxlen=window))
        self.sources = []
        self.registry = r = CollectorRegistry()
        # the names prometheus-fastapi-instrumentator gives (vLLM's HTTP metrics)
        self.http_requests = Counter("http_requests", "HTTP requests by route and status", ["handler", "status"],
                                     registry=r)
        self.http_seconds = Histogram("http_request_duration_seconds", "HTTP request latency (to the last byte)",
                                      ["handler"], buckets=BUCKETS, registry=r)

        def latency(name, text):
            return Histogram(name, text, ["model_name"], buckets=BUCKETS, registry=r).labels(model_name)
        self.ttft = latency("vllm:time_to_first_token_seconds", "From submission to the first token")
        self.itl = latency("vllm:inter_token_latency_seconds", "Between two tokens of a sequence")
        self.e2e = latency("vllm:e2e_request_latency_seconds", "From submission to the end of a sequence")
        r.register(_Collector(self._stats_families))

    def watch(self, *stats) -> None:
        """Report the dicts these functions return (keys of STATS; others go to the JSON only)."""
        self.sources.extend(stats)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.counts[route][str(status)] += 1
        self.latency[route].append(seconds)
        self.http_requests.labels(route, str(status)).inc()
        self.http_seconds.labels(route).observe(seconds)

    def sequence(self, row, reason: str) -> None:
        """A finished GPT-2 sequence (scheduler.Row): its times to the first token, between tokens, to the end."""
        if row.times:
            self.ttft.observe(row.times[0] - row.submitted)
        for a, b in zip(row.times, row.times[1:]):
            self.itl.observe(b - a)
        self.e2e.observe(time.perf_counter() - row.submitted)

    def stats(self) -> dict:
        out = {}
        for source in self.sources:
            out.update(source())
        return out

    def report(self) -> dict:
        """{"requests": {route: {status: count}}, "latency_s": {route: {"count", "p50", "p90", "p99"}}, the
        sources' stats, "uptime_s"}; the percentiles numpy's (linear interpolation) over the window."""
        lat = {route: {"count": len(xs), **dict(zip(("p50", "p90", "p99"), np.percentile(xs, (50, 90, 99)).tolist()))}
               for route, xs in self.latency.items() if xs}
        return {"requests": {r: dict(c) for r, c in self.counts.items()}, "latency_s": lat, **self.stats(),
                "uptime_s": time.time() - self.started}

    def text(self) -> bytes:
        """The Prometheus exposition (CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def _stats_families(self):
        for key, value in self.stats().items():
            if key not in STATS:
                continue
            name, kind, text = STATS[key]
            labels = ["model_name"] if name.startswith("vllm:") else []
            if isinstance(value, dict):          # finish_reasons: one sample per reason
                family = CounterMetricFamily(name, text, labels=["model_name", "finished_reason"])
                for reason, n in sorted(value.items()):
                    family.add_metric([self.model_name, reason], n)
            else:
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, text, labels=labels)
                family.add_metric([self.model_name] if labels else [], value)
            yield family


class _Collector:
    """A prometheus collector whose samples `collect()` makes at each scrape."""

    def __init__(self, collect):
        self.collect = collect
