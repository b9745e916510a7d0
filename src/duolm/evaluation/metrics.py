"""The papers' task metrics as pure functions of plain lists (GLUE, CoNLL-2003, SQuAD).

Each is cross-checked in the tests against the reference implementation the field uses: scikit-learn
(accuracy, F1, Matthews), scipy (Pearson, Spearman), seqeval in conlleval mode (entity F1) and the
official SQuAD v1.1 script's rules (exact match, token F1). Degenerate inputs follow the references:
a ratio with a zero denominator is 0.0 (scikit-learn's zero_division), a correlation of a constant
series is nan (scipy).
"""
from __future__ import annotations

import math
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


# The GLUE metrics by name, as tasks list them (duolm.data.tasks).
SEQUENCE_METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}
