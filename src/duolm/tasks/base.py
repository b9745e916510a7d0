"""What every downstream task shares: the typed `Task` each task module is, the data it reads (`Data`), the
options of its inputs (`TaskOptions`), its encoded examples (`Features`), what a user gives `duolm predict`
(`PredictInputs`), the table reader for the user's files, and the batching of encoded
examples for training (`TaskBatches`) and for prediction (`run_model`).

`TaskBatches` serves training batches as a pure function of (seed, step), like the pretraining batch
sources, so a resumed run sees exactly the batches it would have seen: each epoch is a fresh
permutation, cut into chunks of 50 batches; each chunk is sorted by length and cut into batches of
similar lengths, and the batches of the epoch are served in random order. Padding goes to the longest
row of a batch only (dynamic padding), so compute is spent on tokens; it never changes a result.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from duolm.config import opt
from duolm.data.causal import generator, rank_rows
from duolm.models.heads import MAX_LENGTH, SPAN_MAX_LENGTH, HeadConfig, HeadModel
from duolm.objectives import Objective
from duolm.tokenizers import Tokenizer

csv.field_size_limit(sys.maxsize)         # long passages (RTE, QNLI) are one field

MAX_QUERY = 64           # SQuAD question pieces at most (run_squad.py)
STRIDE = 128             # SQuAD: pieces between the starts of a long context's windows (run_squad.py)
GROUP = 50               # batches per length-sorted chunk (as transformers' LengthGroupedSampler)


@dataclass
class TaskOptions:
    """How a task's inputs are made and split; the CLI's flags are these fields. max_length None: the task's
    own default (MAX_LENGTH; SQuAD SPAN_MAX_LENGTH)."""
    max_length: int | None = opt(None, f"tokens per input at most ({MAX_LENGTH}; SQuAD {SPAN_MAX_LENGTH}); longer "
                                       f"inputs are cut, and counted")
    both_orders: bool = opt(False, "GPT sentence pairs: also feed B<d>A and sum the two states (GPT-1 similarity)")
    context: str = opt("sentence", "NER: each sentence alone, or with its document around it (BERT)",
                       choices=("sentence", "document"))
    stride: int | None = opt(None, f"pieces between the starts of a long text's windows (SQuAD's contexts: {STRIDE}; "
                                   f"NER's sentences or documents: half the window)")
    dev_fraction: float = opt(0.0, "without a dev file, hold out this last share of train (SQuAD: of its articles)")
    max_train_examples: int = opt(0, "train on the first N training examples only (NER: sentences, SQuAD: "
                                     "questions; 0: all)")

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride={self.stride} must be >= 1")
        if self.max_train_examples < 0:
            raise ValueError(f"max_train_examples={self.max_train_examples} must be >= 0 (0: all)")


@dataclass
class Files:
    """Where a task's data is: a task folder (GLUE, CoNLL-2003) or the user's train / dev files, and the columns
    of the user's table files."""
    data: str | Path | None = None
    train: str | Path | None = None
    dev: str | Path | None = None
    text_column: str = "text"
    pair_column: str | None = None
    label_column: str = "label"


@dataclass
class Data:
    """A task's data: examples per split, the label space, the metrics (the first selects).

    dev: {metric prefix: examples} ("" for the one dev set; MNLI adds "mm_" for mismatched);
    test: {submission file name: examples} (GLUE test files, unlabelled); notes: what was done to the data."""
    name: str
    kind: str
    labels: list
    metrics: tuple
    train: list = field(default_factory=list)
    dev: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


class Features(Protocol):
    """A task's encoded examples: len(), each example's length in tokens, a padded batch of any rows, and `cut`,
    the examples that were cut to max_length."""
    cut: list[int]

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray: ...

    def collate(self, rows: Sequence[int]) -> dict[str, torch.Tensor]: ...


@dataclass
class PredictInputs:
    """What a user hands `duolm predict`, each task taking what its inputs need (Task.parse): texts on the
    command line (with `pairs`: two at a time), a file of one input per line, questions and a context file."""
    texts: list[str] = field(default_factory=list)
    file: str | Path | None = None
    pairs: bool = False
    questions: list[str] = field(default_factory=list)
    context: str | Path | None = None


class Task(Protocol):
    """A family of downstream tasks, read like a paper's appendix: each module of duolm.tasks is one, its
    functions these methods. Its attributes: kinds (the head kinds it trains), names (the task names it reads),
    unit (what a training example is, for notes), percent (the metrics the official scripts give x 100), route
    (the server's route that answers its predictions, None: none)."""
    kinds: tuple[str, ...]
    names: tuple[str, ...]
    unit: str
    percent: tuple[str, ...]
    route: str | None

    def read(self, name: str, files: Files, splits: Sequence[str], options: TaskOptions,
             head: HeadConfig | None = None, /) -> Data:
        """The reader; head: a trained model's, whose label space the data must match (None when training)."""
        ...

    def head(self, data: Data, family: str, options: TaskOptions, block_size: int, /) -> HeadConfig:
        """What the fine-tuned head predicts."""
        ...

    def encode(self, items: list, tokenizer: Tokenizer, head: HeadConfig, options: TaskOptions | None = None, /
               ) -> Features:
        """The items' model inputs, cut to head.max_length."""
        ...

    def objective(self, family: str, head: HeadConfig, lm_coef: float, /) -> Objective:
        """The loss of a `family` model with this head (GPT: + lm_coef x the LM loss where the task has it)."""
        ...

    def predict(self, model: HeadModel, tokenizer: Tokenizer, inputs: list, batch_size: int = 64, /
                ) -> list[dict[str, Any]]:
        """A prediction per input, a JSON object ("truncated": True marks an input cut to max_length)."""
        ...

    def score(self, model: HeadModel, tokenizer: Tokenizer, items: list, features: Features | None = None,
              batch_size: int = 64, /) -> dict[str, Any]:
        """The official metrics (features may be None: encoded here)."""
        ...

    def trained(self, items: list, /) -> list:
        """The items that are trained on."""
        ...

    def parse(self, given: PredictInputs, /) -> list:
        """The inputs of predict() in what a user gave `duolm predict` (a ValueError when it does not fit)."""
        ...

    def line(self, given: Any, prediction: dict[str, Any], /) -> str:
        """One input and its prediction as the line `duolm predict` prints."""
        ...


def parse_texts(given: PredictInputs, who: str) -> list[str]:
    """Texts: the lines of given.file, or given.texts; pairs are refused ("<who> takes texts, not pairs")."""
    if given.pairs:
        raise ValueError(f"{who} takes texts, not pairs")
    if given.file:
        return [line for line in Path(given.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    return list(given.texts)


# --- the user's table files ------------------------------------------------------------------------------

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


def column(path, header, name, what):
    """`name` when the file has that column, else a ValueError listing the columns it has."""
    if name not in header:
        raise ValueError(f"{path}: no {what} column {name!r}; the columns are: {', '.join(map(str, header)) or 'none'}")
    return name


def holdout(examples: list, fraction: float) -> tuple[list, list]:
    """(first 1 - fraction, last fraction) of a list, each part at least one item.

    Example: 10 items, 0.1 -> the first 9 and the last 1."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"dev fraction {fraction} must be between 0 and 1")
    n = min(len(examples) - 1, max(1, round(len(examples) * fraction)))
    if n < 1:
        raise ValueError(f"cannot hold out a dev set from {len(examples)} example(s)")
    return examples[:-n], examples[-n:]


def check_varied(scores: list, where: str | Path) -> None:
    """A ValueError, before any training, when every gold score of a dev set is the same: a correlation divides by
    the scores' spread, so Spearman's and Pearson's with a constant are undefined (nan) and select nothing.
    [2.5, 2.5, 2.5] from dev.tsv -> "dev.tsv: the 3 dev scores are all 2.5: a constant dev score has no rank ...";
    [2.5, 3.0] passes."""
    if scores and min(scores) == max(scores):
        raise ValueError(f"{where}: the {len(scores)} dev scores are all {scores[0]:g}: a constant dev score has no "
                         f"rank correlation (Spearman's is undefined); give a dev set of different scores")


def first(examples: list, limit: int, notes: list, what: str = "training examples") -> list:
    """The first `limit` examples (0: all), with a note when some are left out (HF's max_train_samples).

    Example: 10 items, limit 4 -> the first 4, and the note "trained on the first 4 of 10 training examples"."""
    if limit and len(examples) > limit:
        notes.append(f"trained on the first {limit} of {len(examples)} {what}")
        return examples[:limit]
    return examples


# --- batches ---------------------------------------------------------------------------------------------

class TokenRows:
    """len() and lengths() of features whose ids[i] is one input's token ids (tagging, span windows)."""
    ids: list[list[int]]

    def __len__(self):
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self.ids], dtype=np.int64)


def pad(seqs: Sequence[Sequence[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids right-padded with `value` to the longest -> (ids (B, T), mask (B, T): 1 = real, 0 = padding)."""
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, :len(x)] = torch.tensor(x)
        mask[b, :len(x)] = 1
    return ids, mask


# --- windows over a long text (SQuAD's contexts, NER's documents) ---------------------------------------

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


class TaskBatches:
    """Length-grouped training batches, a pure function of (seed, step) (see the module doc), of any features
    with len(), lengths() and collate(rows) (see Task.encode).

    An epoch is len(features) // batch_size steps (the remainder, different each epoch, waits for the next)."""

    def __init__(self, features, seed: int = 0):
        if len(features) == 0:
            raise ValueError("no training examples")
        self.features, self.seed = features, seed
        self._lengths = features.lengths()
        self._epoch: tuple[int, int, list] | None = None

    def steps_per_epoch(self, batch_size: int) -> int:
        n = len(self.features) // batch_size
        if n == 0:
            raise ValueError(f"{len(self.features)} training examples do not fill one batch of {batch_size}")
        return n

    def epoch_batches(self, epoch: int, batch_size: int) -> list[np.ndarray]:
        """The rows of every batch of `epoch`, in serving order."""
        if self._epoch is None or self._epoch[:2] != (epoch, batch_size):
            n = self.steps_per_epoch(batch_size) * batch_size
            perm = torch.randperm(len(self.features), generator=generator(self.seed, 5, epoch)).numpy()[:n]
            batches = []
            for c in range(0, n, GROUP * batch_size):
                chunk = perm[c:c + GROUP * batch_size]
                chunk = chunk[np.argsort(-self._lengths[chunk], kind="stable")]
                batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
            order = torch.randperm(len(batches), generator=generator(self.seed, 6, epoch)).tolist()
            self._epoch = (epoch, batch_size, [batches[i] for i in order])
        return self._epoch[2]

    def batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """This rank's rows of the global batch at `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        per_epoch = self.steps_per_epoch(batch_size)
        rows = self.epoch_batches(step // per_epoch, batch_size)[step % per_epoch]
        return self.features.collate(rows[rank_rows(batch_size, rank, world_size)].tolist())


def eval_batches(features, batch_size: int, rank: int = 0, world_size: int = 1
                 ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """Every example once, longest first (little padding), as (example numbers, batch); each rank gets its
    share of each batch (ranks may get unequal rows in the last one)."""
    order = np.argsort(-features.lengths(), kind="stable")
    for b in range(0, len(order), batch_size):
        mine = np.array_split(order[b:b + batch_size], world_size)[rank].tolist()
        if mine:
            yield mine, features.collate(mine)


@torch.no_grad()
def run_model(forward: Callable, model, features, batch_size: int = 64) -> list[torch.Tensor]:
    """forward(model, batch) -> outputs (B, ...) for every row of `features`, in order: float32 CPU tensors, each
    row's cut to its length when the outputs have a token axis (its length given by features.lengths()). The model
    is in eval mode meanwhile, in the precision its linears run in (duolm.precision.quantize; fp32 as it is in a
    run's validation)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    lengths = features.lengths()
    out: list = [None] * len(features)
    for index, batch in eval_batches(features, batch_size):
        logits = forward(model, {k: v.to(device, non_blocking=True) for k, v in batch.items()}).float().cpu()
        for row, i in enumerate(index):
            out[i] = logits[row, :lengths[i]] if logits.dim() > 2 else logits[row]
    model.train(was_training)
    return out
