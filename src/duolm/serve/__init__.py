"""`duolm serve`: an OpenAI-compatible HTTP server for one model (the optional extra `serve`:
FastAPI + uvicorn).

    from duolm.serve import run
    run("path/to/model", host="127.0.0.1", port=8000)          # until SIGTERM / Ctrl-C

    from duolm.serve.app import create_app                     # the ASGI app, for any ASGI server
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger("duolm.serve")


@dataclass
class ServeConfig:
    """How the server runs. The CLI's `duolm serve` options are these fields."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind; 127.0.0.1 = this machine only"})
    port: int = 8000
    api_key: str | None = field(default=None, metadata={"cli": False})   # --api-key / --api-key-file
    max_concurrency: int = field(default=16, metadata={
        "help": "sequences decoded together (one per prompt and choice) and requests served at once"})
    max_queue: int = field(default=64, metadata={"help": "requests that may wait beyond that; more get 429"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger request bodies get 413"})
    max_connections: int = field(default=512, metadata={
        "help": "client connections open at most (each holds a file descriptor: keep it well under `ulimit -n`); "
                "one more is answered 503 and closed at once"})
    header_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client has to send a request's headers (from connecting, or from the first byte of its "
                "next request on a kept-alive connection); then 408 and the connection is closed"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client has to send a request's whole body once its headers are in; then 408 and the "
                "connection is closed"})
    keep_alive_timeout: float = field(default=5.0, metadata={
        "help": "seconds an idle connection is kept open after a response"})
    drain_timeout: float = field(default=30.0, metadata={"help": "seconds in-flight requests get after SIGTERM"})
    model_name: str | None = field(default=None, metadata={"help": "the id clients send (default: the "
                                                                   "model directory's name)"})
    device: str = "cpu"
    batch_invariant: bool = field(default=False, metadata={
        "help": "decode each sequence alone: tokens and log-probabilities bitwise the same whatever runs beside "
                "it (one forward per sequence and step instead of one per step)"})
    compile: bool | None = field(default=None, metadata={
        "help": "decode GPT-2 through one static-shape step compiled with torch.compile, a CUDA graph on GPUs, per "
                "batch size bucket (1, 2, 4, ...); on CPUs compiled ahead of time (AOTInductor: one for batch 1, one "
                "for a range of batches); the first batches of each size pay the compilation (GET /metrics: "
                "compile_s). Default: on with --device cuda (several times faster there), off on the CPU (faster "
                "after about a minute of compilation for GPT-2 124M: docs/benchmarks.md)"})
    precision: str = field(default="auto", metadata={
        "help": "matmul arithmetic (duolm.precision): auto = fp32, exact on the engines timed fastest on this CPU "
                "(`duolm env`); bf16 / int8 (int8 CPU only) faster, with slightly different numbers",
                "choices": ("auto", "fp32", "bf16", "int8")})
    prefix_cache: bool = field(default=True, metadata={
        "help": "GPT-2: keep the keys and values of recent prompts; a prompt sharing a prefix with one computes only "
                "the rest (lm-evaluation-harness's choices of an item share their context)"})
    prefix_cache_mb: float = field(default=1024.0, metadata={
        "help": "memory the prefix cache holds at most, least recently used evicted (GPT-2 124M in fp32: ~72 KB a "
                "token)"})
    batch_window_s: float = field(default=0.005, metadata={"cli": False})   # BERT: wait to batch requests


def run(model_dir, config: ServeConfig | None = None, **fields) -> None:
    """Load `model_dir` (any directory duolm.load reads) and serve it until SIGTERM / Ctrl-C;
    `fields` override those of `config` (e.g. run(dir, host="0.0.0.0", api_key=key)).

    On SIGTERM the server stops accepting connections, answers 503 to new requests on open ones,
    lets in-flight requests finish (up to drain_timeout seconds) and returns normally. Binding an
    address other than loopback without an API key logs a warning. What a client can hold is bounded:
    max_connections open, header_timeout and body_timeout to send a request, keep_alive_timeout idle. While it
    serves, the thread switch interval is 0.5 ms (restored when it returns)."""
    cfg = replace(config or ServeConfig(), **fields)
    try:
        import uvicorn
    except ImportError:
        raise ImportError("duolm serve needs the 'serve' extra: pip install 'duolm[serve]'") from None
    from duolm.checkpoint import load
    from duolm.serve.app import create_app
    from duolm.serve.protocol import LimitedH11Protocol

    def prepare():
        model, tokenizer = load(model_dir, device=cfg.device)
        if tokenizer is None:
            raise ValueError(f"{model_dir}: no tokenizer files (vocab.json + merges.txt or vocab.txt); "
                             "the server needs the model's tokenizer")
        if cfg.model_name is None:
            cfg.model_name = Path(model_dir).resolve().name
        return create_app(model, tokenizer, cfg, pooling=pooling_of(model, model_dir))

    warning = bind_warning(cfg.host, cfg.api_key)
    if warning:
        log.warning(warning)
    # On the CPU torch runs its kernels on OpenMP thread teams, one for each thread that opens one. The model runs on
    # the worker's thread (the decode loop's); a second team left alive, the one that loading and packing the model
    # would open on this thread, makes more OpenMP threads than cores, and OpenMP then puts its threads to sleep after
    # every parallel region and wakes them for the next: a small model's step took 3x its time. So the model is
    # loaded and prepared on a thread that ends, and its team with it.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="duolm-load") as pool:
        app = pool.submit(prepare).result()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.draining = True          # new requests on open connections get 503
            super().handle_exit(sig, frame)

    # uvicorn's h11 protocol, bounding the connections and the time to a request's headers (protocol.py)
    http = functools.partial(LimitedH11Protocol, connections=app.state.connections, header_timeout=cfg.header_timeout)
    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, http=http,
                                   timeout_keep_alive=cfg.keep_alive_timeout,
                                   timeout_graceful_shutdown=cfg.drain_timeout))
    # The decode thread and the event loop share the GIL, and torch releases it around every op:
    # with the default 5 ms switch interval a busy event loop makes each re-acquisition wait, and
    # a small model's step (hundreds of ops) waits at every op. 0.5 ms keeps both moving
    # (`python benchmarks/serve.py` measures the server under 1 to 16 clients).
    with switch_interval(5e-4):
        if threading.current_thread() is not threading.main_thread():
            server.run()
            return
        # uvicorn re-raises the SIGTERM it caught once it has drained; by then every request has
        # finished, so that second delivery ends nothing: run() returns and the process exits 0.
        previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
        try:
            server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)


def pooling_of(model, model_dir):
    """How a BERT's embeddings are pooled: a fine-tuned embedding head's own pooling, else the sentence-transformers
    files of its directory (duolm.convert.st.read_pooling: [CLS], normalised, without them); None for GPT-2."""
    from duolm.convert.st import Pooling, read_pooling

    if model.config.family != "bert":
        return None
    head = getattr(model, "head", None)
    if head is not None and head.kind == "embed":
        return Pooling(head.pooling, head.normalize, head.max_length, "config.json")
    return read_pooling(model_dir)


@contextlib.contextmanager
def switch_interval(seconds: float):
    """The interpreter's thread switch interval (sys.setswitchinterval) is `seconds` inside the
    block; the interval it had before is restored after, however the block ends."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def bind_warning(host: str, api_key: str | None) -> str | None:
    """The warning for serving on an address other machines can reach without an API key, else None.

    >>> bind_warning("0.0.0.0", None)[:30]
    'binding 0.0.0.0 without an API'
    >>> bind_warning("127.0.0.1", None) is None and bind_warning("0.0.0.0", "key") is None
    True
    """
    if api_key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:       # a host name: it may resolve to anything
        pass
    return (f"binding {host} without an API key: anyone who can reach this address can use the model; "
            "pass --api-key-file (or bind 127.0.0.1)")


def read_api_key(path) -> str:
    """The key in a file (surrounding whitespace removed); an empty or unreadable file is an error."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the API key ({e})") from None
    if not key:
        raise ValueError(f"{path}: the API key file is empty")
    return key
