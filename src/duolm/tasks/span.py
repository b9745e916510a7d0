"""Span question answering for BERT: SQuAD v1.1 and v2.0. Read top to bottom: the reader, the features (windows),
the objective, the answers, scores.

    L = (CE(start) + CE(end)) / 2 over the window's pieces                             BERT section 4.2

Features as the BERT reference (run_squad.py) builds them: [CLS] question [SEP] window [SEP], the question cut
to 64 pieces, a long context cut into windows of max_length - len(question) - 3 pieces whose starts are `stride`
(128) pieces apart; each context piece is scored in the window where it has the most context (min(left, right)
+ 0.01 * window length). Answers are found in and mapped back to the original characters through the
tokenizer's offsets. The answer of a question is the best span over its windows (n-best 20 starts x 20 ends, at
most 30 pieces), scored by the SQuAD v1.1 script's exact match and F1. SQuAD v2.0 as run_squad.py with
version_2_with_negative: a question without an answer is trained to point at [CLS], and answered "" when its
no-answer score beats the best span by more than a threshold chosen on dev (the v2.0 script's best_f1): a
result of validation ("null_threshold"), saved with the best model by the fine-tuning run.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm.metrics import squad_scores, squad_v2_scores
from duolm.models.heads import HeadConfig
from duolm.objectives import Objective
from duolm.tasks.base import (MAX_QUERY, SPAN_MAX_LENGTH, STRIDE, Data, Files, PredictInputs, TokenRows,
                              holdout, max_context_table, pad, run_model, windows)
from duolm.tokenizers import WordPiece

# --- the reader -------------------------------------------------------------------------------------------

@dataclass
class Question:
    """One SQuAD question: its context, gold answers (texts and character starts; empty when unanswerable or
    unlabelled), the article it comes from, and whether it has no answer in its context (SQuAD v2.0)."""
    id: str
    question: str
    context: str
    answers: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    title: str = ""
    impossible: bool = False


def read_squad(path) -> tuple[list[Question], list[str]]:
    """-> (questions, problems) of a SQuAD v1.1 / v2.0 json file (v2.0: "is_impossible" questions have no answers;
    their "plausible_answers" are not read). An answer whose answer_start does not point
    at its text in the context is left out and listed in `problems` (file, question id); a file of another
    shape, an empty question or an empty context is an error naming the file and the question."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a SQuAD file (expected {{\"data\": [{{\"title\", \"paragraphs\": [...]}}]}})")
    out, problems = [], []
    for a, article in enumerate(data):
        for p, para in enumerate(article.get("paragraphs", []) if isinstance(article, dict) else []):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            if not isinstance(para, dict) or not isinstance(para.get("context"), str) or "qas" not in para:
                raise ValueError(f"{where}: a paragraph needs a \"context\" string and \"qas\"")
            if not para["context"].strip():
                raise ValueError(f"{where}: the context is empty")
            for qa in para["qas"]:
                if not isinstance(qa, dict) or not str(qa.get("question", "")).strip() or "id" not in qa:
                    qid = qa.get("id", "?") if isinstance(qa, dict) else repr(qa)
                    raise ValueError(f"{where}: question {qid} is empty or has no id")
                q = Question(str(qa["id"]), qa["question"], para["context"], title=str(article.get("title", "")),
                             impossible=qa.get("is_impossible") is True)
                for ans in [] if q.impossible else qa.get("answers", []):
                    text, start = ans.get("text", ""), ans.get("answer_start", -1)
                    if not isinstance(start, int) or para["context"][start:start + len(text)] != text or not text:
                        problems.append(f"{path}: question {q.id}: answer {text!r} is not at answer_start {start}")
                        continue
                    q.answers.append(text)
                    q.starts.append(start)
                out.append(q)
    if not out:
        raise ValueError(f"{path}: no questions")
    return out, problems


def read(name: str, files: Files, splits, options, head: HeadConfig | None = None) -> Data:
    """SQuAD json files: --train and --dev, or one file (--data or --train) whose last articles (dev_fraction of
    them) are the dev set."""
    train_file = files.train or files.data
    need_train = "train" in splits or (files.dev is None and options.dev_fraction)
    if need_train and train_file is None:
        raise ValueError(f"task {name!r} needs a training file (--train)")
    train, problems = read_squad(train_file) if need_train else ([], [])
    dev, more = read_squad(files.dev) if files.dev else ([], [])
    notes = [f"{len(problems + more)} answer(s) left out: answer_start does not match the text "
             f"(first: {(problems + more)[0]})"] if problems + more else []
    if not files.dev and options.dev_fraction:
        titles = list(dict.fromkeys(q.title for q in train))
        _, held = holdout(titles, options.dev_fraction)
        dev = [q for q in train if q.title in held]
        train = [q for q in train if q.title not in held]
        notes.append(f"articles {', '.join(held)} of {train_file} ({len(dev)} questions) are the dev set; "
                     f"the other {len(titles) - len(held)} articles ({len(train)} questions) are trained on")
    if "dev" in splits and not dev:
        raise ValueError(f"task {name!r} has no dev set: give a dev file or a dev fraction")
    if any(q.impossible for q in train + dev):
        notes.append(f"SQuAD v2.0: {sum(q.impossible for q in train)} training questions without an answer "
                     f"(target [CLS]); the no-answer threshold is chosen on dev")
    return Data(name.lower(), "span", [], ("f1", "exact_match"), train, {"": dev}, notes=notes)


# --- features ---------------------------------------------------------------------------------------------

@dataclass
class SpanFeatures(TokenRows):
    """One row per window: ids, segment_ids; offsets[i][t]: the characters of the context piece at t (None
    outside the context); max_context[i][t]: whether window i scores that piece; question[i]: the question it
    belongs to; start/end: the answer's piece positions (0, the [CLS], when the answer is not in the window);
    cut: the questions whose question was cut to max_query pieces."""
    ids: list = field(default_factory=list)
    segment_ids: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    max_context: list = field(default_factory=list)
    question: list = field(default_factory=list)
    start: list = field(default_factory=list)
    end: list = field(default_factory=list)
    pad_id: int = 0
    cut: list = field(default_factory=list)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """idx, segment_ids, attention_mask (B, T) padded to the longest window; start, end (B,) the answer's pieces."""
        idx, mask = pad([self.ids[i] for i in rows], self.pad_id)
        return {"idx": idx, "segment_ids": pad([self.segment_ids[i] for i in rows], 0)[0], "attention_mask": mask,
                "start": torch.tensor([self.start[i] for i in rows]), "end": torch.tensor([self.end[i] for i in rows])}


def span_features(questions: list[Question], tok: WordPiece, max_length: int = SPAN_MAX_LENGTH,
                  max_query: int = MAX_QUERY, stride: int = STRIDE) -> SpanFeatures:
    """Windows of every question (see the module doc); training targets from each question's first answer."""
    out = SpanFeatures(pad_id=tok.pad_id)
    contexts: dict = {}
    for qi, q in enumerate(questions):
        query = tok.encode(q.question)[1:-1]
        if len(query) > max_query:
            query = query[:max_query]
            out.cut.append(qi)
        if q.context not in contexts:
            enc = tok.encode_with_offsets(q.context)
            contexts[q.context] = (enc.ids[1:-1], enc.offsets[1:-1])
        ctx, offs = contexts[q.context]
        spans = windows(len(ctx), max_length - len(query) - 3, stride)
        owner = max_context_table(spans, len(ctx))
        head = [tok.cls_id] + query + [tok.sep_id]
        a0, a1 = (q.starts[0], q.starts[0] + len(q.answers[0])) if q.starts else (None, None)
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


def encode(questions, tokenizer, head: HeadConfig, options=None) -> SpanFeatures:
    return span_features(questions, tokenizer, head.max_length, stride=(options and options.stride) or STRIDE)


# --- the objective ----------------------------------------------------------------------------------------

def span_loss(outputs, batch: dict, norm: dict | None = None):
    """BERT's SQuAD loss: the mean of the start and end cross-entropies over the window's pieces (padding
    excluded, so it never changes the loss); a window without the answer points at [CLS] (position 0)."""
    start, end = outputs
    n = max((norm or {"n": start.shape[0]})["n"], 1)
    pad_ = batch["attention_mask"] == 0
    ce = lambda lg, y: F.cross_entropy(lg.float().masked_fill(pad_, -math.inf), y, reduction="sum")   # noqa: E731
    loss = (ce(start, batch["start"]) + ce(end, batch["end"])) / (2 * n)
    return loss, {"loss": loss.detach()}


def objective(family: str, head: HeadConfig, lm_coef: float = 0.0) -> Objective:
    return Objective(forward=lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), loss=span_loss,
                     counts=lambda b: {"n": int(b["start"].shape[0])}, tokens=lambda b: b["idx"].numel())


# --- answers and scores -----------------------------------------------------------------------------------

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
        score_, s, e = cands[0]
        if q not in best or score_ > best[q][0]:
            best[q] = (score_, features.offsets[r][s][0], features.offsets[r][e][1])
    out = {}
    for qi, q in enumerate(questions):
        score_, a, b = best.get(qi, (-math.inf, 0, 0))
        odds = null[qi] - score_
        if null_threshold is not None and odds > null_threshold:
            out[q.id] = {"text": "", "start": None, "end": None, "score": null[qi], "null_odds": odds}
        else:
            out[q.id] = {"text": q.context[a:b], "start": a, "end": b, "score": score_, "null_odds": odds}
    return out


def answer_questions(model, tok, questions: list[Question], features=None, batch_size: int = 64,
                     stride: int = STRIDE, null_threshold: float | None = None) -> dict[str, dict]:
    """{question id: {"text", "start", "end", "score", "null_odds"}}: the best span of each question's context
    (see the module doc), or "" where the no-answer score beats it by more than null_threshold (SQuAD v2.0,
    see answers); a context of any length is read through windows."""
    features = features or span_features(questions, tok, model.head.max_length, stride=stride)
    outs = run_model(lambda m, b: torch.stack(m(b["idx"], b["segment_ids"], b["attention_mask"]), -1), model,
                     features, batch_size)
    spans = best_spans([o[:, 0].tolist() for o in outs], [o[:, 1].tolist() for o in outs], features,
                       range(len(features)))
    return answers(features, questions, spans, [float(o[0, 0] + o[0, 1]) for o in outs], null_threshold)


def score(model, tok, questions: list[Question], features=None, batch_size: int = 64) -> dict:
    """The official SQuAD exact match and F1 (x 100) of the model on questions with gold answers. SQuAD v2.0
    (questions without an answer among them): at the model's head.null_threshold, or, when it has none (a
    model in training), at the threshold that maximizes F1 on these questions (the official script's best_f1),
    returned as "null_threshold"."""
    pred = answer_questions(model, tok, questions, features, batch_size)
    gold = {q.id: q.answers for q in questions if q.answers or q.impossible}
    texts = {k: v["text"] for k, v in pred.items()}
    if not any(q.impossible for q in questions):
        return squad_scores(texts, gold)
    return squad_v2_scores(texts, gold, {k: v["null_odds"] for k, v in pred.items()}, model.head.null_threshold)


def predict(model, tok, inputs, batch_size: int = 64) -> list[dict]:
    """(question, context) pairs -> {"answer", "start", "end", "score"} ("" and None, None on SQuAD v2.0 when
    the no-answer score wins)."""
    questions = []
    for i, pair in enumerate(inputs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(str(x).strip() for x in pair):
            raise ValueError(f"input {i}: a question answerer takes (question, context) pairs, both non-empty")
        questions.append(Question(str(i), pair[0], pair[1]))
    got = answer_questions(model, tok, questions, batch_size=batch_size, null_threshold=model.head.null_threshold)
    return [{"answer": got[q.id]["text"], **{k: got[q.id][k] for k in ("start", "end", "score")}} for q in questions]


def make_head(data: Data, family: str, options, block_size: int) -> HeadConfig:
    if family != "bert":
        raise ValueError(f"task {data.name!r} points at word pieces: it needs a BERT model with a WordPiece vocabulary")
    return HeadConfig("span", [], "squad", min(options.max_length or SPAN_MAX_LENGTH, block_size))


def answerable(questions: list[Question]) -> list[Question]:
    """The questions trained on: those with an answer, and SQuAD v2.0's marked impossible."""
    return [q for q in questions if q.answers or q.impossible]


def parse(given: PredictInputs) -> list[tuple[str, str]]:
    """(question, context) pairs: each of given.questions in the text of the given.context file."""
    if not given.questions or not given.context:
        raise ValueError("a question answerer needs --question (repeatable) and --context FILE")
    context = Path(given.context).read_text(encoding="utf-8")
    return [(q, context) for q in given.questions]


def line(pair: tuple[str, str], prediction: dict) -> str:
    """The question, the answer, its character span (or "(no answer)") and score."""
    r = prediction
    span = f"[{r['start']}:{r['end']}]" if r["start"] is not None else "(no answer)"
    return f"{pair[0]}\t{r['answer']}\t{span}\t{r['score']:.3f}"


# This module is a duolm.tasks.base.Task: the functions above and what follows (tasks/__init__ checks it).
kinds: tuple[str, ...] = ("span",)
names: tuple[str, ...] = ("squad",)
unit = "training questions"
percent: tuple[str, ...] = ("exact_match", "f1")
route: str | None = "/v1/qa"
head = make_head
trained = answerable
