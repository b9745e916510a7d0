"""serve --compile: every decode step and prefill a Scheduler can meet, compiled before it serves.

Built on first use, a shape is compiled inside the decode loop (tens of seconds for GPT-2 124M on a CPU), and every
running row waits for it. So a compiling scheduler builds them all when it starts, in its decode thread, before its
first step: the static step of every batch bucket (1, 2, 4, ..., max_batch) at every length the batch cache takes
(64, 128, ..., block_size), and the one-prompt prefill at every bucketed prompt length (16, 32, ..., block_size).
Until it is done the scheduler's `warming` says how far it is, the server's /health answers 503 with it and the routes
that would put the model to work 503 with Retry-After; each shape built is a line on stderr.

The steps are bound on the scheduler's own buffers, as its loop binds them, so that the loop finds their compiled code
(dynamo's graphs of the same shapes and strides; on the CPU AOTInductor's packages): binding them again as the batch
cache is reallocated compiles nothing (on CUDA it captures a graph again, milliseconds).
"""
from __future__ import annotations

import logging
import time

import torch

from duolm.generation.static import MIN_CACHE, MIN_PROMPT, bucket

log = logging.getLogger("duolm.serve")


def batch_bucket(rows: int, max_batch: int) -> int:
    """The batch a compiled step runs for `rows` rows: the first of 1, 2, 4, ... that holds them, at most max_batch."""
    return min(max_batch, 1 << (rows - 1).bit_length())


def batches(max_batch: int) -> list[int]:
    """Every batch_bucket of a scheduler of max_batch rows.

    >>> batches(5)
    [1, 2, 4, 5]
    """
    return sorted({batch_bucket(b, max_batch) for b in range(1, max_batch + 1)})


def lengths(smallest: int, block_size: int) -> list[int]:
    """Every bucket(n, smallest, block_size), n = 1 ... block_size: smallest, 2 smallest, ..., block_size.

    >>> lengths(16, 100)
    [16, 32, 64, 100]
    """
    out = [bucket(1, smallest, block_size)]
    while out[-1] < block_size:
        out.append(bucket(out[-1] + 1, smallest, block_size))
    return out


def shapes(max_batch: int, block_size: int) -> list[tuple[str, int, int]]:
    """What a compiling scheduler builds: ("step", batch, cache length) and ("prefill", 1, prompt length), in order."""
    return ([("step", b, n) for n in lengths(MIN_CACHE, block_size) for b in batches(max_batch)]
            + [("prefill", 1, n) for n in lengths(MIN_PROMPT, block_size)])


def warm_up(sched) -> None:
    """Build every shape of `sched` (a compiling Scheduler that has no rows yet), its `warming` the progress, None at
    the end (also when a build fails: the loop then builds on demand, and the failure is logged). Stops early when
    the scheduler is stopped."""
    todo = shapes(sched.max_batch, sched.model.config.block_size)
    t0 = time.perf_counter()
    try:
        for i, (kind, batch, n) in enumerate(todo):
            if sched.stopping:
                return
            what = f"the decode step of batch {batch}, cache length {n}" if kind == "step" \
                else f"the prefill of prompt length {n}"
            sched.warming = f"compiled {i} of {len(todo)} shapes; compiling {what}"
            with torch.inference_mode():        # as the loop runs them: the buffers they keep are inference tensors
                if kind == "step":
                    sched.bind_step(batch, n)
                else:
                    sched.decoder.prefill([0] * n)
            log.warning("duolm serve: compiled %d/%d: %s (%.1f s)", i + 1, len(todo), what, time.perf_counter() - t0)
        sched.forget_steps()
        log.warning("duolm serve: ready (%d shapes compiled in %.1f s)", len(todo), time.perf_counter() - t0)
    except Exception:
        log.exception("duolm serve: compiling ahead failed; shapes are compiled on first use instead")
        sched.forget_steps()
    finally:
        sched.warming = None
