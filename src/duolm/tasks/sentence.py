"""Sentence and sentence-pair tasks: the nine GLUE tasks and the user's labelled texts, classification or
regression, for BERT and GPT. Read top to bottom: the readers, the features, the objective, prediction, scores.

    L = CE(logits, label)                          classification (BERT section 4.1)
    L = (logit - y)^2                              regression (STS-B)
    L = L_task + lambda L_LM                       GPT-1 section 3.3: the LM loss on the same inputs helps
                                                   generalisation and convergence (lambda 0.5)

GLUE: the tasks' table is duolm.tasks.glue; their files are read here, and the submission files written.
The examples in GLUE's and the user's files, and the label space they imply: duolm.tasks.examples.

Inputs: BERT reads "[CLS] A [SEP] B [SEP]" with segment ids 0 / 1, through the WordPiece tokenizer's pair
encoding; too long pairs lose tokens from the longer text first (HF's "longest_first"). GPT reads
"A <|endoftext|> B" (the end-of-text token is the delimiter), optionally also "B <|endoftext|> A" (GPT-1 fed
similarity pairs in both orders); special tokens typed in the texts stay plain text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from duolm.fileio import write_text
from duolm.metrics import SEQUENCE_METRICS
from duolm.models.heads import HeadConfig
from duolm.objectives import IGNORE, Objective, causal_lm_loss
from duolm.tasks.base import MAX_LENGTH, Data, Files, PredictInputs, check_varied, holdout, pad, run_model
from duolm.tasks.examples import Example, check_labels, label_space, read_examples
from duolm.tasks.glue import GLUE, USER_TASKS, glue_task
from duolm.tokenizers import ByteLevelBPE, WordPiece

# --- readers ---------------------------------------------------------------------------------------------

def load_glue(name: str, data_dir, splits=("train", "dev", "test"), dev_fraction: float = 0.0,
              dev_file=None) -> Data:
    """A GLUE task from its standard folder. Without dev files, `dev_fraction` > 0 holds out the LAST share
    of train.tsv as the dev set (the notes say so); test files are read when present. dev_file: a file in the
    task's format, the dev set instead of the folder's (data_dir None: only the dev set is read)."""
    task, scored_alone = glue_task(name), dev_file is not None and set(splits) == {"dev"}
    if data_dir is None and not scored_alone:
        raise ValueError(f"GLUE task {name!r} needs its data folder (--data glue/{task.folder})"
                         + (", or a --dev file to score" if set(splits) == {"dev"} else ""))
    data_dir = Path(data_dir or "")
    if not scored_alone and not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such folder (expected the GLUE {task.folder} folder with train.tsv)")

    def read(file, labelled=True):
        headerless = task.columns is not None and labelled
        return read_examples(file, task.text_a, task.text_b, task.label if labelled else None,
                             columns=task.columns if headerless else None, index=None if labelled else task.index)

    data = Data(task.name, task.kind, list(task.labels or []), task.metrics)
    if "train" in splits or ("dev" in splits and dev_fraction and dev_file is None):
        data.train = read(data_dir / "train.tsv")
        check_labels(data.train, task.kind, data.labels)
    if "dev" in splits:
        if dev_file is not None:
            data.dev = {"": read(dev_file)}
        elif present := [(p, f) for p, f in task.dev if (data_dir / f).is_file()]:
            data.dev = {p: read(data_dir / f) for p, f in present}
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
        data.test = {sub: read(data_dir / f, labelled=False) for sub, f in task.test if (data_dir / f).is_file()}
    return data


def user_metrics(kind: str, labels: list) -> tuple:
    """The metrics of the user's task (the first selects): Pearson + Spearman for a regression, accuracy (+ F1 of
    the second label with two classes)."""
    return ("pearson", "spearman") if kind == "regress" else (("accuracy", "f1") if len(labels) == 2 else ("accuracy",))


def load_user(train=None, dev=None, text: str = "text", pair: str | None = None, label: str = "label", *,
              regress: bool = False, dev_fraction: float = 0.0, kind: str | None = None, labels=None) -> Data:
    """A task from the user's files. The label space comes from `train` (or is given as kind + labels, for a
    model that already has one); dev labels must be among the training labels."""
    data = Data("classify" if not regress else "regress", "", [], ())
    if train is not None:
        data.train = read_examples(train, text, pair, label)
        data.kind, data.labels = label_space(data.train, train, force_regress=regress)
    else:
        data.kind, data.labels = kind or data.kind, list(labels or [])
    data.metrics = user_metrics(data.kind, data.labels)
    if dev is not None:
        data.dev = {"": read_examples(dev, text, pair, label)}
    elif dev_fraction and data.train:
        data.train, held = holdout(data.train, dev_fraction)
        data.dev = {"": held}
        data.notes.append(f"no dev file: the last {len(held)} examples of {train} ({dev_fraction:.0%}) are the dev set")
    for examples in data.dev.values():
        check_labels(examples, data.kind, data.labels)
    return data


def write_submission(path, examples: list[Example], predictions: list) -> Path:
    """A GLUE submission file: "index<TAB>prediction" per test example (labels as names, STS-B as numbers)."""
    lines = ["index\tprediction"] + [f"{e.index}\t{p:.3f}" if isinstance(p, float) else f"{e.index}\t{p}"
                                     for e, p in zip(examples, predictions, strict=True)]
    return write_text(path, "\n".join(lines) + "\n")


# --- features ---------------------------------------------------------------------------------------------

@dataclass
class SentenceFeatures:
    """Encoded examples. ids[i]: the token ids of example i (GPT both orders: a pair of id lists);
    segment_ids: BERT's (None: GPT's inputs); labels: class ids or numbers (None: unlabelled); cut: the examples
    that were truncated to max_length."""
    ids: list
    segment_ids: list | None
    labels: list | None
    pad_id: int
    cut: list = field(default_factory=list)

    @property
    def truncated(self) -> int:
        return len(self.cut)

    def __len__(self):
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.array([max(len(x) for x in r) if isinstance(r, tuple) else len(r) for r in self.ids], dtype=np.int64)

    def collate(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows padded to their longest (right padding).

        BERT: idx, segment_ids, attention_mask (B, T). GPT: idx (B, T) or (B, 2, T) for both orders, last (B,)
        or (B, 2) the position of each last real token, y the next-token targets (IGNORE past the end) for the
        auxiliary LM loss. labels (B,): long class ids or float numbers, when the features have labels."""
        seqs = [self.ids[i] for i in rows]
        S = 2 if seqs and isinstance(seqs[0], tuple) else 1
        flat = [s for r in seqs for s in (r if S == 2 else (r,))]
        idx, real = pad(flat, self.pad_id)
        T = idx.shape[1]
        if self.segment_ids is not None:          # BERT
            batch = {"idx": idx, "segment_ids": pad([self.segment_ids[r] for r in rows], 0)[0], "attention_mask": real}
        else:
            n = real.sum(1)
            y = torch.where(real[:, 1:].bool(), idx[:, 1:], IGNORE)
            y = torch.cat([y, torch.full((len(flat), 1), IGNORE)], 1)
            shape = (len(seqs), 2) if S == 2 else (len(seqs),)
            batch = {"idx": idx.view(*shape, T), "last": (n - 1).view(shape), "y": y.view(*shape, T)}
        if self.labels is not None:
            lab = [self.labels[i] for i in rows]
            batch["labels"] = torch.tensor(lab, dtype=torch.float32 if isinstance(lab[0], float) else torch.long)
        return batch


def truncate_pair(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
    """Lengths of A and B cut to n_a + n_b <= budget as HF's "longest_first" (and duolm's WordPiece) does:
    the longer text is cut down to what the shorter leaves, and when both are over half, each gets half
    (the longer one the odd token).

    Example: (10, 4, 8) -> (4, 4); (7, 6, 9) -> (5, 4); (3, 9, 8) -> (3, 5); (9, 0, 5) -> (5, 0)."""
    if budget < 1:
        raise ValueError(f"max_length leaves no room for the text (budget {budget})")
    if n_a + n_b <= budget:
        return n_a, n_b
    short, long = min(n_a, n_b), max(n_a, n_b)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    return (long, short) if n_a > n_b else (short, long)


def encode_examples(examples: Sequence[Example], tokenizer, max_length: int, labels: list | None = None,
                    kind: str = "classify", both_orders: bool = False) -> SentenceFeatures:
    """Token ids of each example (see the module doc), cut to `max_length`; labels -> ids (classify: the
    position of the label name in `labels`; regress: the number; unlabelled examples: no labels)."""
    if isinstance(tokenizer, WordPiece):
        ids, segs, cut = _encode_bert(examples, tokenizer, max_length)
        pad_id = tokenizer.pad_id
    elif isinstance(tokenizer, ByteLevelBPE):
        if tokenizer.eot_id is None:
            raise ValueError("the GPT tokenizer has no <|endoftext|> token to delimit sentence pairs")
        ids, cut = _encode_gpt(examples, tokenizer, tokenizer.eot_id, max_length, both_orders)
        segs, pad_id = None, tokenizer.eot_id
    else:
        raise ValueError(f"cannot encode with a {type(tokenizer).__name__}; expected WordPiece or ByteLevelBPE")
    y = None
    if examples and all(e.label is not None for e in examples):
        golds: list = [e.label for e in examples]
        if kind == "regress":
            y = [float(g) for g in golds]
        else:
            index = {name: i for i, name in enumerate(labels or [])}
            y = [index[g] for g in golds]
    return SentenceFeatures(ids, segs, y, pad_id, cut)


def _encode_bert(examples, tok: WordPiece, max_length: int):
    ids, segs, cut = [], [], []
    for i, e in enumerate(examples):
        enc = tok.encode_with_offsets(e.text_a, e.text_b)
        if len(enc.ids) > max_length:
            enc = tok.encode_with_offsets(e.text_a, e.text_b, max_length=max_length)
            cut.append(i)
        ids.append(enc.ids)
        segs.append(enc.segment_ids)
    return ids, segs, cut


def _encode_gpt(examples, tok: ByteLevelBPE, eot: int, max_length: int, both_orders: bool):
    out: list = []
    cut = []
    for i, e in enumerate(examples):
        a = tok.encode_ordinary(e.text_a)
        b = tok.encode_ordinary(e.text_b) if e.text_b is not None else None
        n_a, n_b = truncate_pair(len(a), len(b or ()), max_length - (b is not None))
        if (n_a, n_b) != (len(a), len(b or ())):
            cut.append(i)
        if b is None:
            out.append(a[:n_a] or [eot])              # an empty text is the end-of-text token alone
        elif both_orders:
            out.append((a[:n_a] + [eot] + b[:n_b], b[:n_b] + [eot] + a[:n_a]))
        else:
            out.append(a[:n_a] + [eot] + b[:n_b])
    return out, cut


# --- the objective ----------------------------------------------------------------------------------------
# As in duolm.objectives, each loss is a sum divided by the step's count (norm["n"] inputs, norm["lm"] predicted
# tokens), so micro-batches add up to the loss of the whole batch.

def sequence_counts(batch: dict) -> dict[str, int]:
    counts = {"n": int(batch["labels"].shape[0])}
    if "y" in batch:
        counts["lm"] = int((batch["y"] != IGNORE).sum())
    return counts


def classify_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of logits (B, n_labels) against batch["labels"] (B,) class ids; metrics loss, accuracy."""
    n = max((norm or sequence_counts(batch))["n"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float(), labels, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def regress_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Squared error of logits (B, 1) against batch["labels"] (B,) floats; metric loss (the mean)."""
    n = max((norm or sequence_counts(batch))["n"], 1)
    loss = F.mse_loss(logits.float().squeeze(-1), batch["labels"].float(), reduction="sum") / n
    return loss, {"loss": loss.detach()}


def with_lm_loss(task_loss, lm_coef: float):
    """GPT-1's L_task + lm_coef * L_LM over GPT's outputs (logits, lm_logits); metrics add task_loss and lm_loss.
    lm_coef 0: the task loss alone."""
    def loss(outputs, batch: dict, norm: dict | None = None):
        logits, lm_logits = outputs
        norm = norm or sequence_counts(batch)
        task, metrics = task_loss(logits, batch, norm)
        if not lm_coef:
            return task, metrics
        lm, _ = causal_lm_loss(lm_logits, batch, norm)
        total = task + lm_coef * lm
        return total, {**metrics, "task_loss": task.detach(), "lm_loss": lm.detach(), "loss": total.detach()}
    return loss


def sequence_objective(family: str, kind: str, lm_coef: float = 0.0) -> Objective:
    """The objective of a sentence (pair) task: BERT's classifier / regressor, or GPT's with lm_coef * L_LM."""
    if kind not in ("classify", "regress"):
        raise ValueError(f"a sentence task is classify or regress, not {kind!r}")
    task_loss = classify_loss if kind == "classify" else regress_loss
    tokens = lambda b: b["idx"].numel()                                          # noqa: E731
    if family == "bert":
        return Objective(forward=lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), loss=task_loss,
                         counts=sequence_counts, tokens=tokens)
    return Objective(forward=lambda m, b: m(b["idx"], b["last"]), loss=with_lm_loss(task_loss, lm_coef),
                     counts=sequence_counts if lm_coef else (lambda b: {"n": int(b["labels"].shape[0])}),
                     tokens=tokens)


# --- prediction and scores --------------------------------------------------------------------------------

def _classify(model, b):
    """The head's outputs (B, n_out) of a batch: BERT's sequence head, or GPT's task head alone (no LM head)."""
    if "segment_ids" in b:
        return model(b["idx"], b["segment_ids"], b["attention_mask"])
    return model.classify(b["idx"], b["last"])


def predict_logits(model, features: SentenceFeatures, batch_size: int = 64) -> torch.Tensor:
    """The head's outputs (N, n_out) for every example of `features`, in order (float32, on the CPU)."""
    rows = run_model(_classify, model, features, batch_size)
    return torch.stack(rows) if rows else torch.empty(0, model.head.n_out)


def encode(examples, tokenizer, head: HeadConfig, options=None) -> SentenceFeatures:
    return encode_examples(examples, tokenizer, head.max_length, head.labels, head.kind, head.both_orders)


def scores(logits: torch.Tensor, features: SentenceFeatures, kind: str, metrics) -> dict[str, float]:
    """The task's metrics (names in duolm.metrics.SEQUENCE_METRICS) and the mean loss."""
    gold = features.labels or []
    if kind == "regress":
        pred = logits[:, 0].tolist()
        loss = F.mse_loss(logits[:, 0], torch.tensor(gold)).item()
    else:
        pred = logits.argmax(-1).tolist()
        loss = F.cross_entropy(logits, torch.tensor(gold)).item()
    return {**{m: SEQUENCE_METRICS[m](pred, gold) for m in metrics}, "loss": loss}


def _metrics_of(head: HeadConfig) -> tuple:
    key = head.task.lower().replace("-", "") if head.task else ""
    return GLUE[key].metrics if key in GLUE else user_metrics(head.kind, head.labels)


def score(model, tokenizer, examples, features=None, batch_size: int = 64) -> dict[str, float]:
    """The task's metrics of a fine-tuned model on labelled examples, and the mean loss."""
    features = features or encode(examples, tokenizer, model.head)
    return scores(predict_logits(model, features, batch_size), features, model.head.kind, _metrics_of(model.head))


def _run(model, tokenizer, texts, batch_size: int) -> tuple[torch.Tensor, SentenceFeatures]:
    """The head's outputs (N, n_out) for texts (str) or pairs ((str, str)), and their features."""
    examples = [Example(*t) if isinstance(t, (tuple, list)) else Example(t) for t in texts]
    feats = encode(examples, tokenizer, model.head)
    return predict_logits(model, feats, batch_size), feats


def _mark_cut(out: list[dict], feats: SentenceFeatures) -> list[dict]:
    for i in feats.cut:
        out[i]["truncated"] = True
    return out


def predict(model, tokenizer, texts, batch_size: int = 64) -> list[dict]:
    """Predictions of a fine-tuned head model for texts (str) or pairs ((str, str)), in order:
    {"label", "probabilities": {label: p}} (classify) or {"score"} (regress); "truncated": True marks an
    input that was cut to the model's max_length."""
    head = model.head
    logits, feats = _run(model, tokenizer, texts, batch_size)
    out: list[dict]
    if head.kind == "regress":
        out = [{"score": float(x)} for x in logits[:, 0]]
    else:
        probs = logits.softmax(-1)
        out = [{"label": head.labels[int(p.argmax())], "probabilities": dict(zip(head.labels, p.tolist()))}
               for p in probs]
    return _mark_cut(out, feats)


def scores_pairs(head: HeadConfig) -> bool:
    """Whether a head gives one relevance score per pair: a regressor, or a classifier of two labels."""
    return head.kind == "regress" or (head.kind == "classify" and len(head.labels) == 2)


def pair_scores(model, tokenizer, pairs, batch_size: int = 64) -> list[dict]:
    """The relevance score of each (text, text) pair, as a cross-encoder gives it: {"score", "tokens"}, in order.
    score: a regressor's value (STS-B: 0 to 5), or a 2-label classifier's probability of its second label (label
    index 1: MRPC's "1", a paraphrase), softmax(logits)[1] = sigmoid(l1 - l0); tokens: the inputs' length (GPT
    with both orders: the two inputs'); "truncated": True marks a pair cut to the model's max_length. Other heads
    have no one score per pair (ValueError), and a text alone is not a pair (ValueError)."""
    head = model.head
    if not scores_pairs(head):
        raise ValueError(f"a relevance score needs a fine-tuned pair classifier of 2 labels or a regressor; this "
                         f"model's head is {head.kind}" + (f" with {len(head.labels)} labels" if head.labels else ""))
    single = next((i for i, p in enumerate(pairs) if not isinstance(p, (tuple, list)) or len(p) != 2), None)
    if single is not None:
        raise ValueError(f"input {single} is not a pair of texts: a relevance score is of a (text, text) pair")
    logits, feats = _run(model, tokenizer, pairs, batch_size)
    values = logits[:, 0] if head.kind == "regress" else logits.softmax(-1)[:, 1]
    tokens = [sum(map(len, x)) if isinstance(x, tuple) else len(x) for x in feats.ids]
    return _mark_cut([{"score": float(v), "tokens": n} for v, n in zip(values, tokens)], feats)


def write_glue_predictions(model, tokenizer, data_dir, out_dir, batch_size: int = 64) -> list[Path]:
    """The GLUE submission files (SST-2.tsv, MNLI-m.tsv, ...) of the test files in a GLUE task folder (the task
    the model was fine-tuned on), into out_dir."""
    data = load_glue(model.head.task, data_dir, splits=("test",))
    if not data.test:
        raise ValueError(f"no GLUE test file found for task {data.name!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, examples in data.test.items():
        logits = predict_logits(model, encode(examples, tokenizer, model.head), batch_size)
        preds = logits[:, 0].tolist() if data.kind == "regress" else [data.labels[i] for i in logits.argmax(-1)]
        written.append(write_submission(out_dir / name, examples, preds))
    return written


# --- the task ---------------------------------------------------------------------------------------------

def read(name: str, files: Files, splits, options, head: HeadConfig | None = None) -> Data:
    """A GLUE task from its folder (files.data), or "classify" / "regress" from the user's files.train / files.dev
    with the named columns. head: a fine-tuned model's, whose label space the data must match."""
    if name.lower() in USER_TASKS:
        if files.data is not None:
            raise ValueError(f"task {name!r} reads --train / --dev files with named columns, not a GLUE folder")
        if files.train is None and files.dev is None:
            raise ValueError(f"task {name!r} needs a --train file (and a --dev file or a dev fraction)")
        data = load_user(files.train if "train" in splits else None, files.dev, files.text_column, files.pair_column,
                         files.label_column, regress=name.lower() == "regress", dev_fraction=options.dev_fraction,
                         kind=head.kind if head else None, labels=head.labels if head else None)
    else:
        data = load_glue(name, files.data, splits, options.dev_fraction, files.dev)
    if head is not None and (data.kind != head.kind or (data.labels and data.labels != head.labels)):
        raise ValueError(f"the model predicts {head.kind} {head.labels or ''} (task {head.task!r}); "
                         f"the data is {data.kind} {data.labels or ''} (task {data.name!r})")
    for examples in data.dev.values() if data.kind == "regress" else ():      # scored by correlations
        check_varied([e.label for e in examples], examples[0].where.rpartition(":")[0])
    return data


def make_head(data: Data, family: str, options, block_size: int) -> HeadConfig:
    return HeadConfig(data.kind, data.labels, data.name, min(options.max_length or MAX_LENGTH, block_size),
                      options.both_orders)


def objective(family: str, head: HeadConfig, lm_coef: float = 0.0) -> Objective:
    return sequence_objective(family, head.kind, lm_coef if family == "gpt2" else 0.0)


def parse(given: PredictInputs) -> list:
    """Texts and (text, text) pairs: the lines of given.file (a tab between the two texts of a pair), or
    given.texts (two at a time with given.pairs)."""
    if given.file:
        lines = Path(given.file).read_text(encoding="utf-8").splitlines()
        rows = [tuple(line.split("\t")) if "\t" in line else line for line in lines if line.strip()]
        bad = next((n for n, r in enumerate(rows, 1) if isinstance(r, tuple) and len(r) != 2), None)
        if bad:
            raise ValueError(f"{given.file} line {bad}: expected one text, or two separated by a tab")
        return rows
    if given.pairs and len(given.texts) % 2:
        raise ValueError(f"--pairs takes texts two at a time; got {len(given.texts)}")
    return list(zip(given.texts[::2], given.texts[1::2])) if given.pairs else list(given.texts)


def line(given, prediction: dict) -> str:
    """The text(s), then the label and its probability (classify) or the score (regress), tab-separated."""
    r = prediction
    what = f"{r['score']:.4f}" if "score" in r else f"{r['label']}\t{r['probabilities'][r['label']]:.4f}"
    return "\t".join(given if isinstance(given, tuple) else (given,)) + "\t" + what


# This module is a duolm.tasks.base.Task: the functions above and what follows (tasks/__init__ checks it).
kinds: tuple[str, ...] = ("classify", "regress")
names: tuple[str, ...] = tuple(GLUE) + USER_TASKS
unit = "training examples"
percent: tuple[str, ...] = ()
route: str | None = "/v1/classify"
head = make_head
trained = list
