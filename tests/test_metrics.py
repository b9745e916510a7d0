"""Task metrics: the docstrings' worked examples, and equality with scikit-learn / scipy on random cases
(ties, degenerate classes and constant series included)."""
from __future__ import annotations

import doctest
import math
import random
import warnings

import pytest

from duolm.evaluation import metrics
from duolm.evaluation.metrics import accuracy, f1, matthews, pearson, ranks, spearman

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


def test_worked_examples():
    assert doctest.testmod(metrics).failed == 0
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert f1([1, 1, 0, 0, 1], [1, 0, 0, 1, 1]) == pytest.approx(4 / 6)
    assert matthews([1, 1, 0, 0, 1], [1, 0, 0, 1, 1]) == pytest.approx(1 / 6)
    assert ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(3 / math.sqrt(10))


def _cases(seed, n_cases=200):
    rng = random.Random(seed)
    for _ in range(n_cases):
        n = rng.choice([1, 2, 3, 5, 20, 200])
        k = rng.choice([2, 2, 3, 5])
        gold = [rng.randrange(k) for _ in range(n)]
        skew = rng.random()
        pred = [g if rng.random() < skew else rng.randrange(k) for g in gold]
        yield pred, gold


def test_classification_metrics_equal_sklearn():
    for pred, gold in _cases(0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # sklearn warns on degenerate cases, and returns 0.0
            assert accuracy(pred, gold) == pytest.approx(sklearn_metrics.accuracy_score(gold, pred))
            assert matthews(pred, gold) == pytest.approx(sklearn_metrics.matthews_corrcoef(gold, pred), abs=1e-12)
            if set(pred) | set(gold) <= {0, 1}:
                assert f1(pred, gold) == pytest.approx(sklearn_metrics.f1_score(gold, pred, zero_division=0.0))


def test_degenerate_cases_follow_the_references():
    assert matthews([1, 1, 1], [0, 1, 0]) == 0.0          # one class predicted: sklearn's 0.0
    assert f1([0, 0], [0, 0]) == 0.0                      # no positives anywhere
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))      # constant series: scipy's nan
    with pytest.raises(ValueError, match="differ in length"):
        accuracy([1], [1, 0])
    with pytest.raises(ValueError, match="no predictions"):
        f1([], [])


def test_correlations_equal_scipy_with_ties():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.choice([2, 3, 10, 100])
        tie = rng.random() < 0.5                           # STS-B scores sit on a 0.2 grid: many ties
        x = [round(rng.uniform(0, 5) * 5) / 5 if tie else rng.gauss(0, 1) for _ in range(n)]
        y = [a + rng.gauss(0, 1) if rng.random() < 0.7 else rng.choice(x) for a in x]
        assert ranks(x) == pytest.approx(list(stats.rankdata(x)))
        if len(set(x)) == 1 or len(set(y)) == 1:
            assert math.isnan(pearson(x, y)) and math.isnan(spearman(x, y))
            continue
        assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
