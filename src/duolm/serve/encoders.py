"""BERT requests: sentence embeddings with the checkpoint's pooling (duolm.convert.st.read_pooling), fill-mask,
and the worker that runs requests arriving together as one batch.

A task is a batched function `fn(items) -> results` (one result per item). `EncoderWorker.submit(fn,
items)` returns a Future; jobs for the same fn that arrive within the collection window run as one
call. New BERT routes (a fine-tuned classifier, tagger or span QA head) add a function of that
shape and a route; nothing here changes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

import torch

from duolm.convert.st import Pooling
from duolm.models.heads import pool_states

log = logging.getLogger("duolm.serve")


def embed(model, ids: list, pooling: Pooling, batch_size: int = 64) -> list:
    """Token-id lists (each with [CLS] ... [SEP]) -> one float32 vector (C,) each, pooled as
    `pooling` says. Inputs are sorted by length and run in right-padded batches of `batch_size`."""
    bert = model.backbone
    device = bert.wte.weight.device
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = [None] * len(ids)
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            chunk = [ids[i] for i in order[s:s + batch_size]]
            T = max(map(len, chunk))
            idx = torch.zeros(len(chunk), T, dtype=torch.long, device=device)
            mask = torch.zeros_like(idx)
            for j, x in enumerate(chunk):
                idx[j, :len(x)] = torch.tensor(x)
                mask[j, :len(x)] = 1
            hidden, _ = bert(idx, attention_mask=mask)
            vec = pool_states(hidden.float(), mask, pooling.mode, pooling.normalize)
            for j, i in enumerate(order[s:s + batch_size]):
                out[i] = vec[j].cpu()
    return out


class EncoderWorker:
    """One thread that runs batched jobs. After the first job arrives it waits `window_s` for more;
    the jobs collected are grouped by function and each group runs as one call. It is the server's `deps.Worker`
    for BERT."""

    warming = None                       # ready at once: nothing to compile

    def __init__(self, window_s: float = 0.005):
        self.window_s = window_s
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.running = 0                 # jobs in the batch being run
        self.batches = self.items = 0    # batches started, items in them
        self.busy_s = 0.0

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def stats(self) -> dict:
        """The worker's share of GET /metrics."""
        return {"running": self.running, "queue_depth": self.waiting, "batches": self.batches, "items": self.items,
                "items_per_s": self.items / self.busy_s if self.busy_s else 0.0}

    def submit(self, fn, items: list) -> Future:
        fut = Future()
        self._jobs.put((fn, list(items), fut))
        return fut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="duolm-encode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop once the jobs queued before this call have run."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    job = self._jobs.get(timeout=left)
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)      # stop after this batch
                    break
                jobs.append(job)
            t0 = time.perf_counter()
            self.running = len(jobs)
            self.batches += 1
            self.items += sum(len(items) for _, items, _ in jobs)
            self.run(jobs)
            self.running = 0
            self.busy_s += time.perf_counter() - t0

    @staticmethod
    def run(jobs) -> None:
        """Run (fn, items, future) jobs: one fn(all items) call per distinct fn."""
        groups = {}
        for fn, items, fut in jobs:
            groups.setdefault(fn, []).append((items, fut))
        for fn, group in groups.items():
            try:
                results = fn([x for items, _ in group for x in items])
            except Exception as e:   # the request fails, the worker lives on
                log.exception("encoder batch failed")
                for _, fut in group:
                    fut.set_exception(e)
                continue
            start = 0
            for items, fut in group:
                fut.set_result(results[start:start + len(items)])
                start += len(items)
