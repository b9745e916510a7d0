"""Examples -> token ids -> padded batches for fine-tuning, for both families.

BERT: "[CLS] A [SEP] B [SEP]" with segment ids 0 / 1, through the WordPiece tokenizer's pair encoding;
too long pairs lose tokens from the longer text first (HF's "longest_first").
GPT: "A <|endoftext|> B" (the end-of-text token is the delimiter), optionally also "B <|endoftext|> A"
(GPT-1 fed similarity pairs in both orders); special tokens typed in the texts stay plain text.

`TaskBatches` serves training batches as a pure function of (seed, step), like the pretraining batch
sources, so a resumed run sees exactly the batches it would have seen: each epoch is a fresh
permutation, cut into chunks of 50 batches; each chunk is sorted by length and cut into batches of
similar lengths, and the batches of the epoch are served in random order. Padding goes to the longest
row of a batch only (dynamic padding), so compute is spent on tokens; it never changes a result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from duolm.data.causal import generator, rank_rows
from duolm.data.tasks import Example
from duolm.tokenizers import ByteLevelBPE, WordPiece

IGNORE = -100
GROUP = 50               # batches per length-sorted chunk (as transformers' LengthGroupedSampler)


@dataclass
class Features:
    """Encoded examples. ids[i]: the token ids of example i (GPT both orders: a pair of id lists);
    segment_ids: BERT only; labels: class ids or numbers (None: unlabelled); cut: the examples that were
    truncated to max_length."""
    family: str
    ids: list
    segment_ids: list | None
    labels: list | None
    pad_id: int
    cut: list = field(default_factory=list)

    @property
    def truncated(self) -> int:
        return len(self.cut)

    def __len__(self):
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.array([max(len(x) for x in r) if isinstance(r, tuple) else len(r) for r in self.ids], dtype=np.int64)


def truncate_pair(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
    """Lengths of A and B cut to n_a + n_b <= budget as HF's "longest_first" (and duolm's WordPiece) does:
    the longer text is cut down to what the shorter leaves, and when both are over half, each gets half
    (the longer one the odd token).

    Example: (10, 4, 8) -> (4, 4); (7, 6, 9) -> (5, 4); (3, 9, 8) -> (3, 5); (9, 0, 5) -> (5, 0)."""
    if budget < 1:
        raise ValueError(f"max_length leaves no room for the text (budget {budget})")
    if n_a + n_b <= budget:
        return n_a, n_b
    short, long = min(n_a, n_b), max(n_a, n_b)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    return (long, short) if n_a > n_b else (short, long)


def encode_examples(examples: Sequence[Example], tokenizer, max_length: int, labels: list | None = None,
                    kind: str = "classify", both_orders: bool = False) -> Features:
    """Token ids of each example (see the module doc), cut to `max_length`; labels -> ids (classify: the
    position of the label name in `labels`; regress: the number; unlabelled examples: no labels)."""
    if isinstance(tokenizer, WordPiece):
        ids, segs, cut = _encode_bert(examples, tokenizer, max_length)
        family, pad = "bert", tokenizer.pad_id
    elif isinstance(tokenizer, ByteLevelBPE):
        ids, cut = _encode_gpt(examples, tokenizer, max_length, both_orders)
        family, segs, pad = "gpt2", None, tokenizer.eot_id
    else:
        raise ValueError(f"cannot encode with a {type(tokenizer).__name__}; expected WordPiece or ByteLevelBPE")
    y = None
    if examples and all(e.label is not None for e in examples):
        if kind == "regress":
            y = [float(e.label) for e in examples]
        else:
            index = {name: i for i, name in enumerate(labels)}
            y = [index[e.label] for e in examples]
    return Features(family, ids, segs, y, pad, cut)


def _encode_bert(examples, tok: WordPiece, max_length: int):
    ids, segs, cut = [], [], []
    for i, e in enumerate(examples):
        enc = tok.encode(e.text_a, e.text_b)
        if len(enc.ids) > max_length:
            enc = tok.encode(e.text_a, e.text_b, max_length=max_length)
            cut.append(i)
        ids.append(enc.ids)
        segs.append(enc.segment_ids)
    return ids, segs, cut


def _encode_gpt(examples, tok: ByteLevelBPE, max_length: int, both_orders: bool):
    if tok.eot_id is None:
        raise ValueError("the GPT tokenizer has no <|endoftext|> token to delimit sentence pairs")
    eot, out, cut = tok.eot_id, [], []
    for i, e in enumerate(examples):
        a = tok.encode_ordinary(e.text_a)
        b = tok.encode_ordinary(e.text_b) if e.text_b is not None else None
        n_a, n_b = truncate_pair(len(a), len(b or ()), max_length - (b is not None))
        if (n_a, n_b) != (len(a), len(b or ())):
            cut.append(i)
        if b is None:
            out.append(a[:n_a] or [eot])              # an empty text is the end-of-text token alone
        elif both_orders:
            out.append((a[:n_a] + [eot] + b[:n_b], b[:n_b] + [eot] + a[:n_a]))
        else:
            out.append(a[:n_a] + [eot] + b[:n_b])
    return out, cut


# --- padded batches --------------------------------------------------------------------------------

def pad(seqs: Sequence[Sequence[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids right-padded with `value` to the longest -> (ids (B, T), mask (B, T): 1 = real, 0 = padding)."""
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, :len(x)] = torch.tensor(x)
        mask[b, :len(x)] = 1
    return ids, mask


def collate(features: Features, rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """Rows of `features` padded to their longest (right padding).

    BERT: idx, segment_ids, attention_mask (B, T). GPT: idx (B, T) or (B, 2, T) for both orders, last (B,)
    or (B, 2) the position of each last real token, y the next-token targets (IGNORE past the end) for the
    auxiliary LM loss. labels (B,): long class ids or float numbers, when the features have labels."""
    seqs = [features.ids[i] for i in rows]
    S = 2 if seqs and isinstance(seqs[0], tuple) else 1
    flat = [s for r in seqs for s in (r if S == 2 else (r,))]
    idx, real = pad(flat, features.pad_id)
    T = idx.shape[1]
    if features.family == "bert":
        batch = {"idx": idx, "segment_ids": pad([features.segment_ids[r] for r in rows], 0)[0], "attention_mask": real}
    else:
        n = real.sum(1)
        y = torch.where(real[:, 1:].bool(), idx[:, 1:], IGNORE)
        y = torch.cat([y, torch.full((len(flat), 1), IGNORE)], 1)
        shape = (len(seqs), 2) if S == 2 else (len(seqs),)
        batch = {"idx": idx.view(*shape, T), "last": (n - 1).view(shape), "y": y.view(*shape, T)}
    if features.labels is not None:
        lab = [features.labels[i] for i in rows]
        batch["labels"] = torch.tensor(lab, dtype=torch.float32 if isinstance(lab[0], float) else torch.long)
    return batch


class TaskBatches:
    """Length-grouped training batches, a pure function of (seed, step) (see the module doc), of any features
    with len() and lengths() and the collate function that pads their rows (token tasks bring their own).

    An epoch is len(features) // batch_size steps (the remainder, different each epoch, waits for the next)."""

    def __init__(self, features, seed: int = 0, collate_fn=collate):
        if len(features) == 0:
            raise ValueError("no training examples")
        self.features, self.seed, self.collate = features, seed, collate_fn
        self._lengths = features.lengths()
        self._epoch: tuple[int, int, list] | None = None

    def steps_per_epoch(self, batch_size: int) -> int:
        n = len(self.features) // batch_size
        if n == 0:
            raise ValueError(f"{len(self.features)} training examples do not fill one batch of {batch_size}")
        return n

    def epoch_batches(self, epoch: int, batch_size: int) -> list[np.ndarray]:
        """The rows of every batch of `epoch`, in serving order."""
        if self._epoch is None or self._epoch[:2] != (epoch, batch_size):
            n = self.steps_per_epoch(batch_size) * batch_size
            perm = torch.randperm(len(self.features), generator=generator(self.seed, 5, epoch)).numpy()[:n]
            batches = []
            for c in range(0, n, GROUP * batch_size):
                chunk = perm[c:c + GROUP * batch_size]
                chunk = chunk[np.argsort(-self._lengths[chunk], kind="stable")]
                batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
            order = torch.randperm(len(batches), generator=generator(self.seed, 6, epoch)).tolist()
            self._epoch = (epoch, batch_size, [batches[i] for i in order])
        return self._epoch[2]

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's rows of the global batch at `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per_epoch = self.steps_per_epoch(batch_size)
        rows = self.epoch_batches(step // per_epoch, batch_size)[step % per_epoch]
        return self.collate(self.features, rows[rank_rows(batch_size, rank, world_size)].tolist())


def eval_batches(features, batch_size: int, rank: int = 0, world_size: int = 1, collate_fn=collate
                 ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """Every example once, longest first (little padding), as (example numbers, batch); each rank gets its
    share of each batch (ranks may get unequal rows in the last one)."""
    order = np.argsort(-features.lengths(), kind="stable")
    for b in range(0, len(order), batch_size):
        mine = np.array_split(order[b:b + batch_size], world_size)[rank].tolist()
        if mine:
            yield mine, collate_fn(features, mine)
