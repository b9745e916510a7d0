"""Task metrics: the docstrings' worked examples, and equality with scikit-learn / scipy on random cases
(ties, degenerate classes and constant series included)."""
from __future__ import annotations

import doctest
import json
import math
import os
import random
import subprocess
import sys
import warnings

import pytest

from duolm import metrics
from duolm.metrics import accuracy, f1, matthews, pearson, ranks, spearman

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


# --- entities: equal to seqeval in its default (conlleval) mode ------------------------------------------

from duolm.metrics import (entities, entity_scores, invalid_starts, normalize_answer,  # noqa: E402
                                      squad_exact, squad_f1, squad_scores)


def _seqeval_scores(gold, pred):
    seqeval = pytest.importorskip("seqeval.metrics")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # numpy's "mean of empty slice" on degenerate reports
        return seqeval.classification_report(gold, pred, output_dict=True, zero_division=0)


def _assert_equal_to_seqeval(gold, pred):
    from seqeval.metrics.sequence_labeling import get_entities

    for g in gold:
        assert entities(g) == get_entities(g)
    ours = entity_scores(gold, pred)
    ref = _seqeval_scores(gold, pred)
    assert ours["f1"] == pytest.approx(ref["micro avg"]["f1-score"], abs=1e-12)
    assert ours["precision"] == pytest.approx(ref["micro avg"]["precision"], abs=1e-12)
    assert ours["recall"] == pytest.approx(ref["micro avg"]["recall"], abs=1e-12)
    for t, s in ours["per_type"].items():
        if s["support"]:                                   # seqeval lists the gold types
            assert s["f1"] == pytest.approx(ref[t]["f1-score"], abs=1e-12)
            assert s["support"] == ref[t]["support"]


@pytest.mark.parametrize("scheme", ["IOB1", "IOB2", "IOBES", "any"])
def test_entity_scores_equal_seqeval_on_random_tags(scheme):
    pytest.importorskip("seqeval")
    prefixes = {"IOB1": "IO", "IOB2": "BIO", "IOBES": "BIOES", "any": "BIOES"}[scheme]
    rng = random.Random(len(scheme))
    for _ in range(200):
        n = rng.randint(1, 5)
        gold = [[_tag(rng, prefixes) for _ in range(rng.randint(1, 12))] for _ in range(n)]
        pred = [[t if rng.random() < 0.7 else _tag(rng, prefixes) for t in g] for g in gold]
        _assert_equal_to_seqeval(gold, pred)


def _tag(rng, prefixes):
    p = rng.choice(prefixes)
    return "O" if p == "O" else f"{p}-{rng.choice(['PER', 'LOC', 'ORG', 'MISC'])}"


def test_entity_scores_equal_seqeval_on_conll(data_dir):
    pytest.importorskip("seqeval")
    sentences, cur = [], []
    for line in (data_dir / "conll2003" / "eng.testa").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("-DOCSTART-"):
            if cur:
                sentences.append(cur)
            cur = []
        else:
            cur.append(line.split()[-1])
    assert len(sentences) == 3250
    rng = random.Random(0)
    labels = sorted({t for s in sentences for t in s})
    pred = [[t if rng.random() < 0.9 else rng.choice(labels) for t in s] for s in sentences]
    _assert_equal_to_seqeval(sentences, pred)
    to_iob2 = [[("B" + t[1:]) if t != "O" and (i == 0 or s[i - 1][2:] != t[2:]) else t for i, t in enumerate(s)]
               for s in sentences]
    assert entity_scores(sentences, sentences)["f1"] == 1.0
    assert entities(to_iob2[0]) == entities(sentences[0]) and invalid_starts(to_iob2[5]) == 0
    assert sum(map(invalid_starts, sentences)) > 1000                # IOB1: most entities start with I-


def test_squad_normalisation_rules():
    assert normalize_answer("NASA") == "nasa"                        # lower case
    assert normalize_answer("U.S.A., ok!") == "usa ok"               # ASCII punctuation removed (not replaced)
    assert normalize_answer("the cat and a dog an owl") == "cat and dog owl"   # articles, as words only
    assert normalize_answer("theatre another") == "theatre another"
    assert normalize_answer("  two\t\nwords  ") == "two words"       # whitespace collapsed
    assert normalize_answer("“curly” – dash") == "“curly” – dash"    # non-ASCII punctuation kept, as the script
    assert squad_exact("The Broncos.", ["Denver Broncos", "broncos"]) == 1.0
    assert squad_exact("Denver", ["Denver Broncos"]) == 0.0
    assert squad_f1("Denver Broncos won", ["the Denver Broncos", "Broncos"]) == pytest.approx(0.8)
    assert squad_f1("the", ["a"]) == 0.0                             # nothing left after normalising
    assert squad_f1("Santa Clara, California", ["Santa Clara", "Levi's Stadium"]) == pytest.approx(0.8)
    got = squad_scores({"q1": "Broncos", "q2": "Carolina"}, {"q1": ["Denver Broncos"], "q2": ["Panthers"],
                                                             "q3": ["x"]})
    assert got == {"exact_match": 0.0, "f1": pytest.approx(100 * (2 / 3) / 3)}


def test_squad_v2_worked_examples():
    from duolm.metrics import squad_null_threshold, squad_question_scores, squad_v2_scores
    assert squad_question_scores({"a": "Denver Broncos", "b": ""}, {"a": ["Broncos"], "b": []}) == \
        {"a": (0.0, pytest.approx(2 / 3)), "b": (1.0, 1.0)}
    assert squad_question_scores({"b": "the"}, {"b": []}) == {"b": (1.0, 1.0)}     # "" after normalising
    assert squad_question_scores({"b": "Broncos"}, {"b": []}) == {"b": (0.0, 0.0)}
    assert squad_question_scores({"a": ""}, {"a": ["the"]}) == {"a": (1.0, 0.0)}    # v1.1: "the" is a gold text
    assert squad_question_scores({"a": ""}, {"a": ["the"], "b": []}) == {"a": (1.0, 1.0), "b": (1.0, 1.0)}  # v2.0
    score, threshold = squad_null_threshold({"a": 1.0, "b": 0.0, "c": 0.5}, {"a": -2.0, "b": 1.0, "c": 3.0},
                                            {"a": True, "b": False, "c": True}, {"a": True, "b": True, "c": True})
    assert (score, threshold) == (pytest.approx(200 / 3), -2.0)
    got = squad_v2_scores({"a": "Broncos", "b": "Panthers"}, {"a": ["Broncos"], "b": []}, {"a": -1, "b": 2}, 0)
    assert got == {"exact_match": 100.0, "f1": 100.0, "null_threshold": 0}
    assert squad_v2_scores({"a": "Broncos", "b": "Panthers"}, {"a": ["Broncos"], "b": []}, {"a": -1, "b": 2}, 5) \
        == {"exact_match": 50.0, "f1": 50.0, "null_threshold": 5}


_V2_REFERENCE = """
import json, sys
from types import SimpleNamespace
from transformers.data.metrics import squad_metrics as m
out = []
for case in json.load(sys.stdin):
    examples = [SimpleNamespace(qas_id=q, answers=[{"text": t} for t in a]) for q, a in case["gold"].items()]
    has = {e.qas_id: bool(e.answers) for e in examples}
    exact, f1 = m.get_raw_scores(examples, case["pred"])
    best_f1, thresh = m.find_best_thresh(case["pred"], f1, case["odds"], has)
    out.append({"exact": exact, "f1": f1, "best_f1": best_f1, "thresh": thresh,
                "eval": m.squad_evaluate(examples, case["pred"], case["odds"], thresh)})
print(json.dumps(out))
"""


def test_squad_v2_equals_the_official_script():
    """SQuAD v2.0 EM / F1 of each question, the best no-answer threshold and the scores at it, against the
    official v2.0 script's functions as transformers 4.57 ships them (squad_metrics), on random cases with
    no-answer questions, empty predictions, gold texts that normalize to nothing and tied odds."""
    from conftest import qa_reference
    from duolm.metrics import squad_null_threshold, squad_question_scores, squad_v2_scores
    words = ["the", "a", "Denver", "Broncos", "won", "Super", "Bowl", "50", "!", "an", "Levi's", "Stadium"]
    rng = random.Random(0)
    phrase = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))          # noqa: E731
    cases = []
    for case_no in range(8):
        gold = {f"q{i}": [] if rng.random() < 0.4 else [phrase() for _ in range(rng.randint(1, 3))]
                for i in range(60)}
        pred = {q: "" if rng.random() < 0.2 else phrase() for q in gold}
        odds = {q: float(rng.randint(-5, 5)) if case_no % 2 else rng.gauss(0, 3) for q in gold}
        cases.append({"gold": gold, "pred": pred, "odds": odds})
    refs = json.loads(subprocess.run([sys.executable, "-c", _V2_REFERENCE], input=json.dumps(cases), text=True,
                                     capture_output=True, check=True,
                                     env={**os.environ, "PYTHONPATH": str(qa_reference())}).stdout)
    for case, ref in zip(cases, refs):
        gold, pred, odds = case["gold"], case["pred"], case["odds"]
        per = squad_question_scores(pred, gold)
        assert {q: e for q, (e, _) in per.items()} == ref["exact"]
        assert {q: f for q, (_, f) in per.items()} == pytest.approx(ref["f1"])
        best, threshold = squad_null_threshold({q: f for q, (_, f) in per.items()}, odds,
                                               {q: bool(a) for q, a in gold.items()}, {q: bool(p) for q, p in pred.items()})
        assert (best, threshold) == (pytest.approx(ref["best_f1"]), ref["thresh"])
        at = squad_v2_scores(pred, gold, odds)
        assert at == {"exact_match": pytest.approx(ref["eval"]["exact"]), "f1": pytest.approx(ref["eval"]["f1"]),
                      "null_threshold": threshold}
