"""Token-level tasks for BERT: NER tagging (CoNLL-2003, or the user's files in its column format) and SQuAD span
question answering: their losses, their preparation for finetune(), predictions and the official metrics.

    tag:   L = CE over the first piece of every word (the other pieces are ignored)
    span:  L = (CE(start) + CE(end)) / 2 over the window's pieces (BERT section 4.2)

Entity F1 is conlleval's (duolm.evaluation.metrics.entity_scores); QA is scored by the SQuAD v1.1 script's
exact match and F1, the answer of a question being the best span over its windows (n-best 20 starts x 20
ends, at most 30 pieces, scored where the start piece has its max context). SQuAD v2.0 as run_squad.py with
version_2_with_negative: a question without an answer is trained to point at [CLS], and answered "" when its
no-answer score beats the best span by more than a threshold chosen on dev (the v2.0 script's best_f1).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm.data.features import eval_batches
from duolm.data.tasks import Question, Sentence, first, holdout, read_conll, read_squad, tag_scheme
from duolm.data.token_tasks import (answers, best_spans, collate_spans, collate_tags, span_features, tag_features)
from duolm.evaluation.metrics import entities, entity_scores, invalid_starts, squad_scores, squad_v2_scores
from duolm.models.heads import HeadConfig
from duolm.tokenizers import WordPiece
from duolm.train.objectives import IGNORE, Objective

TAG_TASKS = ("conll2003", "ner")
SPAN_TASKS = ("squad",)


def kind_of(task: str) -> str | None:
    """"tag" or "span" for a token task's name, None for a sentence task."""
    t = task.lower()
    return "tag" if t in TAG_TASKS else "span" if t in SPAN_TASKS else None


def tag_counts(batch: dict) -> dict[str, int]:
    return {"tokens": int((batch["labels"] != IGNORE).sum())}


def tag_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of logits (B, T, n_labels) at the labelled pieces (the first piece of each word); metrics
    loss and accuracy over those pieces."""
    n = max((norm or tag_counts(batch))["tokens"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def span_loss(outputs, batch: dict, norm: dict | None = None):
    """BERT's SQuAD loss: the mean of the start and end cross-entropies over the window's pieces (padding
    excluded, so it never changes the loss); a window without the answer points at [CLS] (position 0)."""
    start, end = outputs
    n = max((norm or {"n": start.shape[0]})["n"], 1)
    pad = batch["attention_mask"] == 0
    ce = lambda lg, y: F.cross_entropy(lg.float().masked_fill(pad, -math.inf), y, reduction="sum")   # noqa: E731
    loss = (ce(start, batch["start"]) + ce(end, batch["end"])) / (2 * n)
    return loss, {"loss": loss.detach()}


def token_objective(kind: str) -> Objective:
    """The objective of a token task: "tag" (NER) or "span" (SQuAD)."""
    forward = lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"])   # noqa: E731
    tokens = lambda b: b["idx"].numel()                                          # noqa: E731
    if kind == "tag":
        return Objective(forward=forward, loss=tag_loss, counts=tag_counts, tokens=tokens)
    if kind == "span":
        return Objective(forward=forward, loss=span_loss, counts=lambda b: {"n": int(b["start"].shape[0])},
                         tokens=tokens)
    raise ValueError(f"a token task is tag or span, not {kind!r}")


# --- data -------------------------------------------------------------------------------------------------

def load_data(task: str, data=None, train_file=None, dev_file=None, dev_fraction: float = 0.0):
    """-> (train, dev, notes): Sentences (tag) or Questions (span). conll2003: the folder with eng.train and
    eng.testa (its dev set); ner: CoNLL-format files; squad: json files, or one file whose last articles
    (dev_fraction of them) are the dev set."""
    notes = []
    if task.lower() == "conll2003":
        if data is None:
            raise ValueError("task 'conll2003' needs its folder (--data conll2003/, with eng.train and eng.testa)")
        train_file, dev_file = Path(data) / "eng.train", dev_file or Path(data) / "eng.testa"
    elif data is not None:
        train_file = train_file or data
    if train_file is None:
        raise ValueError(f"task {task!r} needs a training file (--train)")
    if kind_of(task) == "tag":
        train_items = read_conll(train_file)
        dev_items = read_conll(dev_file) if dev_file else None
        if dev_items is None and dev_fraction:
            train_items, dev_items = holdout(train_items, dev_fraction)
            notes.append(f"the last {len(dev_items)} sentences of {train_file} are the dev set")
    else:
        train_items, problems = read_squad(train_file)
        dev_items, more = read_squad(dev_file) if dev_file else (None, [])
        notes += [f"{len(problems + more)} answer(s) left out: answer_start does not match the text "
                  f"(first: {(problems + more)[0]})"] if problems + more else []
        if dev_items is None and dev_fraction:
            titles = list(dict.fromkeys(q.title for q in train_items))
            _, held = holdout(titles, dev_fraction)
            dev_items = [q for q in train_items if q.title in held]
            train_items = [q for q in train_items if q.title not in held]
            notes.append(f"articles {', '.join(held)} of {train_file} ({len(dev_items)} questions) are the dev set; "
                         f"the other {len(titles) - len(held)} articles ({len(train_items)} questions) are trained on")
    if not dev_items:
        raise ValueError(f"task {task!r} has no dev set to select on: give a dev file or a dev fraction")
    return train_items, dev_items, notes


def tag_labels(train: list[Sentence], dev: list[Sentence], path="") -> list[str]:
    """The tag set of the training sentences ("O" first); a dev tag not among them is an error."""
    labels = sorted({t for s in train for t in s.tags}, key=lambda t: (t != "O", t[2:], t))
    known = set(labels)
    for s in dev:
        bad = [t for t in s.tags if t not in known]
        if bad:
            raise ValueError(f"{s.where}: tag {bad[0]!r} was not seen in training (tags: {', '.join(labels)})")
    return labels


def prepare(task: str, tok, family: str, cfg, block_size: int, *, data=None, train_file=None, dev_file=None) -> dict:
    """A token task ready for finetune() (see duolm.train.sentence_tasks.prepare for the keys)."""
    if family != "bert" or not isinstance(tok, WordPiece):
        raise ValueError(f"task {task!r} tags word pieces: it needs a BERT model with a WordPiece vocabulary")
    kind = kind_of(task)
    train, dev, notes = load_data(task, data, train_file, dev_file, cfg.dev_fraction)
    max_length = min(cfg.max_length, block_size)
    if kind == "tag":
        scheme = tag_scheme(train + dev)
        labels = tag_labels(train, dev)                           # the whole file's tag set, limited or not
        train = first(train, cfg.max_train_examples, notes, "training sentences")
        head = HeadConfig("tag", labels, task.lower(), max_length)
        feats = tag_features(train, tok, labels, max_length, cfg.context)
        dev_feats = tag_features(dev, tok, labels, max_length, cfg.context)
        repaired = sum(invalid_starts(s.tags) for s in train + dev) if scheme != "IOB1" else 0
        notes += [f"tag scheme {scheme}" + (f"; {repaired} chunk(s) start with I- or E-, read as starts as conlleval "
                                            f"does" if repaired else "")]
        validate = lambda model: {"val_" + k: v for k, v in          # noqa: E731
                                  tag_scores(model, tok, dev, dev_feats, 2 * cfg.batch_size).items() if k in metrics}
        metrics, collate, sizes = ("f1", "precision", "recall"), collate_tags, (len(train), len(dev))
        cut = {"train": len(feats.cut), "dev": len(dev_feats.cut)}
    else:
        head = HeadConfig("span", [], "squad", max_length)
        train = first(train, cfg.max_train_examples, notes, "training questions")
        feats = span_features([q for q in train if q.answers or q.impossible], tok, max_length, stride=cfg.stride)
        dev_feats = span_features(dev, tok, max_length, stride=cfg.stride)
        validate = _span_validator(tok, dev, dev_feats, 2 * cfg.batch_size)
        metrics, collate, sizes = ("f1", "exact_match"), collate_spans, (len(train), len(dev))
        if any(q.impossible for q in train + dev):
            notes.append(f"SQuAD v2.0: {sum(q.impossible for q in train)} training questions without an answer "
                         f"(target [CLS]); the no-answer threshold is chosen on dev")
        cut = {"train questions": feats.cut_questions, "dev questions": dev_feats.cut_questions}
        notes.append(f"{len(feats)} training windows of at most {max_length} pieces from {sizes[0]} questions")
    return {"head": head, "train": feats, "collate": collate, "metrics": metrics, "objective": token_objective(kind),
            "validate": validate,
            "info": {"task": task.lower(), "kind": kind, "labels": head.labels, "train": sizes[0],
                     "dev": {"dev": sizes[1]}, "notes": notes, "truncated": cut}}


# --- predictions ------------------------------------------------------------------------------------------

@torch.no_grad()
def _outputs(model, features, collate, batch_size: int):
    """The model's outputs for every row of `features`, in order, as CPU tensors cut to each row's length."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = [None] * len(features)
    for index, batch in eval_batches(features, batch_size, collate_fn=collate):
        b = {k: v.to(device) for k, v in batch.items()}
        logits = model(b["idx"], b["segment_ids"], b["attention_mask"])
        logits = torch.stack(logits, -1) if isinstance(logits, tuple) else logits
        for row, i in enumerate(index):
            out[i] = logits[row, :len(features.ids[i])].float().cpu()
    model.train(was_training)
    return out


def predict_tags(model, tok, sentences: list[Sentence], features=None, batch_size: int = 64):
    """-> (tags, scores) per sentence: the argmax tag of each word's first piece and its probability (a word
    without a piece, or cut off by max_length, gets "O" and probability 0)."""
    head = model.head
    features = features or tag_features(sentences, tok, head.labels, head.max_length)
    tags, probs = [], []
    for logits, first in zip(_outputs(model, features, collate_tags, batch_size), features.first):
        p = logits.softmax(-1)
        tags.append([head.labels[int(p[f].argmax())] if f >= 0 else "O" for f in first])
        probs.append([float(p[f].max()) if f >= 0 else 0.0 for f in first])
    return tags, probs


def tag_scores(model, tok, sentences, features=None, batch_size: int = 64) -> dict:
    """conlleval's entity precision / recall / F1 (overall and per type) of the model on tagged sentences."""
    pred, _ = predict_tags(model, tok, sentences, features, batch_size)
    return entity_scores([s.tags for s in sentences], pred)


def _words(tok: WordPiece, text: str) -> list[tuple[int, int]]:
    """Character spans of the words of `text` as BERT splits them (whitespace and punctuation)."""
    enc = tok.encode(text)
    spans = []
    for i, (a, b) in zip(enc.ids[1:-1], enc.offsets[1:-1]):
        if spans and tok.inv[i].startswith("##"):
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


def predict_entities(model, tok, texts: list[str], batch_size: int = 64) -> list[list[dict]]:
    """The entities of each text: {"type", "text", "start", "end" (characters), "score" (the mean probability
    of its words' tags)}, words as BERT splits the text, chunks read by conlleval's rules."""
    spans = [_words(tok, t) for t in texts]
    sentences = [Sentence([t[a:b] for a, b in sp], None) for t, sp in zip(texts, spans)]
    tags, probs = predict_tags(model, tok, sentences, batch_size=batch_size)
    out = []
    for text, sp, tg, pr in zip(texts, spans, tags, probs):
        out.append([{"type": type_, "text": text[sp[i][0]:sp[j][1]], "start": sp[i][0], "end": sp[j][1],
                     "score": sum(pr[i:j + 1]) / (j + 1 - i)} for type_, i, j in entities(tg)])
    return out


def answer_questions(model, tok, questions: list[Question], features=None, batch_size: int = 64,
                     stride: int = 128, null_threshold: float | None = None) -> dict[str, dict]:
    """{question id: {"text", "start", "end", "score", "null_odds"}}: the best span of each question's context
    (see the module doc), or "" where the no-answer score beats it by more than null_threshold (SQuAD v2.0,
    duolm.data.token_tasks.answers); a context of any length is read through windows."""
    features = features or span_features(questions, tok, model.head.max_length, stride=stride)
    outs = _outputs(model, features, collate_spans, batch_size)
    spans = best_spans([o[:, 0].tolist() for o in outs], [o[:, 1].tolist() for o in outs], features,
                       range(len(features)))
    return answers(features, questions, spans, [float(o[0, 0] + o[0, 1]) for o in outs], null_threshold)


def span_scores(model, tok, questions: list[Question], features=None, batch_size: int = 64,
                null_threshold: float | None = None) -> dict:
    """The official SQuAD exact match and F1 (x 100) of the model on questions with gold answers. SQuAD v2.0
    (questions without an answer among them): at `null_threshold`, or, when it is None, at the threshold that
    maximizes F1 on these questions (the official script's best_f1), returned as "null_threshold"."""
    pred = answer_questions(model, tok, questions, features, batch_size)
    gold = {q.id: q.answers for q in questions if q.answers or q.impossible}
    texts = {k: v["text"] for k, v in pred.items()}
    if not any(q.impossible for q in questions):
        return squad_scores(texts, gold)
    return squad_v2_scores(texts, gold, {k: v["null_odds"] for k, v in pred.items()}, null_threshold)


def _span_validator(tok, dev: list[Question], features, batch_size: int):
    """validate(model) for train(): dev EM / F1 as fractions; on SQuAD v2.0 the no-answer threshold that maximizes
    dev F1 becomes the model's own (head.null_threshold), so that best/ answers with it."""
    def validate(model):
        scores = span_scores(model, tok, dev, features, batch_size)
        if "null_threshold" in scores:
            model.head.null_threshold = scores.pop("null_threshold")
        return {"val_" + k: v / 100 for k, v in scores.items()}
    return validate


def predict(model, tok, inputs, batch_size: int = 64) -> list:
    """tag: texts -> their entities; span: (question, context) pairs -> {"answer", "start", "end", "score"}."""
    if model.head.kind == "tag":
        return predict_entities(model, tok, list(inputs), batch_size)
    questions = []
    for i, pair in enumerate(inputs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(str(x).strip() for x in pair):
            raise ValueError(f"input {i}: a question answerer takes (question, context) pairs, both non-empty")
        questions.append(Question(str(i), pair[0], pair[1]))
    got = answer_questions(model, tok, questions, batch_size=batch_size, null_threshold=model.head.null_threshold)
    return [{"answer": got[q.id]["text"], **{k: got[q.id][k] for k in ("start", "end", "score")}} for q in questions]


def evaluate(model, tok, task: str, data=None, dev_file=None, dev_fraction: float = 0.0, batch_size: int = 64) -> dict:
    """The official metrics of a fine-tuned tagger / answerer on a task's dev data (see load_data)."""
    if data is None and dev_file is None:
        raise ValueError(f"give the dev data of task {task!r} (--data or --dev)")
    if task.lower() == "conll2003" or dev_file is not None:
        items = read_conll(dev_file or Path(data) / "eng.testa") if model.head.kind == "tag" else read_squad(dev_file)[0]
    else:
        _, items, _ = load_data(task, data, None, None, dev_fraction)
    return tag_scores(model, tok, items, batch_size=batch_size) if model.head.kind == "tag" else \
        span_scores(model, tok, items, batch_size=batch_size, null_threshold=model.head.null_threshold)
