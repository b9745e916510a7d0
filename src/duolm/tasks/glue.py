"""GLUE as download_glue_data.py lays it out: the nine tasks' folders, columns, labels and metrics. Adding a
GLUE-shaped task is a line here; duolm.tasks.sentence reads, trains, predicts and scores them all.

TASK/train.tsv, dev.tsv, test.tsv; tab-separated, no quoting (a '"' is text); CoLA's train and dev files have
no header (source, label, original label, sentence); MNLI has dev_matched.tsv / dev_mismatched.tsv and
test_matched.tsv / test_mismatched.tsv. Test files have an index column and no label; predictions for them go
to the GLUE submission files (SST-2.tsv, MNLI-m.tsv, ...: "index<TAB>prediction").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its folder, columns, labels (None: regression) and metrics (the first one selects)."""
    name: str
    folder: str
    text_a: str
    text_b: str | None
    label: str
    labels: tuple | None
    metrics: tuple
    dev: tuple = (("", "dev.tsv"),)                   # (metric prefix, file)
    test: tuple = ()                                  # (submission file, test file)
    columns: tuple | None = None                      # names of headerless train/dev columns (CoLA)
    index: str = "index"

    @property
    def kind(self) -> str:
        return "regress" if self.labels is None else "classify"


def _glue(name, folder, a, b, label, labels, metrics, **kw):
    kw.setdefault("test", ((f"{folder}.tsv", "test.tsv"),))
    return GlueTask(name, folder, a, b, label, labels, metrics, **kw)


GLUE = {t.name: t for t in (
    _glue("cola", "CoLA", "sentence", None, "label", ("0", "1"), ("matthews", "accuracy"),
          columns=("source", "label", "original_label", "sentence")),
    _glue("sst2", "SST-2", "sentence", None, "label", ("0", "1"), ("accuracy",)),
    _glue("mrpc", "MRPC", "#1 String", "#2 String", "Quality", ("0", "1"), ("f1", "accuracy")),
    _glue("stsb", "STS-B", "sentence1", "sentence2", "score", None, ("spearman", "pearson")),
    _glue("qqp", "QQP", "question1", "question2", "is_duplicate", ("0", "1"), ("f1", "accuracy"), index="id"),
    _glue("mnli", "MNLI", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
          ("accuracy",), dev=(("", "dev_matched.tsv"), ("mm_", "dev_mismatched.tsv")),
          test=(("MNLI-m.tsv", "test_matched.tsv"), ("MNLI-mm.tsv", "test_mismatched.tsv"))),
    _glue("qnli", "QNLI", "question", "sentence", "label", ("entailment", "not_entailment"), ("accuracy",)),
    _glue("rte", "RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment"), ("accuracy",)),
    _glue("wnli", "WNLI", "sentence1", "sentence2", "label", ("0", "1"), ("accuracy",)),
)}
# Tasks for the user's own files: "classify" infers classes or regression from the label column.
USER_TASKS = ("classify", "regress")


def glue_task(name: str) -> GlueTask:
    key = name.lower().replace("-", "")
    if key not in GLUE:
        raise ValueError(f"unknown task {name!r}; GLUE tasks: {', '.join(GLUE)}; your own csv/tsv/jsonl files: "
                         f"{', '.join(USER_TASKS)}")
    return GLUE[key]
