"""The papers' task metrics as pure functions of plain lists (GLUE, CoNLL-2003, SQuAD).

Each is cross-checked in the tests against the reference implementation the field uses: scikit-learn
(accuracy, F1, Matthews), scipy (Pearson, Spearman), seqeval in conlleval mode (entity F1) and the
official SQuAD v1.1 script's rules (exact match, token F1). Degenerate inputs follow the references:
a ratio with a zero denominator is 0.0 (scikit-learn's zero_division), a correlation of a constant
series is nan (scipy).
"""
from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Sequence


def _same_length(a: Sequence, b: Sequence) -> int:
    if len(a) != len(b):
        raise ValueError(f"predictions and references differ in length: {len(a)} != {len(b)}")
    if not a:
        raise ValueError("no predictions to score")
    return len(a)


def accuracy(pred: Sequence, gold: Sequence) -> float:
    """Share of predictions equal to the reference.

    >>> accuracy([1, 0, 1, 1], [1, 1, 1, 0])
    0.5
    """
    n = _same_length(pred, gold)
    return sum(p == g for p, g in zip(pred, gold)) / n


def f1(pred: Sequence, gold: Sequence, positive=1) -> float:
    """F1 of the positive class: 2 TP / (2 TP + FP + FN) (MRPC, QQP).

    >>> f1([1, 1, 0, 0, 1], [1, 0, 0, 1, 1])     # TP 2, FP 1, FN 1: 4 / 6
    0.6666666666666666
    """
    _same_length(pred, gold)
    tp = sum(p == positive and g == positive for p, g in zip(pred, gold))
    fp = sum(p == positive and g != positive for p, g in zip(pred, gold))
    fn = sum(p != positive and g == positive for p, g in zip(pred, gold))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews(pred: Sequence, gold: Sequence) -> float:
    """Matthews correlation coefficient (CoLA), the multiclass form scikit-learn uses (Gorodkin 2004):

        MCC = (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2))

    with s samples, c correct, p_k / t_k the times class k is predicted / true. For two classes this is
    (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)). 0.0 when a factor of the denominator is 0.

    >>> matthews([1, 1, 0, 0, 1], [1, 0, 0, 1, 1])   # TP 2, TN 1, FP 1, FN 1: (2 - 1) / sqrt(3 * 3 * 2 * 2)
    0.16666666666666666
    """
    s = _same_length(pred, gold)
    c = sum(p == g for p, g in zip(pred, gold))
    classes = set(pred) | set(gold)
    p_k = {k: 0 for k in classes}
    t_k = dict(p_k)
    for p, g in zip(pred, gold):
        p_k[p] += 1
        t_k[g] += 1
    cov_pt = c * s - sum(p_k[k] * t_k[k] for k in classes)
    cov_pp = s * s - sum(v * v for v in p_k.values())
    cov_tt = s * s - sum(v * v for v in t_k.values())
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return cov_pt / math.sqrt(cov_pp * cov_tt)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation (STS-B): cov(x, y) / (std x std y); nan when either series is constant.

    >>> pearson([1, 2, 3, 4], [1, 3, 2, 4])           # cov 4/4 = 1.0 ... 4 / sqrt(5 * 5)
    0.8
    """
    n = _same_length(x, y)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    dx = [a - mx for a in x]
    dy = [b - my for b in y]
    sxx, syy = math.fsum(a * a for a in dx), math.fsum(b * b for b in dy)
    if sxx == 0 or syy == 0:
        return math.nan
    r = math.fsum(a * b for a, b in zip(dx, dy)) / math.sqrt(sxx * syy)
    return max(-1.0, min(1.0, r))


def ranks(x: Sequence[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span (scipy.stats.rankdata's "average").

    >>> ranks([10, 20, 20, 5])                        # 5 -> 1, 10 -> 2, the two 20s share 3 and 4
    [2.0, 3.5, 3.5, 1.0]
    """
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (STS-B): Pearson of the ranks, ties averaged as scipy does.

    >>> spearman([1, 2, 2, 3], [10, 30, 20, 40])      # ranks [1, 2.5, 2.5, 4] vs [1, 3, 2, 4]
    0.9486832980505138
    """
    _same_length(x, y)
    return pearson(ranks(x), ranks(y))


# The GLUE metrics by name, as tasks list them (duolm.tasks.sentence).
SEQUENCE_METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


# --- entities (CoNLL-2003): conlleval's chunk rules ------------------------------------------------------

def _split_tag(tag: str) -> tuple[str, str]:
    """"B-PER" -> ("B", "PER"); "O" -> ("O", "_") (conlleval's / seqeval's reading of a tag)."""
    return tag[:1], (tag[1:].split("-", 1)[-1] or "_")


def _chunk_end(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (prev in ("E", "S") or (prev in ("B", "I") and tag in ("B", "S", "O"))
            or (prev not in ("O", ".") and prev_type != type_))


def _chunk_start(prev: str, tag: str, prev_type: str, type_: str) -> bool:
    return (tag in ("B", "S") or (prev in ("E", "S", "O") and tag in ("E", "I"))
            or (tag not in ("O", ".") and prev_type != type_))


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entity chunks (type, first, last) of one sentence's tags, by the conlleval script's rules, which read
    IOB1, IOB2 and IOBES alike: a chunk starts at B- (or S-), or at an I- (or E-) whose type differs from the
    token before or that follows O / the end of a chunk; it ends before O, B-, S-, a change of type, or after
    E- / S-. So an I- tag that IOB2 forbids (after O) is read as a chunk start, as conlleval does.

    >>> entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-ORG"])     # IOB1's I-LOC after O starts a chunk
    [('PER', 0, 1), ('LOC', 3, 3), ('LOC', 4, 4), ('ORG', 5, 5)]
    """
    out, prev, prev_type, begin = [], "O", "_", 0
    for i, t in enumerate(list(tags) + ["O"]):
        tag, type_ = _split_tag(t)
        if _chunk_end(prev, tag, prev_type, type_):
            out.append((prev_type, begin, i - 1))
        if _chunk_start(prev, tag, prev_type, type_):
            begin = i
        prev, prev_type = tag, type_
    return out


def invalid_starts(tags: Sequence[str]) -> int:
    """Chunks that start with I- or E- (forbidden in IOB2 / IOBES; normal in IOB1): the repairs conlleval makes.

    >>> invalid_starts(["O", "I-PER", "I-PER", "B-LOC", "I-ORG"])
    2
    """
    return sum(tags[first][:1] in ("I", "E") for _, first, _ in entities(tags))


def _prf(correct: int, pred: int, gold: int) -> dict:
    p = correct / pred if pred else 0.0
    r = correct / gold if gold else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0, "support": gold}


def entity_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """Entity precision / recall / F1 over sentences, overall and per type, as conlleval counts them: an entity
    is found when a predicted chunk has the gold chunk's type, first and last token.

    >>> s = entity_scores([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-ORG"]])
    >>> s["precision"], s["recall"], s["per_type"]["PER"]["f1"], s["per_type"]["LOC"]["recall"]
    (0.5, 0.5, 1.0, 0.0)
    """
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted")
    found, wanted, right = {}, {}, {}
    for n, (g, p) in enumerate(zip(gold, pred)):
        if len(g) != len(p):
            raise ValueError(f"sentence {n}: {len(g)} gold tags but {len(p)} predicted")
        ge, pe = set(entities(g)), set(entities(p))
        for table, chunks in ((wanted, ge), (found, pe), (right, ge & pe)):
            for type_, _, _ in chunks:
                table[type_] = table.get(type_, 0) + 1
    types = sorted(set(found) | set(wanted))
    overall = _prf(sum(right.values()), sum(found.values()), sum(wanted.values()))
    return {**overall, "per_type": {t: _prf(right.get(t, 0), found.get(t, 0), wanted.get(t, 0)) for t in types}}


# --- SQuAD v1.1: the official evaluation script's answer comparison ---------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a / an / the, collapse whitespace (in that order).

    >>> normalize_answer("The  Eiffel-Tower, in  Paris!")
    'eiffeltower in paris'
    """
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def squad_exact(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold answer.

    >>> squad_exact("the Broncos", ["Denver Broncos", "Broncos"])
    1.0
    """
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def squad_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token F1 against the gold answers (bags of normalized words).

    >>> squad_f1("Denver Broncos won", ["the Denver Broncos", "Broncos"])   # 2 of 3 words, both gold words
    0.8
    """
    return max(token_f1(prediction, a) for a in answers)


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the bags of normalized words of one prediction and one gold answer (0 when either is empty).

    >>> token_f1("The red, big dog!", "a red cat")   # 1 word shared: precision 1/3, recall 1/2
    0.4
    """
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_question_scores(predictions: dict, answers: dict) -> dict:
    """{id: (exact, f1)} of each question of `answers` ({id: [gold texts]}), a missing prediction scoring 0, as
    the official v1.1 script. An empty gold list is a question without an answer (SQuAD v2.0): "" is right and
    anything else wrong, and (as v2.0's script) gold texts that normalize to nothing are dropped.

    Example: {"a": "Denver Broncos", "b": ""} against {"a": ["Broncos"], "b": []} -> {"a": (0, 2/3), "b": (1, 1)}."""
    v2 = any(not a for a in answers.values())
    out = {}
    for q, a in answers.items():
        pred, golds = predictions.get(q, ""), [g for g in a if normalize_answer(g)] if v2 else a
        empty = float(not normalize_answer(pred))
        out[q] = (squad_exact(pred, golds), squad_f1(pred, golds)) if golds else (empty, empty)
    return out


def squad_scores(predictions: dict, answers: dict) -> dict:
    """{"exact_match", "f1"} x 100: the mean of squad_question_scores."""
    if not answers:
        raise ValueError("no questions to score")
    per = squad_question_scores(predictions, answers).values()
    return {"exact_match": 100 * sum(e for e, _ in per) / len(per), "f1": 100 * sum(f for _, f in per) / len(per)}


def squad_null_threshold(scores: dict, null_odds: dict, has_answer: dict, answered: dict) -> tuple[float, float]:
    """SQuAD v2.0's best no-answer threshold (the official script's find_best_thresh): a question is answered ""
    when its null_odds exceed the threshold. scores: each question's score (0-1, EM or F1) of its best span;
    answered: whether that span is non-empty. -> (the best total score x 100, its threshold).

    Start with every question answered "" (the no-answer questions right), then answer them one by one in
    increasing null_odds, keeping the best total. Example: a (has an answer, span F1 1.0, odds -2), b (no answer,
    a span, odds 1), c (has an answer, F1 0.5, odds 3): all "" -> 1; answer a -> 2; b -> 1; c -> 1.5:
    (200 / 3, -2)."""
    total = sum(not h for h in has_answer.values())
    best, threshold = total, 0.0
    for q in sorted(null_odds, key=null_odds.get):
        total += scores[q] if has_answer[q] else -float(answered[q])
        if total > best:
            best, threshold = total, null_odds[q]
    return 100 * best / len(scores), threshold


def squad_v2_scores(predictions: dict, answers: dict, null_odds: dict, threshold: float | None = None) -> dict:
    """SQuAD v2.0's official {"exact_match", "f1"} x 100 with a no-answer threshold, and the threshold: a question
    whose null_odds exceed it is answered "" (right exactly when it has no gold text), the others are scored by
    their predicted span (squad_question_scores). threshold None: the one that maximizes F1 (the script's best_f1).

    Example: predictions {"a": "Broncos", "b": "Panthers"}, answers {"a": ["Broncos"], "b": []}, null_odds
    {"a": -1, "b": 2}, threshold 0 -> a answered and right, b answered "" and right: 100, 100."""
    per = squad_question_scores(predictions, answers)
    has = {q: bool(a) for q, a in answers.items()}
    if threshold is None:
        _, threshold = squad_null_threshold({q: f for q, (_, f) in per.items()}, {q: null_odds[q] for q in answers},
                                            has, {q: bool(predictions.get(q, "")) for q in answers})
    at = [(float(not has[q]),) * 2 if null_odds[q] > threshold else per[q] for q in answers]
    return {"exact_match": 100 * sum(e for e, _ in at) / len(at), "f1": 100 * sum(f for _, f in at) / len(at),
            "null_threshold": threshold}

