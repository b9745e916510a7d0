"""Continuous batching for GPT-2: one decode loop; sequences join and leave the running batch.

Every running sequence is one row of a batch KV cache. The rows joining at a step are prefilled together, packed
into one sequence past the prefixes the prefix cache holds (prefill.py), their keys and values copied into the batch,
which decodes them with the others from the next step on, and their first tokens drawn together. Each row keeps
its own length, sampling settings, stop rule and `torch.Generator`, and its token is drawn by `next_token` from its
own row of logits with its own generator: the draws are those of the row run alone, and the ids of a step's rows come
to the host together (one wait for the device a step). (A batched forward, of the prefill or of a step, differs from
a 1-row one only in float rounding, ~1e-6 in the logits; a batch of one row takes the very path `generate` takes.)
A finished or cancelled row leaves at once and the last row moves into its slot, so the batch stays dense.

Batch cache layout, B rows and L = cache.length columns: the rows are right-aligned. Row j's n_j
cached positions sit in columns [L - n_j, L); the columns before them are padding, masked out by the
attention mask (the model counts positions over real tokens only). Each step writes column L for
every row. A prompt longer than L joining shifts the block right; when the buffer is full, the
columns that are padding in every row are dropped (the block shifts left).

Scoring rows (max_tokens 0 or 1: lm-evaluation-harness's loglikelihood requests) never decode, so they need no
cache: the waiting ones run as one packed forward, each drawing its one token from its last position. Like any
batched forward it rounds ~1e-6 away from the row alone.

batch_invariant=True trades that sharing for bitwise reproducibility: each row is prefilled alone, keeps the 1-row
cache of its prefill and every step runs it alone, as `generate` runs one prompt, so a row's tokens and
log-probabilities are the same bits whatever runs beside it, and in whatever order rows arrive. A step
then costs one forward per row instead of one for the batch.

compile=True decodes the batch through duolm.generation.static's step (compiled once; a CUDA graph on GPUs) over
the batch cache's first 1, 2, 4, ... max_batch rows: the step for the smallest bucket that holds the batch, built on
first use and rebuilt when the cache grows (its length doubles, up to block_size). The rows beyond the batch are
computed and ignored. Each joining row is then prefilled through the decoder's compiled one-prompt prefill, at its
bucketed length (16, 32, ...; a graph replay on GPUs, where an eager forward launches its operations one by one).
The ids are the eager batch's up to the last bits of the logits. Started, a compiling scheduler first builds every
step and prefill it can meet (warmup.py; `warming` says how far it is), so that no shape is compiled while rows run.
"""
from __future__ import annotations

import collections
import copy
import logging
import threading
import time

import torch

from duolm.generation.base import device_dtype
from duolm.generation.static import cache_length, decoder_of
from duolm.models import KVCache
from duolm.serve.draws import logprob_info, next_tokens
from duolm.serve.prefill import aligned, prefill
from duolm.serve.prefix import PrefixCache
from duolm.serve.rows import Row, Sink, packed_groups
from duolm.serve.warmup import batch_bucket, warm_up

__all__ = ["Row", "Scheduler", "Sink", "packed_groups"]

log = logging.getLogger("duolm.serve")
PROMPT_ROWS = 256     # prompt positions whose log-probabilities are computed together (~50 MB for GPT-2's vocabulary)
PACK_TOKENS = 512     # prompt tokens of one packed prefill at most (one longer prompt goes alone): a packed forward's
                      # attention spans all its tokens, at 512 a tenth of GPT-2 124M's products


class Scheduler:
    """Runs rows through `model` (a GPT2 in eval mode), at most `max_batch` at once.

    submit(rows) queues rows from any thread; the decode loop (start()/stop(), a daemon thread)
    prefills waiting rows as slots free up and steps the batch. step() runs one round of that loop
    in the caller's thread (tests drive it by hand). It is the server's `deps.Worker` for GPT-2.
    batch_invariant: decode every row alone; compile: decode through static steps (see the module's doc);
    prefix_cache_mb: the prefix cache's size (0: none)."""

    def __init__(self, model, max_batch: int = 16, on_finish=None, batch_invariant: bool = False,
                 compile: bool = False, prefix_cache_mb: float = 0.0):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.model = model
        self.max_batch = max_batch
        self.batch_invariant = batch_invariant
        self.device, self.dtype = device_dtype(model)
        self.on_finish = on_finish       # on_finish(row, reason) when a row ends (the server's metrics)
        self.prompt_tokens = self.tokens_generated = 0
        self.finish_reasons = collections.Counter()   # rows ended, by reason
        self.busy_s = 0.0                # time spent in step() with work to do
        self.prefill_s = 0.0             # of which prefilling joining rows and scoring
        self._waiting = collections.deque()
        self._cond = threading.Condition()
        self._rows: list[Row] = []       # the batch, in slot order
        self._taken: list[Row] = []      # the rows this step took from the queue
        self._cache: KVCache | None = None   # max_batch rows x cap columns
        self._mask: torch.Tensor | None = None
        self._L = 0
        self._static = self.decoder = decoder_of(model) if compile and not batch_invariant else None
        self.warming = None if self._static is None else "not started"    # compile: the progress until started
        self._steps: dict = {}           # compile: batch bucket -> StaticStep over the current cache's first rows
        self._ids = torch.zeros(2, max_batch, 1, dtype=torch.long, device=self.device)  # compile: ids, positions
        self._at = torch.zeros(1, dtype=torch.long, device=self.device)
        self._thread: threading.Thread | None = None
        self.stopping = False
        # eager prefills (joining rows, scoring rows) past a prompt's cached prefix (prefix.py)
        self.prefix = PrefixCache(int(prefix_cache_mb * 2 ** 20)) if prefix_cache_mb > 0 and not batch_invariant \
            else None

    # --- the outside ---------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Rows in the batch that have not finished (a finished row leaves at the end of its step), and those taken
        from the queue by this step that have not yet joined it (being prefilled)."""
        return sum(not r.finished for r in self._rows) + sum(not (r.finished or r.n) for r in self._taken)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict:
        """The decode loop's share of GET /metrics."""
        return {"running": self.running, "queue_depth": self.waiting, "prompt_tokens": self.prompt_tokens,
                "tokens_generated": self.tokens_generated,
                "tokens_per_s": self.tokens_generated / self.busy_s if self.busy_s else 0.0,
                "busy_s": self.busy_s, "prefill_s": self.prefill_s,
                "compile_s": self._static.compile_s if self._static else 0.0,
                "finish_reasons": dict(self.finish_reasons), **(self.prefix.stats() if self.prefix else {})}

    def submit(self, rows) -> None:
        now = time.perf_counter()
        for row in rows:
            row.submitted = now
        with self._cond:
            self._waiting.extend(rows)
            self._cond.notify()

    def start(self) -> None:
        self.stopping = False
        self._thread = threading.Thread(target=self._loop, name="duolm-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after the current step; rows still running or waiting end "cancelled"."""
        with self._cond:
            self.stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for row in self._rows + list(self._waiting):
            self._finish(row, "cancelled")
        self._rows, self._waiting = [], collections.deque()

    def _loop(self) -> None:
        if self.warming is not None:
            warm_up(self)
        while not self.stopping:
            if not self.step():
                with self._cond:
                    if not self._waiting and not self.stopping:
                        self._cond.wait(0.1)

    def step(self) -> bool:
        """Admit waiting rows into free slots, then decode one token for every row in the batch.
        Returns False when there was nothing to do. An exception fails the rows it touched
        ("error") and leaves the scheduler usable."""
        t0 = time.perf_counter()
        busy = any(r.cancelled for r in self._rows)
        if busy:
            self._guard(list(self._rows), self._drop_cancelled)
        taken = self._taken = []
        while len(self._rows) + len(taken) < self.max_batch:
            with self._cond:
                row = self._waiting.popleft() if self._waiting else None
            if row is None:
                break
            busy = True
            taken.append(row)
        scoring = [r for r in taken if r.max_tokens <= 1 and not self.batch_invariant]   # one token at most: no cache
        joining = [r for r in taken if r not in scoring]
        together = self._static is None and not self.batch_invariant      # eager: one forward a group of prompts
        first: list = []          # (row, its first draw's logits (1, V)) of the rows that joined or scored
        pack = min(PACK_TOKENS, self.model.config.block_size)
        for fn, todo, budget in ((self._join, joining, pack if together else 0), (self._score, scoring, pack)):
            for group in packed_groups([len(r.prompt) for r in todo], budget):
                rows = [todo[i] for i in group]
                self._guard(rows, fn, rows, first)
        first = [(r, h) for r, h in first if not r.finished]       # (a group that failed after its prefill: ended)
        if first:
            self._guard([r for r, _ in first], self._draw, first)
        self._taken = []
        t1 = time.perf_counter()
        if self._rows:
            busy = True
            self._guard(self._rows, self._decode)
        if busy:
            self.busy_s += time.perf_counter() - t0
            self.prefill_s += t1 - t0
        return busy

    def _finish(self, row: Row, reason: str) -> None:
        if not row.finished:
            row.finished = True
            self.finish_reasons[reason] += 1
            if self.on_finish is not None:      # before the client hears of it: its metrics are complete
                self.on_finish(row, reason)
            row.sink.done(reason)

    def _guard(self, rows, fn, *args):
        """fn(*args); on an exception the `rows` end with "error" and leave the batch."""
        try:
            with torch.inference_mode():
                fn(*args)
        except Exception:   # a failed forward must not take the server down
            log.exception("decode step failed; failing %d row(s)", len(rows))
            failed = set(map(id, rows))
            for row in list(rows):
                self._finish(row, "error")
            self._rows = [r for r in self._rows if id(r) not in failed]
            if not self._rows:
                self._L = 0

    def _drop_cancelled(self) -> None:
        gone = [j for j, r in enumerate(self._rows) if r.cancelled]
        for j in gone:
            self._finish(self._rows[j], "cancelled")
        self._leave(gone)

    # --- one row: prefill, draw, finish ----------------------------------------------------------

    def _admit(self, row: Row) -> bool:
        """Whether a waiting row needs a forward: a cancelled one, or one asking for nothing, ends here."""
        if row.cancelled or (row.max_tokens == 0 and not row.prompt_logprobs):
            self._finish(row, "cancelled" if row.cancelled else "length")
            return False
        row.generator = torch.Generator(device=self.device).manual_seed(row.seed)
        return True

    def _join(self, rows: list[Row], first: list) -> None:
        """Prefill joining rows and put them in the batch, each one's first draw's logits appended to `first`. Eager,
        in one packed forward, its cache copied into the batch at once; compiled, one by one at bucketed
        lengths; batch_invariant, one alone in the cache it keeps. A group whose forward fails runs again row by row:
        a row the model refuses fails alone."""
        rows = [r for r in rows if self._admit(r)]
        if not rows:
            return
        if self._static is not None:          # compiled, at a bucketed length (on CUDA a graph replay)
            for row in rows:
                h, keys, values = self._static.prefill(row.prompt)
                if self._prompted([row], h[0], [torch.arange(len(row.prompt))], first)[0]:
                    self._insert([row], keys, values, None)
            return
        if not self.batch_invariant:          # eager, together, past the prefixes cached
            try:
                p = prefill(self.model, self.prefix, rows)
            except Exception:
                if len(rows) == 1:
                    raise
                log.exception("prefill of %d joining rows failed; each row again alone", len(rows))
                for row in rows:
                    self._guard([row], self._join, [row], first)
                return
            kept = [j for j, joins in enumerate(self._prompted(rows, p.h, p.at, first, p.found)) if joins]
            if kept:
                self._insert([rows[j] for j in kept], *aligned(p.cache, p.cols, kept))
            return
        row, cfg = rows[0], self.model.config         # batch_invariant: one row, alone in the cache it keeps
        cache = KVCache(cfg, 1, max_len=min(cfg.block_size, len(row.prompt) + max(row.max_tokens, 1) - 1),
                        device=self.device, dtype=self.dtype)
        h = self.model.hidden(torch.tensor([row.prompt], device=self.device), None, cache)
        if self._prompted([row], h[0], [torch.arange(len(row.prompt))], first)[0]:
            row.cache, row.n = cache, len(row.prompt)
            self._rows.append(row)

    def _prompted(self, rows: list[Row], h: torch.Tensor, at: list, first: list, found: list | None = None) -> list:
        """Prefilled rows (hidden states h (T, C), each row's positions past the u the prefix cache gave at[j] in it;
        found: per row (u, the infos of its first u + 1 tokens, its prompt's keys and values for the prefix cache or
        None), None: nothing cached): their prompts' log-probabilities handed over; per row, False when that was all
        it asked for (it ends), else True and the logits of its first draw appended to `first`."""
        found = found or [(0, [None], None)] * len(rows)
        kept = []
        for row, (_, _, kv), infos, logits in zip(rows, found, *self._outputs(rows, h, at, found)):
            self.prompt_tokens += len(row.prompt)
            if kv is not None:
                self.prefix.insert(row.prompt, kv, infos, row.logprobs or 0)
            if infos is not None:
                row.sink.prompt(infos)
            if row.max_tokens == 0:
                self._finish(row, "length")
            else:
                first.append((row, logits))
            kept.append(row.max_tokens > 0)
        return kept

    def _insert(self, rows: list[Row], keys: list, values: list, real: torch.Tensor | None) -> None:
        """Rows into the batch after the last one: their keys and values per layer (J, n_head, T, head_dim) end at
        column L (the block shifted right if T is longer); real (J, T) bool marks each row's own (None: all T)."""
        J, T = len(rows), keys[0].shape[2]
        if not self._rows:
            self._L = 0
        if T > self._L or self._cache is None:
            self._realign(max(T, self._L))
        j, L = len(self._rows), self._L
        for buf, new in zip(self._cache.k + self._cache.v, keys + values):
            buf[j:j + J, :, L - T:L] = new
        self._mask[j:j + J] = False
        self._mask[j:j + J, L - T:L] = True if real is None else real
        for row in rows:
            row.n = len(row.prompt)
        self._rows.extend(rows)

    def _score(self, rows: list[Row], first: list) -> None:
        """Rows that draw at most one token: one packed forward over their prompts past their cached prefixes;
        the logits of each one's token appended to `first`."""
        rows = [r for r in rows if self._admit(r)]
        if rows:
            p = prefill(self.model, self.prefix, rows)
            self._prompted(rows, p.h, p.at, first, p.found)

    def _outputs(self, rows: list[Row], h: torch.Tensor, at: list, found: list) -> tuple[list, list]:
        """What the output layer gives prefilled rows, in one pass over their states (rows that share a prefix share
        its states, computed once), PROMPT_ROWS at a time ((rows, V) floats, not (P, V)): each row's prompt tokens'
        logprob_info (None for the first; None for a row that asked for none), those of its first u + 1 tokens from
        the prefix cache (found), then each next one's from the state before it (h[at[j]]); and the logits (1, V) of
        its first draw, from its last state (None for a row that draws none)."""
        want = [j for j, r in enumerate(rows) if r.prompt_logprobs]
        draw = [j for j, r in enumerate(rows) if r.max_tokens > 0]
        targets = [t for j in want for t in rows[j].prompt[len(found[j][1]):]]
        n = len(targets)
        states = torch.cat([at[j][:-1] for j in want] + [at[j][-1:] for j in draw])   # positions in h: scored, last
        k, infos, last = max([rows[j].logprobs or 0 for j in want], default=0), [], []
        for i in range(0, len(states), PROMPT_ROWS):
            used, where = torch.unique(states[i:i + PROMPT_ROWS], return_inverse=True)
            logits = self.model.head(h[used])
            s = max(0, min(PROMPT_ROWS, n - i))             # the chunk's scored tokens; its last states follow
            infos += logprob_info(logits, targets[i:i + s], k, where[:s]) if s else []
            last.append(logits[where[s:]].float())
        last = torch.cat(last) if last else None
        out, drawn = [None] * len(rows), [None] * len(rows)
        for j in want:
            known, m, kj = found[j][1], len(rows[j].prompt) - len(found[j][1]), rows[j].logprobs or 0
            out[j], infos = list(known) + [(c, alts[:kj]) for c, alts in infos[:m]], infos[m:]
        for i, j in enumerate(draw):
            drawn[j] = last[i:i + 1]
        return out, drawn

    def _draw(self, first: list) -> None:
        """The first token of each row that joined or scored, [(row, the logits (1, V) of its draw)]: the tokens drawn
        as next_tokens draws a step's (one read to the host for all) and handed over; the rows that finish with it
        leave the batch."""
        rows, logits = [r for r, _ in first], torch.cat([x for _, x in first])
        slots = {id(r): j for j, r in enumerate(self._rows)}
        self._leave([slots[id(r)] for k, (r, t) in enumerate(zip(rows, next_tokens(rows, logits)))
                     if not self._take(r, t, logits, k) and id(r) in slots])

    def _take(self, row: Row, t: int, logits: torch.Tensor, j: int) -> bool:
        """Hand the row its drawn token t (drawn from row j of logits (B, V)); False when the row has finished."""
        info = None if row.logprobs is None else logprob_info(logits[j:j + 1], [t], row.logprobs)[0]
        row.tokens.append(t)
        row.times.append(time.perf_counter())
        self.tokens_generated += 1
        if row.sink.token(t, info) or row.constraint is not None and row.constraint.advance(t):
            self._finish(row, "stop")
            return False
        if len(row.tokens) >= row.max_tokens:
            self._finish(row, "length")
            return False
        return True

    # --- the batch ------------------------------------------------------------------------------

    def _decode(self) -> None:
        logits = self._step_alone() if self.batch_invariant else self._step_batch()
        for row in self._rows:
            row.n += 1
            if row.cancelled:
                self._finish(row, "cancelled")
        tokens = next_tokens(self._rows, logits)      # a cancelled row's token is drawn and dropped
        self._leave([j for j, row in enumerate(self._rows)
                     if row.finished or not self._take(row, tokens[j], logits, j)])

    def _step_alone(self) -> torch.Tensor:
        """Logits (B, V) of the next token of every row, each row run alone in its own cache."""
        return torch.cat([self.model.head(self.model.hidden(torch.tensor([[r.tokens[-1]]], device=self.device),
                                                            None, r.cache)[:, -1]).float() for r in self._rows])

    def _step_batch(self) -> torch.Tensor:
        """Logits (B, V) of the next token of every row, in one forward over the batch cache."""
        B = len(self._rows)
        if self._L + 1 > self._cache.max_len:
            self._realign(max(r.n for r in self._rows))
        L = self._L
        if self._static is not None:
            logits = self._step_static(B, L)
        else:
            self._mask[:B, L] = True
            view = self._rows_view(B)
            view.length = L
            idx = torch.tensor([[r.tokens[-1]] for r in self._rows], dtype=torch.long, device=self.device)
            mask = None if all(r.n == L for r in self._rows) else self._mask[:B, :L + 1]    # None: no padding column
            logits = self.model.head(self.model.hidden(idx, mask, view)[:, -1]).float()
        self._L = L + 1
        return logits

    def _rows_view(self, B: int) -> KVCache:
        """The batch cache's first B rows (writes land in the buffers)."""
        view = copy.copy(self._cache)
        view.k = [k[:B] for k in self._cache.k]
        view.v = [v[:B] for v in self._cache.v]
        return view

    def _step_static(self, B: int, L: int) -> torch.Tensor:
        """The eager step's logits (B, V) from the static step of the smallest bucket holding B rows: its ids and
        positions (each row's real tokens) written in, the new column L."""
        self._ids[:, :B].copy_(torch.tensor([[[r.tokens[-1]] for r in self._rows], [[r.n] for r in self._rows]]))
        self._at.fill_(L)
        Bb = batch_bucket(B, self.max_batch)
        if Bb not in self._steps:               # built over column L, which this step writes anyway
            self.bind_step(Bb)
        return self._steps[Bb].step()[:B]

    def bind_step(self, batch: int, length: int | None = None) -> None:
        """The static step over the batch cache's first `batch` rows, built (length: first (re)allocate the empty
        batch's cache at that many columns; warmup.py)."""
        if length is not None and (self._cache is None or self._cache.max_len != length):
            self._cache = None
            self._realign(length - 1)
        self._steps[batch] = self._static.bind(self._rows_view(batch), self._ids[0, :batch], self._ids[1, :batch],
                                               self._at, self._mask[:batch])

    def forget_steps(self) -> None:
        """Drop the batch cache and its steps (warmup.py's, before any row joined)."""
        self._cache, self._mask, self._steps, self._L = None, None, {}, 0

    def _leave(self, gone: list) -> None:
        """Remove the (finished) rows at slots `gone`; the rows after the new end move into the holes."""
        if not gone:
            return
        gone_set = set(gone)
        if self.batch_invariant:         # no shared cache: the rows' own go with them
            for j in gone:
                self._rows[j].cache = None
            self._rows = [r for j, r in enumerate(self._rows) if j not in gone_set]
            return
        B = len(self._rows)
        keep = B - len(gone)
        holes = [j for j in range(keep) if j in gone_set]
        movers = [j for j in range(keep, B) if j not in gone_set]
        if movers:
            w = max(self._rows[j].n for j in movers)
            cols = slice(self._L - w, self._L)
            for buf in self._cache.k + self._cache.v:
                buf[holes, :, cols] = buf[movers, :, cols]     # the right side is a copy: no overlap
            self._mask[holes] = self._mask[movers]
            for h, m in zip(holes, movers):
                self._rows[h] = self._rows[m]
        del self._rows[keep:]
        if not self._rows:
            self._L = 0

    def _realign(self, new_L: int) -> None:
        """Move the rows' block so that it ends at column new_L, in buffers with room for at least
        new_L + 1 columns (grown by doubling, up to block_size)."""
        cfg = self.model.config
        B = len(self._rows)
        w = max((r.n for r in self._rows), default=0)
        old = self._cache
        cap = 0 if old is None else old.max_len
        if new_L + 1 > cap:
            cap = cache_length(max(new_L + 1, 2 * cap), cfg.block_size)     # 64, 128, ...: warmup.py's lengths
            new = KVCache(cfg, self.max_batch, max_len=cap, device=self.device, dtype=self.dtype)
            for buf in new.k + new.v:   # padding columns are read (with weight 0): keep them finite
                buf.zero_()
            mask = torch.zeros(self.max_batch, cap, dtype=torch.bool, device=self.device)
            self._steps = {}            # steps are bound to the buffers they read
        else:
            new, mask = old, self._mask
        if B and w:
            src = slice(self._L - w, self._L)
            dst = slice(new_L - w, new_L)
            for a, b in zip(new.k + new.v, old.k + old.v):
                a[:B, :, dst] = b[:B, :, src].clone() if a is b else b[:B, :, src]
            mask[:B] = 0
            for j, r in enumerate(self._rows):
                mask[j, new_L - r.n:new_L] = 1
        self._cache, self._mask, self._L = new, mask, new_L
