"""Multiple choice for BERT (SWAG-style, BERT section 4.4): a context and N endings, one of them right. Read top
to bottom: the reader, the features, the objective, prediction, scores.

    score_i = w . dropout(tanh(W_pool C_i) + b)    C_i: the [CLS] state of "[CLS] context [SEP] ending_i [SEP]"
    P(i) = softmax over the N endings,  L = CE(scores, label)

Data: a .csv / .tsv / .jsonl file with the columns context, ending0, ..., ending<N-1> (N >= 2, the same N for
every row) and label (the number of the right ending; absent in unlabelled data).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from duolm.metrics import accuracy
from duolm.models.heads import HeadConfig
from duolm.objectives import Objective
from duolm.tasks.base import MAX_LENGTH, Data, Files, PredictInputs, column, holdout, pad, read_rows, run_model
from duolm.tokenizers import WordPiece

ENDING = re.compile(r"ending(\d+)$")


# --- the reader -------------------------------------------------------------------------------------------

@dataclass
class Choice:
    """A context, its endings, the number of the right one (None: unlabelled) and where it came from."""
    context: str
    endings: list
    label: int | None = None
    where: str = ""


def read_choices(path) -> list[Choice]:
    """The rows of a multiple-choice file (see the module doc); a label that is not the number of an ending is an
    error naming the file and line."""
    header, rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no examples")
    column(path, header, "context", "context")
    endings = sorted((int(m.group(1)), h) for h in header if (m := ENDING.match(str(h))))
    if len(endings) < 2 or [n for n, _ in endings] != list(range(len(endings))):
        raise ValueError(f"{path}: expected the columns ending0, ending1, ... (two or more); the columns are: "
                         f"{', '.join(map(str, header))}")
    column(path, header, "label", "label")
    out = []
    for line, row in rows:
        label = str(row.get("label")).strip()
        if label not in {str(n) for n, _ in endings}:
            raise ValueError(f"{path} line {line}: label {row.get('label')!r} is not the number of an ending "
                             f"(0 to {len(endings) - 1})")
        texts = [row.get(h) for _, h in endings]
        if row.get("context") is None or any(t is None for t in texts):
            raise ValueError(f"{path} line {line}: a context and {len(endings)} endings are needed")
        out.append(Choice(str(row["context"]), [str(t) for t in texts], int(label), f"{path}:{line}"))
    return out


def read(name: str, files: Files, splits, options, head: HeadConfig | None = None) -> Data:
    """--train and --dev files (or the last dev_fraction of --train as the dev set)."""
    train_file = files.train or files.data
    need_train = "train" in splits or (files.dev is None and options.dev_fraction)
    if need_train and train_file is None:
        raise ValueError(f"task {name!r} needs a training file (--train)")
    train = read_choices(train_file) if need_train else []
    dev = read_choices(files.dev) if files.dev else []
    notes = []
    if not files.dev and options.dev_fraction:
        train, dev = holdout(train, options.dev_fraction)
        notes.append(f"the last {len(dev)} examples of {train_file} are the dev set")
    if "dev" in splits and not dev:
        raise ValueError(f"task {name!r} has no dev set: give a dev file or a dev fraction")
    return Data(name.lower(), "choice", [], ("accuracy",), train, {"": dev}, notes=notes)


# --- features ---------------------------------------------------------------------------------------------

@dataclass
class ChoiceFeatures:
    """ids[i][j], segment_ids[i][j]: "[CLS] context [SEP] ending_j [SEP]" of example i; labels (None: unlabelled);
    cut: the examples with an input cut to max_length."""
    ids: list
    segment_ids: list
    labels: list | None
    pad_id: int
    cut: list = field(default_factory=list)

    def __len__(self):
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.array([max(len(x) for x in r) for r in self.ids], dtype=np.int64)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """idx, segment_ids, attention_mask (B, N, T) padded to the longest input; labels (B,)."""
        n = {len(self.ids[r]) for r in rows}
        if len(n) != 1:
            raise ValueError(f"examples with different numbers of endings ({sorted(n)}) cannot share a batch")
        N = n.pop()
        idx, mask = pad([x for r in rows for x in self.ids[r]], self.pad_id)
        seg = pad([x for r in rows for x in self.segment_ids[r]], 0)[0]
        batch = {"idx": idx.view(len(rows), N, -1), "segment_ids": seg.view(len(rows), N, -1),
                 "attention_mask": mask.view(len(rows), N, -1)}
        if self.labels is not None:
            batch["labels"] = torch.tensor([self.labels[r] for r in rows])
        return batch


def encode(choices, tokenizer, head: HeadConfig, options=None) -> ChoiceFeatures:
    """Each ending after its context, as a BERT pair cut to head.max_length (the longer text first)."""
    if not isinstance(tokenizer, WordPiece):
        raise ValueError("multiple choice reads [CLS] context [SEP] ending [SEP]: it needs a WordPiece vocabulary")
    out = ChoiceFeatures([], [], [] if choices and all(c.label is not None for c in choices) else None,
                         tokenizer.pad_id)
    for i, c in enumerate(choices):
        encs = [tokenizer.encode_with_offsets(c.context, e) for e in c.endings]
        if any(len(e.ids) > head.max_length for e in encs):
            encs = [tokenizer.encode_with_offsets(c.context, e, max_length=head.max_length) for e in c.endings]
            out.cut.append(i)
        out.ids.append([e.ids for e in encs])
        out.segment_ids.append([e.segment_ids for e in encs])
        if out.labels is not None:
            out.labels.append(c.label)
    return out


# --- the objective ----------------------------------------------------------------------------------------

def choice_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of the endings' scores (B, N) against the right ending (B,); metrics loss, accuracy."""
    n = max((norm or {"n": logits.shape[0]})["n"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float(), labels, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def objective(family: str, head: HeadConfig, lm_coef: float = 0.0) -> Objective:
    return Objective(forward=lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), loss=choice_loss,
                     counts=lambda b: {"n": int(b["labels"].shape[0])}, tokens=lambda b: b["idx"].numel())


# --- prediction and scores --------------------------------------------------------------------------------

def choice_logits(model, features: ChoiceFeatures, batch_size: int = 64) -> list[torch.Tensor]:
    """The endings' scores (N,) of every example, in order."""
    return run_model(lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), model, features, batch_size)


def score(model, tokenizer, choices, features=None, batch_size: int = 64) -> dict[str, float]:
    """Accuracy (the right ending scored highest) and the mean loss."""
    features = features or encode(choices, tokenizer, model.head)
    logits = torch.stack(choice_logits(model, features, batch_size))
    gold = features.labels
    return {"accuracy": accuracy(logits.argmax(-1).tolist(), gold),
            "loss": F.cross_entropy(logits, torch.tensor(gold)).item()}


def predict(model, tokenizer, inputs, batch_size: int = 64) -> list[dict]:
    """(context, [ending, ...]) pairs -> {"label": the number of the best ending, "probabilities": [p per ending]};
    "truncated": True marks an input cut to the model's max_length."""
    choices = []
    for i, x in enumerate(inputs):
        if not isinstance(x, (tuple, list)) or len(x) != 2 or isinstance(x[1], str) or len(x[1]) < 2:
            raise ValueError(f"input {i}: multiple choice takes (context, [ending, ending, ...]) with 2+ endings")
        choices.append(Choice(str(x[0]), [str(e) for e in x[1]]))
    feats = encode(choices, tokenizer, model.head)
    out = []
    for p in (lg.softmax(-1) for lg in choice_logits(model, feats, batch_size)):
        out.append({"label": int(p.argmax()), "probabilities": p.tolist()})
    for i in feats.cut:
        out[i]["truncated"] = True
    return out


def make_head(data: Data, family: str, options, block_size: int) -> HeadConfig:
    if family != "bert":
        raise ValueError(f"task {data.name!r} scores [CLS] states: it needs a BERT model")
    return HeadConfig("choice", [], data.name, min(options.max_length or MAX_LENGTH, block_size))


def parse(given: PredictInputs) -> list[tuple[str, list[str]]]:
    """One (context, [ending, ...]): given.texts, a context and two or more endings."""
    if len(given.texts) < 3:
        raise ValueError("multiple choice takes a context and two or more endings: CONTEXT ENDING ENDING ...")
    return [(given.texts[0], given.texts[1:])]


def line(choice: tuple[str, list[str]], prediction: dict) -> str:
    """The best ending, its number and probability."""
    best = prediction["label"]
    return f"{choice[1][best]}\t{best}\t{prediction['probabilities'][best]:.4f}"


# This module is a duolm.tasks.base.Task: the functions above and what follows (tasks/__init__ checks it).
kinds: tuple[str, ...] = ("choice",)
names: tuple[str, ...] = ("multiple-choice", "swag")
unit = "training examples"
percent: tuple[str, ...] = ()
route: str | None = None
head = make_head
trained = list
