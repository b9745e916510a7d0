"""Labelled texts and text pairs in files, for the sentence tasks (duolm.tasks.sentence): GLUE's and the user's.

User files: the columns are named (a header row for csv / tsv, keys for jsonl). A label column whose
values are all numbers, some of them not integers, is a regression target; otherwise the labels are
classes (sorted: numerically when they are all integers). A column mixing numbers and words is an error.
"""
from __future__ import annotations

from dataclasses import dataclass

from duolm.tasks.base import column, read_rows


@dataclass
class Example:
    """One input: a text or a pair, its label (a class name, a number, or None for test data), and where it
    came from ("file:line", for errors; `index` is the GLUE test id the submission file needs)."""
    text_a: str
    text_b: str | None = None
    label: str | float | None = None
    where: str = ""
    index: str | None = None


def read_examples(path, text: str, pair: str | None = None, label: str | None = None, *,
                  columns: tuple | None = None, index: str | None = None) -> list[Example]:
    """Examples from the named columns of a file (see read_rows); label None: unlabelled (test) data."""
    header, rows = read_rows(path, columns)
    if not rows:
        raise ValueError(f"{path}: no examples (the file is empty{' or holds only its header' if header else ''})")
    for name, what in ((text, "text"), (pair, "text pair"), (label, "label"), (index, "index")):
        if name is not None:
            column(path, header, name, what)
    out = []
    for line, row in rows:
        missing = [c for c in (text, pair, label) if c is not None and row.get(c) is None]
        if missing:                                   # jsonl objects may lack a key the others have
            raise ValueError(f"{path} line {line}: no value for column(s) {missing}")
        out.append(Example(str(row[text]), None if pair is None else str(row[pair]),
                           None if label is None else row[label], f"{path}:{line}",
                           None if index is None else str(row[index])))
    return out


def _number(v):
    """int, float or None (not a number) for a label value from a file (text) or from JSON."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    s = str(v).strip()
    for kind in (int, float):
        try:
            return kind(s)
        except ValueError:
            pass
    return None


def label_space(examples: list[Example], path, force_regress: bool = False) -> tuple[str, list[str]]:
    """(kind, labels) a training set implies: ("regress", []) when every label is a number and some is not an
    integer (or force_regress), else ("classify", sorted class names). Mixed numbers and words are an error.

    Example: labels "pos", "neg", "pos" -> ("classify", ["neg", "pos"]); "2", "10" -> ("classify", ["2", "10"]);
    "0.5", "3" -> ("regress", [])."""
    values = [e.label for e in examples]
    nums = [_number(v) for v in values]
    words = [(e, v) for e, v, n in zip(examples, values, nums) if n is None]
    if words and len(words) < len(values):
        num = next(e for e, n in zip(examples, nums) if n is not None)
        raise ValueError(f"{path}: the label column mixes numbers ({num.label!r} at {num.where}) and words "
                         f"({words[0][1]!r} at {words[0][0].where}); labels must be all class names or all numbers")
    if force_regress and words:
        raise ValueError(f"{path}: regression needs numeric labels; {words[0][1]!r} at {words[0][0].where} is not")
    if not words and (force_regress or any(isinstance(n, float) for n in nums)):
        for e, n in zip(examples, nums):
            e.label = float(n)
        return "regress", []
    names = {str(v).strip() if not isinstance(v, str) else v for v in values}
    for e in examples:
        e.label = str(e.label).strip() if not isinstance(e.label, str) else e.label
    if len(names) < 2:
        raise ValueError(f"{path}: every example has the label {next(iter(names))!r}; a classifier needs two or more")
    key = (lambda s: int(s)) if not words else (lambda s: s)
    return "classify", sorted(names, key=key)


def check_labels(examples: list[Example], kind: str, labels) -> None:
    """Every label of (dev) `examples` must be one the model has (classify) or a number (regress)."""
    known = set(labels)
    for e in examples:
        if e.label is None:
            raise ValueError(f"{e.where}: no label")
        if kind == "regress":
            n = _number(e.label)
            if n is None:
                raise ValueError(f"{e.where}: label {e.label!r} is not a number (the task is a regression)")
            e.label = float(n)
        else:
            e.label = e.label if isinstance(e.label, str) else str(e.label)
            if e.label not in known:
                raise ValueError(f"{e.where}: label {e.label!r} was not seen in training (labels: {', '.join(labels)})")
