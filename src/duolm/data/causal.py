"""Causal-LM batches: windows of block_size + 1 tokens cut from token shards, x = w[:-1], y = w[1:].

A batch is a pure function of (seed, step): the training loop resumes exactly by asking for the same
step again, and needs no sampler state beyond the step number. `batch_size` is always the GLOBAL batch
(sequences per optimizer step); rank r of world_size gets its own contiguous rows of it, so N ranks see
together exactly the sequences one process would see.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

ORDERS = ("random", "shuffle", "sequential")


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from integer keys (seed, stream, step...)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint32)
    return (int(state[0]) << 31 ^ int(state[1])) & ((1 << 63) - 1)


def generator(*keys: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(*keys))
    return g


def rank_rows(batch_size: int, rank: int, world_size: int) -> slice:
    """Rows of a global batch that belong to `rank`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(f"the global batch size {batch_size} must be a positive multiple of world_size {world_size}")
    b = batch_size // world_size
    return slice(rank * b, (rank + 1) * b)


class CausalBatches:
    """(x, y) batches from a list of 1-D token arrays (shards); windows never cross a shard boundary.

    order="random": window starts drawn uniformly at every step (nanoGPT);
    order="shuffle": the non-overlapping windows in a fresh permutation every epoch (each token once per epoch);
    order="sequential": the non-overlapping windows in order, wrapping around.
    """

    def __init__(self, shards: Sequence[np.ndarray] | np.ndarray, block_size: int, *, seed: int = 0,
                 order: str = "random"):
        if isinstance(shards, np.ndarray) or torch.is_tensor(shards):
            shards = [shards]
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.block_size, self.seed, self.order = block_size, seed, order
        total = sum(len(s) for s in shards)
        self.shards = [s for s in shards if len(s) >= block_size + 1]
        if not self.shards:
            raise ValueError(f"no shard holds block_size + 1 = {block_size + 1} tokens ({len(shards)} shards, "
                             f"{total} tokens in all): use a smaller --block-size or more data")
        lens = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._start_cum = np.cumsum(lens - block_size)       # window starts 0..len-T-1 per shard
        self._win_cum = np.cumsum((lens - 1) // block_size)  # non-overlapping windows per shard
        self.num_tokens = int(lens.sum())
        self.num_windows = int(self._win_cum[-1])
        self._perm: tuple[int, torch.Tensor] | None = None

    # global window index -> (shard, start)
    def _locate(self, cum: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = np.searchsorted(cum, i, side="right")
        before = np.where(k > 0, cum[np.maximum(k - 1, 0)], 0)
        return k, i - before

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.num_windows, generator=generator(self.seed, 1, epoch)))
        return self._perm[1]

    def windows(self, step: int, batch_size: int) -> list[tuple[int, int]]:
        """(shard, start) of each sequence of the global batch at `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.order == "random":
            n = int(self._start_cum[-1])
            i = torch.randint(n, (batch_size,), generator=generator(self.seed, 0, step)).numpy()
            k, start = self._locate(self._start_cum, i)
        else:
            pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
            w = pos % self.num_windows
            if self.order == "shuffle":
                # a batch may straddle two epochs: each position uses its own epoch's permutation
                epochs = pos // self.num_windows
                w = np.array([int(self._epoch_perm(int(e))[int(j)]) for e, j in zip(epochs, w)], dtype=np.int64)
            k, j = self._locate(self._win_cum, w)
            start = j * self.block_size
        return list(zip(k.tolist(), start.tolist()))

    def _stack(self, wins) -> dict[str, torch.Tensor]:
        T = self.block_size
        if not wins:
            return {"x": torch.zeros(0, T, dtype=torch.long), "y": torch.zeros(0, T, dtype=torch.long)}
        w = np.stack([np.asarray(self.shards[k][s:s + T + 1], dtype=np.int64) for k, s in wins])
        w = torch.from_numpy(w)
        return {"x": w[:, :-1].contiguous(), "y": w[:, 1:].contiguous()}

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's rows of the global batch at `step`: {"x": (b, T), "y": (b, T)} long, b = batch_size // world_size."""
        rows = rank_rows(batch_size, rank, world_size)
        return self._stack(self.windows(step, batch_size)[rows])

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1,
                     max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Every non-overlapping window once, in order, in global batches of `batch_size` windows; each rank
        yields its contiguous part of each global batch. The last global batch may be short, so ranks may get
        unequal rows (a rank with none yields nothing): sum losses and counts, then all-reduce once."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n_batches = -(-self.num_windows // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        for b in range(n_batches):
            w = np.arange(b * batch_size, min((b + 1) * batch_size, self.num_windows), dtype=np.int64)
            mine = np.array_split(w, world_size)[rank]
            if len(mine) == 0:
                continue
            k, j = self._locate(self._win_cum, mine)
            yield self._stack(list(zip(k.tolist(), (j * self.block_size).tolist())))
