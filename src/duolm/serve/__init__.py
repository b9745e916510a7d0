"""`duolm serve`: an OpenAI-compatible HTTP server for one model (the optional extra `serve`:
FastAPI + uvicorn).

    from duolm.serve import run
    run("path/to/model", host="127.0.0.1", port=8000, api_key=None)

    from duolm.serve.app import create_app, ServeOptions     # the ASGI app, for any ASGI server
"""
from __future__ import annotations

import ipaddress
import logging
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("duolm.serve")


def run(model_dir, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
        max_concurrency: int = 16, max_queue: int = 64, drain_timeout: float = 30.0,
        model_name: str | None = None, device: str = "cpu", log_level: str = "info") -> None:
    """Load `model_dir` (any directory duolm.load reads) and serve it until SIGTERM / Ctrl-C.

    On SIGTERM the server stops accepting connections, answers 503 to new requests on open ones,
    lets in-flight requests finish (up to `drain_timeout` seconds) and returns normally. Binding
    an address other than loopback without `api_key` logs a warning."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("duolm serve needs the 'serve' extra: pip install 'duolm[serve]'") from None
    from duolm.checkpoint import load
    from duolm.models import GPT2
    from duolm.serve.app import ServeOptions, create_app
    from duolm.serve.encoders import read_pooling

    model, tokenizer = load(model_dir, device=device)
    if tokenizer is None:
        raise ValueError(f"{model_dir}: no tokenizer files (vocab.json + merges.txt or vocab.txt); "
                         "the server needs the model's tokenizer")
    options = ServeOptions(model_name=model_name or Path(model_dir).resolve().name, api_key=api_key,
                           max_concurrency=max_concurrency, max_queue=max_queue)
    if not isinstance(model, GPT2):
        options.pooling = read_pooling(model_dir)
    warning = bind_warning(host, api_key)
    if warning:
        log.warning(warning)
    app = create_app(model, tokenizer, options)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.draining = True          # new requests on open connections get 503
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout)
    server = Server(config)
    # The decode thread and the event loop share the GIL, and torch releases it around every op:
    # with the default 5 ms switch interval a busy event loop makes each re-acquisition wait, and
    # a small model's step (hundreds of ops) slows tenfold under load. 0.5 ms keeps both moving.
    sys.setswitchinterval(5e-4)
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
