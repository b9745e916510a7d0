"""Readers for fine-tuning data: the nine GLUE tasks in their standard directory layout, and user files
(csv / tsv / jsonl with named columns), into plain `Example`s. Every error names the file (and line).

GLUE (as download_glue_data.py lays it out): TASK/train.tsv, dev.tsv, test.tsv; tab-separated, no
quoting (a '"' is text); CoLA's train and dev files have no header (source, label, original label,
sentence); MNLI has dev_matched.tsv / dev_mismatched.tsv and test_matched.tsv / test_mismatched.tsv.
Test files have an index column and no label; predictions for them go to the GLUE submission files
(SST-2.tsv, MNLI-m.tsv, ...: "index<TAB>prediction").

User files: the columns are named (a header row for csv / tsv, keys for jsonl). A label column whose
values are all numbers, some of them not integers, is a regression target; otherwise the labels are
classes (sorted: numerically when they are all integers). A column mixing numbers and words is an error.
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from duolm.fileio import write_text

csv.field_size_limit(sys.maxsize)         # long passages (RTE, QNLI) are one field


@dataclass
class Example:
    """One input: a text or a pair, its label (a class name, a number, or None for test data), and where it
    came from ("file:line", for errors; `index` is the GLUE test id the submission file needs)."""
    text_a: str
    text_b: str | None = None
    label: str | float | None = None
    where: str = ""
    index: str | None = None


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


# --- rows of a file --------------------------------------------------------------------------------

def read_rows(path, columns: tuple | None = None) -> tuple[list[str], list[tuple[int, dict]]]:
    """-> (column names, [(line number, {column: value})]) of a .tsv, .csv or .jsonl file.

    .tsv: tab-separated, no quoting (the GLUE convention); .csv: standard quoting; both with a header row
    unless `columns` names the columns. .jsonl: one JSON object per line. Every row must have as many
    fields as the header (ValueError naming the file and line). A UTF-8 byte-order mark is skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".tsv", ".csv", ".jsonl", ".json"):
        raise ValueError(f"{path}: unknown format {suffix!r}; use .tsv, .csv or .jsonl")
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if suffix in (".jsonl", ".json"):
                return _read_jsonl(path, f)
            return _read_table(path, f, suffix, columns)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_table(path, f, suffix, columns):
    reader = csv.reader(f, delimiter="\t" if suffix == ".tsv" else ",",
                        quoting=csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL)
    rows = []
    header = list(columns) if columns else None
    try:
        for fields in reader:
            if not fields or fields == [""]:
                continue
            if header is None:
                header = [h.strip() for h in fields]
                continue
            if len(fields) != len(header):
                raise ValueError(f"{path} line {reader.line_num}: {len(fields)} fields, the header has {len(header)} "
                                 f"({', '.join(header)})")
            rows.append((reader.line_num, dict(zip(header, fields))))
    except csv.Error as e:
        raise ValueError(f"{path} line {reader.line_num}: {e}") from None
    return header or [], rows


def _read_jsonl(path, f):
    rows, header = [], {}
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        header.update(dict.fromkeys(obj))
        rows.append((n, obj))
    return list(header), rows


def _column(path, header, name, what):
    if name not in header:
        raise ValueError(f"{path}: no {what} column {name!r}; the columns are: {', '.join(map(str, header)) or 'none'}")
    return name


def read_examples(path, text: str, pair: str | None = None, label: str | None = None, *,
                  columns: tuple | None = None, index: str | None = None) -> list[Example]:
    """Examples from the named columns of a file (see read_rows); label None: unlabelled (test) data."""
    header, rows = read_rows(path, columns)
    if not rows:
        raise ValueError(f"{path}: no examples (the file is empty{' or holds only its header' if header else ''})")
    for name, what in ((text, "text"), (pair, "text pair"), (label, "label"), (index, "index")):
        if name is not None:
            _column(path, header, name, what)
    out = []
    for line, row in rows:
        where = f"{path}:{line}"
        missing = [c for c in (text, pair, label) if c is not None and row.get(c) is None]
        if missing:                                   # jsonl objects may lack a key the others have
            raise ValueError(f"{path} line {line}: no value for column(s) {missing}")
        out.append(Example(str(row[text]), None if pair is None else str(row[pair]),
                           None if label is None else row[label], where,
                           None if index is None else str(row[index])))
    return out


# --- labels ----------------------------------------------------------------------------------------

def _number(v):
    """int, float or None (not a number) for a label value from a file (text) or from JSON."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    s = str(v).strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
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


# --- a whole task ----------------------------------------------------------------------------------

@dataclass
class TaskData:
    """A task's data ready for fine-tuning: examples per split, the label space, the metrics (first selects).

    dev: {metric prefix: examples} ("" for the one dev set; MNLI adds "mm_" for mismatched);
    test: {submission file name: examples} (GLUE test files, unlabelled)."""
    name: str
    kind: str
    labels: list
    metrics: tuple
    train: list = field(default_factory=list)
    dev: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)       # what was done to the data, for the user (held-out dev, ...)


def load_glue(name: str, data_dir, splits=("train", "dev", "test"), dev_fraction: float = 0.0) -> TaskData:
    """A GLUE task from its standard folder. Without dev files, `dev_fraction` > 0 holds out the LAST share
    of train.tsv as the dev set (the notes say so); test files are read when present."""
    task, data_dir = glue_task(name), Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such folder (expected the GLUE {task.folder} folder with train.tsv)")

    def read(file, labelled=True):
        path = data_dir / file
        headerless = task.columns is not None and labelled
        return read_examples(path, task.text_a, task.text_b, task.label if labelled else None,
                             columns=task.columns if headerless else None, index=None if labelled else task.index)

    data = TaskData(task.name, task.kind, list(task.labels or []), task.metrics)
    if "train" in splits or ("dev" in splits and dev_fraction):
        data.train = read("train.tsv")
        check_labels(data.train, task.kind, data.labels)
    if "dev" in splits:
        present = [(p, f) for p, f in task.dev if (data_dir / f).is_file()]
        if present:
            data.dev = {p: read(f) for p, f in present}
        elif dev_fraction:
            data.train, held = holdout(data.train, dev_fraction)
            data.dev = {"": held}
            data.notes.append(f"{data_dir} has no {task.dev[0][1]}: the last {len(held)} examples of train.tsv "
                              f"({dev_fraction:.0%}) are the dev set, the first {len(data.train)} the training set")
        else:
            raise FileNotFoundError(f"{data_dir}: no {' or '.join(f for _, f in task.dev)}; pass a dev fraction "
                                    f"(--dev-fraction 0.1) to hold out the end of train.tsv instead")
        for examples in data.dev.values():
            check_labels(examples, task.kind, data.labels)
    if "test" in splits:
        data.test = {sub: read(f, labelled=False) for sub, f in task.test if (data_dir / f).is_file()}
    return data


def load_user(train=None, dev=None, text: str = "text", pair: str | None = None, label: str = "label", *,
              regress: bool = False, dev_fraction: float = 0.0, kind: str | None = None,
              labels=None) -> TaskData:
    """A task from the user's files. The label space comes from `train` (or is given as kind + labels, for a
    model that already has one); dev labels must be among the training labels."""
    data = TaskData("classify" if not regress else "regress", "", [], ())
    if train is not None:
        data.train = read_examples(train, text, pair, label)
        data.kind, data.labels = label_space(data.train, train, force_regress=regress)
    else:
        data.kind, data.labels = kind, list(labels or [])
    data.metrics = ("pearson", "spearman") if data.kind == "regress" else \
        (("accuracy", "f1") if len(data.labels) == 2 else ("accuracy",))
    if dev is not None:
        data.dev = {"": read_examples(dev, text, pair, label)}
    elif dev_fraction and data.train:
        data.train, held = holdout(data.train, dev_fraction)
        data.dev = {"": held}
        data.notes.append(f"no dev file: the last {len(held)} examples of {train} ({dev_fraction:.0%}) are the dev set")
    for examples in data.dev.values():
        check_labels(examples, data.kind, data.labels)
    return data


def holdout(examples: list, fraction: float) -> tuple[list, list]:
    """(first 1 - fraction, last fraction) of a list, each part at least one item.

    Example: 10 items, 0.1 -> the first 9 and the last 1."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"dev fraction {fraction} must be between 0 and 1")
    n = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    if n < 1:
        raise ValueError(f"cannot hold out a dev set from {len(examples)} example(s)")
    return examples[:-n], examples[-n:]


def first(examples: list, limit: int, notes: list, what: str = "training examples") -> list:
    """The first `limit` examples (0: all), with a note when some are left out (HF's max_train_samples).

    Example: 10 items, limit 4 -> the first 4, and the note "trained on the first 4 of 10 training examples"."""
    if limit and len(examples) > limit:
        notes.append(f"trained on the first {limit} of {len(examples)} {what}")
        return examples[:limit]
    return examples


def write_submission(path, examples: list[Example], predictions: list) -> Path:
    """A GLUE submission file: "index<TAB>prediction" per test example (labels as names, STS-B as numbers)."""
    lines = ["index\tprediction"] + [f"{e.index}\t{p:.3f}" if isinstance(p, float) else f"{e.index}\t{p}"
                                     for e, p in zip(examples, predictions, strict=True)]
    return write_text(path, "\n".join(lines) + "\n")


def load_task(task: str, data=None, train=None, dev=None, *, text: str = "text", pair: str | None = None,
              label: str = "label", splits=("train", "dev"), dev_fraction: float = 0.0, kind: str | None = None,
              labels=None) -> TaskData:
    """A GLUE task from its folder (`data`), or "classify" / "regress" from the user's `train` / `dev` files
    with the named columns. kind + labels: the label space of an already fine-tuned model (no train file)."""
    if task.lower() in USER_TASKS:
        if data is not None:
            raise ValueError(f"task {task!r} reads --train / --dev files with named columns, not a GLUE folder")
        if train is None and dev is None:
            raise ValueError(f"task {task!r} needs a --train file (and a --dev file or a dev fraction)")
        return load_user(train if "train" in splits else None, dev, text, pair, label, regress=task.lower() == "regress",
                         dev_fraction=dev_fraction, kind=kind, labels=labels)
    glue_task(task)
    if data is None:
        raise ValueError(f"GLUE task {task!r} needs its data folder (--data glue/{glue_task(task).folder})")
    return load_glue(task, data, splits, dev_fraction)


# --- CoNLL-2003: a label per word -------------------------------------------------------------------------

SCHEMES = ("IOB1", "IOB2", "IOBES")


@dataclass
class Sentence:
    """The words of one sentence with their tags (None: untagged), its document number and first line."""
    words: list
    tags: list | None
    doc: int = 0
    where: str = ""


def read_conll(path) -> list[Sentence]:
    """Sentences of a CoNLL column file: a word per line, its tag in the last column (CoNLL-2003: word POS chunk
    NER), a blank line after each sentence, "-DOCSTART-" lines between documents. Every line must have the
    number of columns of the first (ValueError naming the file and line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    out, words, tags, doc, first, n_cols = [], [], [], 0, 0, None

    def flush():
        if words:
            out.append(Sentence(list(words), list(tags), doc, f"{path}:{first}"))
        words.clear()
        tags.clear()

    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            cols = line.split()
            if not cols:
                flush()
                continue
            if cols[0] == "-DOCSTART-":
                flush()
                doc += 1
                continue
            n_cols = n_cols or len(cols)
            if len(cols) != n_cols or n_cols < 2:
                raise ValueError(f"{path} line {n}: {len(cols)} columns, expected {n_cols} (a word, ..., its tag)"
                                 if n_cols >= 2 else f"{path} line {n}: a word without a tag column")
            if not words:
                first = n
            words.append(cols[0])
            tags.append(cols[-1])
    flush()
    if not out:
        raise ValueError(f"{path}: no sentences")
    return out


def tag_scheme(sentences: list[Sentence], path="") -> str:
    """IOBES when E- / S- tags occur, IOB1 when a chunk starts with I- (after O or at the start of a sentence),
    else IOB2; a tag that is not O nor B- / I- / E- / S-<type> is an error.

    Example: [O, I-PER, I-PER] -> IOB1; [B-PER, I-PER, O] -> IOB2; [S-PER, O] -> IOBES."""
    prefixes, i_start = set(), False
    for s in sentences:
        prev = "O"
        for t in s.tags:
            if t != "O" and (t[:2] not in ("B-", "I-", "E-", "S-") or len(t) < 3):
                raise ValueError(f"{s.where}: tag {t!r} is not O or B-/I-/E-/S-<type>: unknown tag scheme")
            prefixes.add(t[0])
            i_start |= t[0] == "I" and (prev == "O" or prev[2:] != t[2:])
            prev = t
    if prefixes & {"E", "S"}:
        return "IOBES"
    return "IOB1" if i_start else "IOB2"


# --- SQuAD: a span of the context ----------------------------------------------------------------------

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
