"""Token-level fine-tuning data: NER tagging (a label per word) and SQuAD span QA, for BERT's WordPiece.

Tagging: each word is split into word pieces and its label sits on the first piece; the other pieces,
[CLS] and [SEP] carry IGNORE (no loss, no prediction), as the BERT paper does for CoNLL-2003. With
context="document", a sentence is fed with its neighbours from the same document around it (as many
pieces as fit, half on each side), labelled on its own pieces only: BERT's "maximal document context".

QA, as the BERT reference (run_squad.py) builds its features: [CLS] question [SEP] window [SEP], the
question cut to 64 pieces, a long context cut into windows of max_length - len(question) - 3 pieces whose
starts are `stride` (128) pieces apart; each context piece is scored in the window where it has the most
context (min(left, right) + 0.01 * window length). Answers are found in and mapped back to the original
characters through the tokenizer's offsets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from duolm.data.features import pad
from duolm.data.tasks import Question, Sentence
from duolm.tokenizers import WordPiece

IGNORE = -100


# --- tagging --------------------------------------------------------------------------------------------

def word_pieces(tok: WordPiece, words: list[str]) -> list[list[int]]:
    """The piece ids of each word (as tokenizing the words one by one; a word may give no piece, e.g. a
    control character)."""
    text = " ".join(words)
    enc = tok.encode(text)
    bounds, pos = [], 0
    for w in words:
        bounds.append((pos, pos + len(w)))
        pos += len(w) + 1
    out, j = [[] for _ in words], 0
    for piece, (start, _) in zip(enc.ids[1:-1], enc.offsets[1:-1]):
        while bounds[j][1] <= start:
            j += 1
        out[j].append(piece)
    return out


@dataclass
class TagFeatures:
    """One row per sentence: ids ([CLS] context sentence context [SEP]), labels (IGNORE but on the first piece
    of each of the sentence's words), first[i]: the position of word i's first piece (-1: it got no piece or
    was cut); cut: the sentences that did not fit whole."""
    ids: list
    labels: list
    first: list
    pad_id: int
    cut: list = field(default_factory=list)

    def __len__(self):
        return len(self.ids)

    def lengths(self):
        import numpy as np
        return np.array([len(x) for x in self.ids], dtype=np.int64)


def tag_features(sentences: list[Sentence], tok: WordPiece, labels: list[str], max_length: int = 128,
                 context: str = "sentence") -> TagFeatures:
    """Features for tagging (see the module doc); untagged sentences get all-IGNORE labels."""
    if context not in ("sentence", "document"):
        raise ValueError(f"context must be 'sentence' or 'document', not {context!r}")
    index = {t: i for i, t in enumerate(labels)}
    pieces = [word_pieces(tok, s.words) for s in sentences]
    budget = max_length - 2
    out = TagFeatures([], [], [], tok.pad_id)
    for n, (s, words) in enumerate(zip(sentences, pieces)):
        ids, lab, first = [], [], []
        for w, p in enumerate(words):
            if p and len(ids) + len(p) <= budget:
                first.append(len(ids) + 1)
                lab += [index[s.tags[w]] if s.tags is not None else IGNORE] + [IGNORE] * (len(p) - 1)
                ids += p
            else:
                first.append(-1)
        if any(p and f < 0 for p, f in zip(words, first)):
            out.cut.append(n)
        left, right = [], []
        if context == "document":
            left, right = _neighbours(sentences, pieces, n, budget - len(ids))
        shift = len(left)
        out.ids.append([tok.cls_id] + left + ids + right + [tok.sep_id])
        out.labels.append([IGNORE] * (1 + shift) + lab + [IGNORE] * (len(right) + 1))
        out.first.append([f + shift if f >= 0 else -1 for f in first])
    return out


def _neighbours(sentences, pieces, n, room) -> tuple[list, list]:
    """Up to `room` pieces of the same document around sentence n: half before, half after (the unused
    half of one side goes to the other)."""
    doc = sentences[n].doc
    before = [p for k in range(n - 1, -1, -1) if sentences[k].doc == doc for p in _flat(pieces[k])[::-1]] \
        if n and sentences[n - 1].doc == doc else []
    after = []
    for k in range(n + 1, len(sentences)):
        if sentences[k].doc != doc or len(after) >= room:
            break
        after += _flat(pieces[k])
    n_left = min(len(before), max(room // 2, room - len(after)))
    n_right = min(len(after), room - n_left)
    return before[:n_left][::-1], after[:n_right]


def _flat(words):
    return [p for w in words for p in w]


def collate_tags(features: TagFeatures, rows) -> dict[str, torch.Tensor]:
    """idx, segment_ids, attention_mask, labels (B, T), padded to the longest row (labels with IGNORE)."""
    idx, mask = pad([features.ids[i] for i in rows], features.pad_id)
    labels = pad([features.labels[i] for i in rows], IGNORE)[0]
    return {"idx": idx, "segment_ids": torch.zeros_like(idx), "attention_mask": mask, "labels": labels}


# --- span QA --------------------------------------------------------------------------------------------

@dataclass
class SpanFeatures:
    """One row per window: ids, segment_ids; offsets[i][t]: the characters of the context piece at t (None
    outside the context); max_context[i][t]: whether window i scores that piece; question[i]: the question it
    belongs to; start/end: the answer's piece positions (0, the [CLS], when the answer is not in the window)."""
    ids: list = field(default_factory=list)
    segment_ids: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    max_context: list = field(default_factory=list)
    question: list = field(default_factory=list)
    start: list = field(default_factory=list)
    end: list = field(default_factory=list)
    pad_id: int = 0
    cut_questions: int = 0

    def __len__(self):
        return len(self.ids)

    def lengths(self):
        import numpy as np
        return np.array([len(x) for x in self.ids], dtype=np.int64)


def windows(n_pieces: int, room: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of the windows over n_pieces context pieces: `room` pieces each, starts `stride` apart,
    the last one ending at the end (run_squad.py's doc_spans).

    Example: windows(10, 4, 3) -> [(0, 4), (3, 4), (6, 4)]; windows(3, 4, 3) -> [(0, 3)]."""
    if room < 1:
        raise ValueError(f"no room for the context (the question leaves {room} pieces)")
    spans, start = [], 0
    while True:
        length = min(n_pieces - start, room)
        spans.append((start, length))
        if start + length >= n_pieces:
            return spans
        start += min(length, stride)


def max_context(spans: list[tuple[int, int]], span: int, position: int) -> bool:
    """Whether window `span` is where context piece `position` has the most context: the best score
    min(pieces left of it, pieces right of it) + 0.01 * window length, ties to the earlier window."""
    best, best_i = None, None
    for i, (start, length) in enumerate(spans):
        if not start <= position < start + length:
            continue
        score = min(position - start, start + length - 1 - position) + 0.01 * length
        if best is None or score > best:
            best, best_i = score, i
    return best_i == span


def max_context_table(spans: list[tuple[int, int]], n_pieces: int) -> list[int]:
    """The window that scores each of n_pieces context pieces, for all pieces at once: max_context's rule in
    one pass over the windows (O(pieces x overlapping windows), not O(pieces x windows))."""
    best, owner = [-math.inf] * n_pieces, [-1] * n_pieces
    for i, (start, length) in enumerate(spans):
        for p in range(start, start + length):
            score = min(p - start, start + length - 1 - p) + 0.01 * length
            if score > best[p]:
                best[p], owner[p] = score, i
    return owner


def span_features(questions: list[Question], tok: WordPiece, max_length: int = 384, max_query: int = 64,
                  stride: int = 128) -> SpanFeatures:
    """Windows of every question (see the module doc); training targets from each question's first answer."""
    out = SpanFeatures(pad_id=tok.pad_id)
    contexts: dict = {}
    for qi, q in enumerate(questions):
        query = tok.encode(q.question).ids[1:-1]
        if len(query) > max_query:
            query, out.cut_questions = query[:max_query], out.cut_questions + 1
        if q.context not in contexts:
            enc = tok.encode(q.context)
            contexts[q.context] = (enc.ids[1:-1], enc.offsets[1:-1])
        ctx, offs = contexts[q.context]
        spans = windows(len(ctx), max_length - len(query) - 3, stride)
        owner = max_context_table(spans, len(ctx))
        head = [tok.cls_id] + query + [tok.sep_id]
        a0 = q.starts[0] if q.starts else None
        a1 = a0 + len(q.answers[0]) if q.starts else None
        for si, (s, n) in enumerate(spans):
            out.ids.append(head + ctx[s:s + n] + [tok.sep_id])
            out.segment_ids.append([0] * len(head) + [1] * (n + 1))
            out.offsets.append([None] * len(head) + list(offs[s:s + n]) + [None])
            out.max_context.append([False] * len(head) + [owner[s + t] == si for t in range(n)] + [False])
            out.question.append(qi)
            start = end = 0
            if a0 is not None:
                inside = [t for t in range(n) if offs[s + t][1] > a0 and offs[s + t][0] < a1]
                if inside and offs[s + inside[0]][0] <= a0 and offs[s + inside[-1]][1] >= a1:
                    start, end = len(head) + inside[0], len(head) + inside[-1]
            out.start.append(start)
            out.end.append(end)
    return out


def collate_spans(features: SpanFeatures, rows) -> dict[str, torch.Tensor]:
    """idx, segment_ids, attention_mask (B, T) padded to the longest window; start, end (B,) the answer's pieces."""
    idx, mask = pad([features.ids[i] for i in rows], features.pad_id)
    return {"idx": idx, "segment_ids": pad([features.segment_ids[i] for i in rows], 0)[0], "attention_mask": mask,
            "start": torch.tensor([features.start[i] for i in rows]), "end": torch.tensor([features.end[i] for i in rows])}


def best_spans(start_logits, end_logits, features: SpanFeatures, rows, n_best: int = 20, max_answer: int = 30):
    """For each window in `rows` (with its start / end logits, lists of floats): the candidate spans
    (score, first piece, last piece) among the n_best starts x n_best ends that lie in the context, where the
    window has the start piece's max context, with start <= end and at most max_answer pieces; best first."""
    out = []
    for r, s_log, e_log in zip(rows, start_logits, end_logits):
        offs, ok = features.offsets[r], features.max_context[r]
        n = len(features.ids[r])
        s_top = sorted(range(n), key=lambda t: -s_log[t])[:n_best]
        e_top = sorted(range(n), key=lambda t: -e_log[t])[:n_best]
        cands = [(s_log[s] + e_log[e], s, e) for s in s_top for e in e_top
                 if offs[s] is not None and offs[e] is not None and ok[s] and s <= e < s + max_answer]
        out.append(sorted(cands, reverse=True))
    return out


def answers(features: SpanFeatures, questions: list[Question], spans_per_row, null_per_row,
            null_threshold: float | None = None) -> dict[str, dict]:
    """The best span of each question over its windows -> {id: {"text", "start", "end", "score", "null_odds"}}, the
    text cut from the original context by the pieces' character offsets ("" when no window has a valid span).

    null_odds (SQuAD v2.0, run_squad.py's score_diff): the no-answer score, the least [CLS] start + end logit
    (null_per_row) over the question's windows, minus the best span's score. With a null_threshold, a question
    whose null_odds exceed it gets the empty answer (start and end None, the no-answer score as its score).

    Example: windows with [CLS] scores 1.0 and 3.0 and a best span of 2.5 -> null_odds 1.0 - 2.5 = -1.5:
    answered with threshold 0, and with threshold -2 answered "". """
    best: dict = {}
    null = [math.inf] * len(questions)
    for r, cands in zip(range(len(features)), spans_per_row):
        q = features.question[r]
        null[q] = min(null[q], null_per_row[r])
        if not cands:
            continue
        score, s, e = cands[0]
        if q not in best or score > best[q][0]:
            best[q] = (score, features.offsets[r][s][0], features.offsets[r][e][1])
    out = {}
    for qi, q in enumerate(questions):
        score, a, b = best.get(qi, (-math.inf, 0, 0))
        odds = null[qi] - score
        if null_threshold is not None and odds > null_threshold:
            out[q.id] = {"text": "", "start": None, "end": None, "score": null[qi], "null_odds": odds}
        else:
            out[q.id] = {"text": q.context[a:b], "start": a, "end": b, "score": score, "null_odds": odds}
    return out
