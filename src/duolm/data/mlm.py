"""BERT pretraining examples: NSP segment pairs and masked-LM masking.

The pure functions follow google-research/bert `create_pretraining_data.py` step by step and take an
explicit `random.Random`; token ids replace its token strings. Differences, each on purpose:
never-masked tokens are all special tokens ([CLS], [SEP], [PAD], [MASK]), not only [CLS]/[SEP]; the
10% random replacement draws a non-special id; whole-word groups never continue across a special token.

`BertBatches` turns documents into batches for the training loop: static masking (masks drawn once when
the data is made, `dupe_factor` copies with different masks, as BERT) or dynamic masking (a fresh mask
every time a sequence is served, as RoBERTa), NSP on (sentence pairs) or off (RoBERTa FULL-SENTENCES
packing). A batch is a pure function of (seed, step), like `CausalBatches`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from duolm.data.causal import derive_seed, generator, rank_rows
from duolm.objectives import IGNORE


@dataclass(frozen=True)
class MaskSpec:
    """What masking needs to know about the vocabulary."""
    vocab_size: int
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    special_ids: frozenset = frozenset()  # never masked, never a random replacement (cls/sep/mask/pad always are)
    subword_ids: frozenset = frozenset()  # "##" continuation pieces: whole-word masking joins them to the word

    def __post_init__(self):
        object.__setattr__(self, "special_ids",
                           frozenset(self.special_ids) | {self.cls_id, self.sep_id, self.mask_id, self.pad_id})
        if len(self.special_ids) >= self.vocab_size:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no ordinary token beside {len(self.special_ids)} special ones")

    @classmethod
    def from_tokenizer(cls, tok) -> "MaskSpec":
        """From a WordPiece tokenizer: specials = [CLS] [SEP] [MASK] [PAD] [UNK]; subwords = pieces starting "##"."""
        return cls(vocab_size=tok.vocab_size, cls_id=tok.cls_id, sep_id=tok.sep_id, mask_id=tok.mask_id,
                   pad_id=tok.pad_id, special_ids=frozenset({tok.unk_id}),
                   subword_ids=frozenset(i for t, i in tok.vocab.items() if t.startswith("##")))

    def random_token(self, rng: random.Random) -> int:
        while True:  # rejection keeps the draw uniform over the ordinary tokens
            t = rng.randrange(self.vocab_size)
            if t not in self.special_ids:
                return t


@dataclass
class Instance:
    """An unmasked training sequence: [CLS] A [SEP] B [SEP] (NSP) or [CLS] packed sentences [SEP]."""
    tokens: list[int]
    segment_ids: list[int]
    is_random_next: bool | None = None  # None: no NSP


# --- pairs (NSP on) ---------------------------------------------------------------------------

def truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int, rng: random.Random) -> None:
    """Truncate a pair in place to at most max_num_tokens in all: always shorten the longer one, by one token
    from the front or the back with equal chance (so neither end is favoured)."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if not trunc:
            raise ValueError(f"cannot truncate to {max_num_tokens} tokens")
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def create_instances_from_document(documents: Sequence[Sequence[Sequence[int]]], document_index: int,
                                   max_seq_length: int, short_seq_prob: float, rng: random.Random,
                                   cls_id: int, sep_id: int) -> list[Instance]:
    """Segment pairs from one document (google-research/bert create_instances_from_document).

    Sentences accumulate into a chunk until it reaches the target length (max_seq_length - 3, or with
    probability short_seq_prob a random length in [2, max]: shorter sequences so fine-tuning lengths are
    seen). A random prefix of the chunk's sentences is A; B is the rest (true next), or with probability 1/2
    -- and always when the chunk is a single sentence -- sentences from a random other document, and the
    chunk's unused sentences are put back to be used by the next pair."""
    if max_seq_length < 5:
        raise ValueError(f"max_seq_length must be >= 5 ([CLS] A [SEP] B [SEP]), got {max_seq_length}")
    document = documents[document_index]
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances = []
    current_chunk: list[Sequence[int]] = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1  # how many chunk sentences go to A
                if len(current_chunk) >= 2:
                    a_end = rng.randint(1, len(current_chunk) - 1)
                tokens_a = [t for s in current_chunk[:a_end] for t in s]
                tokens_b: list[int] = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    # ten tries at another document (a corpus of one document gives up and uses itself)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # the sentences after A were not used: put them back for the next pair
                    i -= len(current_chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = [t for s in current_chunk[a_end:] for t in s]
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                if tokens_a and tokens_b:  # (google asserts; empty sentences can only come from hand-made input)
                    tokens = [cls_id] + tokens_a + [sep_id] + tokens_b + [sep_id]
                    segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                    instances.append(Instance(tokens, segment_ids, is_random_next))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


# --- packing (NSP off) ------------------------------------------------------------------------

def pack_full_sentences(documents: Sequence[Sequence[Sequence[int]]], max_seq_length: int,
                        cls_id: int, sep_id: int) -> list[Instance]:
    """RoBERTa FULL-SENTENCES: whole consecutive sentences packed up to max_seq_length, crossing document
    boundaries with an extra [SEP] between documents; a sentence longer than a sequence is cut."""
    max_num = max_seq_length - 2  # [CLS] ... [SEP]
    if max_num < 1:
        raise ValueError(f"max_seq_length must be >= 3, got {max_seq_length}")
    out: list[Instance] = []

    def emit(ids):
        if ids:
            out.append(Instance([cls_id] + ids + [sep_id], [0] * (len(ids) + 2), None))

    cur: list[int] = []
    for doc in documents:
        first = True
        for sent in doc:
            if not len(sent):
                continue
            piece = ([sep_id] if first and cur else []) + list(sent)
            first = False
            if cur and len(cur) + len(piece) > max_num:
                emit(cur)
                cur, piece = [], list(sent)  # a sequence never starts with the document separator
            while len(piece) > max_num:
                emit(piece[:max_num])
                piece = piece[max_num:]
            cur += piece
    emit(cur)
    return out


# --- masking ----------------------------------------------------------------------------------

def mask_tokens(tokens: Sequence[int], spec: MaskSpec, rng: random.Random, masked_lm_prob: float = 0.15,
                max_predictions_per_seq: int = 20, whole_word: bool = False) -> tuple[list[int], list[int], list[int]]:
    """The masked-LM rule (google-research/bert create_masked_lm_predictions).

    round(masked_lm_prob * len(tokens)) positions are chosen (at least 1, at most max_predictions_per_seq),
    never a special token, in a random order of the candidate words; with whole_word a word (a token and
    the "##" pieces after it) is chosen or skipped as a whole. Each chosen position becomes [MASK] with
    probability 0.8, a random ordinary token with 0.1, and stays unchanged with 0.1 -- the model must
    predict every chosen position, and cannot trust that an unmasked token is right.
    Returns (output tokens, chosen positions in increasing order, their original ids)."""
    cand_indexes: list[list[int]] = []
    prev_special = True
    for i, t in enumerate(tokens):
        if t in spec.special_ids:
            prev_special = True
            continue
        if whole_word and not prev_special and t in spec.subword_ids:
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
        prev_special = False
    rng.shuffle(cand_indexes)

    output = list(tokens)
    num_to_predict = min(max_predictions_per_seq, max(1, int(round(len(tokens) * masked_lm_prob))))
    chosen: list[int] = []
    for index_set in cand_indexes:
        if len(chosen) >= num_to_predict:
            break
        if len(chosen) + len(index_set) > num_to_predict:
            continue  # this word would overshoot the budget: try a shorter one
        for index in index_set:
            if rng.random() < 0.8:
                output[index] = spec.mask_id
            elif rng.random() < 0.5:
                pass  # 10%: keep the original token
            else:
                output[index] = spec.random_token(rng)  # 10%: a random token
            chosen.append(index)
    chosen.sort()
    return output, chosen, [tokens[i] for i in chosen]


def masked_example(inst: Instance, spec: MaskSpec, rng: random.Random, masked_lm_prob: float = 0.15,
                   max_predictions_per_seq: int = 20, whole_word: bool = False) -> dict:
    """An Instance, masked: {"idx", "segment_ids", "mlm_labels" (IGNORE where not predicted), "nsp_label"}."""
    out, pos, labels = mask_tokens(inst.tokens, spec, rng, masked_lm_prob, max_predictions_per_seq, whole_word)
    mlm_labels = [IGNORE] * len(out)
    for p, t in zip(pos, labels):
        mlm_labels[p] = t
    nsp = None if inst.is_random_next is None else int(inst.is_random_next)
    return {"idx": out, "segment_ids": list(inst.segment_ids), "mlm_labels": mlm_labels, "nsp_label": nsp}


def collate(examples: Sequence[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Pad masked examples into batch tensors (to the longest, or to pad_to).

    idx, segment_ids, attention_mask (1 = real token), mlm_labels: (B, T) long; nsp_labels: (B,) long
    (0 = B follows A, 1 = B is random), present only when every example has an NSP label."""
    if not examples:
        raise ValueError("collate: no examples")
    T = max(len(e["idx"]) for e in examples)
    if pad_to is not None:
        if pad_to < T:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest example ({T} tokens)")
        T = pad_to
    B = len(examples)
    idx = torch.full((B, T), pad_id, dtype=torch.long)
    seg = torch.zeros((B, T), dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    lab = torch.full((B, T), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e["idx"])
        idx[b, :n] = torch.tensor(e["idx"])
        seg[b, :n] = torch.tensor(e["segment_ids"])
        att[b, :n] = 1
        lab[b, :n] = torch.tensor(e["mlm_labels"])
    batch = {"idx": idx, "segment_ids": seg, "attention_mask": att, "mlm_labels": lab}
    if all(e["nsp_label"] is not None for e in examples):
        batch["nsp_labels"] = torch.tensor([e["nsp_label"] for e in examples], dtype=torch.long)
    return batch


# --- batches for the training loop ------------------------------------------------------------

MASKINGS = ("static", "dynamic")


@dataclass
class BertBatches:
    """Masked-LM (+ NSP) batches from documents of sentences (`load_documents`); pure in (seed, step).

    Static masking: the instances are built and masked once here (dupe_factor passes over the corpus, each
    with its own pairs and masks), as BERT. Dynamic: the instances are built once (dupe_factor passes) and
    masked afresh whenever served, the mask a function of (seed, step, row), as RoBERTa. Examples are
    served in a fresh permutation each epoch; `batch_size` is the global batch, each rank its own rows."""
    documents: Sequence[Sequence[Sequence[int]]]
    spec: MaskSpec
    max_seq_length: int = 128
    seed: int = 0
    nsp: bool = True
    short_seq_prob: float = 0.1
    masking: str = "static"
    dupe_factor: int = 1
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    whole_word: bool = False
    pad_to: int | None = None
    instances: list = field(init=False, repr=False)
    _perm: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.masking not in MASKINGS:
            raise ValueError(f"masking must be one of {MASKINGS}, got {self.masking!r}")
        if self.dupe_factor < 1:
            raise ValueError(f"dupe_factor must be >= 1, got {self.dupe_factor}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        docs = [d for d in ([s for s in doc if len(s)] for doc in self.documents) if d]
        if not docs:
            raise ValueError("BertBatches: the documents hold no tokens")
        rng = random.Random(derive_seed(self.seed, 2))
        spec = self.spec
        instances: list = []
        for _ in range(self.dupe_factor):
            if self.nsp:
                for d in range(len(docs)):
                    instances.extend(create_instances_from_document(
                        docs, d, self.max_seq_length, self.short_seq_prob, rng, spec.cls_id, spec.sep_id))
            else:
                instances.extend(pack_full_sentences(docs, self.max_seq_length, spec.cls_id, spec.sep_id))
        if self.masking == "static":  # each copy its own mask, drawn now
            instances = [self._mask(inst, rng) for inst in instances]
        rng.shuffle(instances)
        self.instances = instances

    def _mask(self, inst: Instance, rng: random.Random) -> dict:
        return masked_example(inst, self.spec, rng, self.masked_lm_prob, self.max_predictions_per_seq, self.whole_word)

    @property
    def num_examples(self) -> int:
        return len(self.instances)

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(len(self.instances), generator=generator(self.seed, 1, epoch)))
        return self._perm[1]

    def indices(self, step: int, batch_size: int) -> list[int]:
        """Example numbers of the global batch at `step` (a new permutation each epoch)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = len(self.instances)
        pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
        return [int(self._epoch_perm(int(p // n))[int(p % n)]) for p in pos]

    def _example(self, i: int, *mask_keys: int) -> dict:
        ex = self.instances[i]
        if self.masking == "dynamic":
            ex = self._mask(ex, random.Random(derive_seed(self.seed, *mask_keys)))
        return ex

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's rows of the global batch at `step` (see module doc for the keys)."""
        rows = rank_rows(batch_size, rank, world_size)
        ids = self.indices(step, batch_size)
        exs = [self._example(ids[j], 3, step, j) for j in range(rows.start, rows.stop)]
        return collate(exs, self.spec.pad_id, self.pad_to)

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1,
                     max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Every example once, in order, in global batches; masks fixed (dynamic: a function of the example
        number), so every evaluation sees the same inputs. Ranks may get unequal rows in the last batch."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        n = len(self.instances)
        n_batches = -(-n // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        for b in range(n_batches):
            mine = np.array_split(np.arange(b * batch_size, min((b + 1) * batch_size, n)), world_size)[rank]
            if len(mine):
                yield collate([self._example(int(i), 4, int(i)) for i in mine], self.spec.pad_id, self.pad_to)
