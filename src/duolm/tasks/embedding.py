"""Sentence embeddings for BERT (a bi-encoder, as sentence-transformers trains one). Read top to bottom: the reader,
the features, the objectives, prediction, scores.

    e = normalize(mean_i h_i)   (or the model's own pooling: duolm.convert.st.read_pooling)   BertForEmbedding
    pairs / triples:  L = CE(20 * cos(a_i, [p_1..p_B, n_1..n_B]), i)   MultipleNegativesRankingLoss (in-batch negatives)
    scored pairs:     L = mean (cos(a_i, b_i) - y_i)^2                  CosineSimilarityLoss, y in [-1, 1]

Data: a .csv / .tsv / .jsonl file of anchor, positive (and negative: a hard negative, optional) columns, or of
sentence1, sentence2 and score (STS-B's columns; a training score must lie in [-1, 1], the range of a cosine).
The dev metric is the Spearman correlation of the pairs' cosines with their scores (any scale: STS-B's 0-5).
Negatives are those of the batch (of the micro-batch when a step is cut into several).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from duolm.metrics import pearson, spearman
from duolm.models.heads import HeadConfig
from duolm.objectives import Objective
from duolm.tasks.base import (MAX_LENGTH, Data, Files, PredictInputs, TokenRows, check_varied, holdout, pad,
                              parse_texts, read_rows, run_model)

SCALE = 20.0             # MNRL's scale: 1 / temperature (sentence-transformers' default)
LAYOUTS = (("anchor", "positive", "negative"), ("anchor", "positive"), ("sentence1", "sentence2", "score"))


# --- the reader -------------------------------------------------------------------------------------------

@dataclass
class Pair:
    """Two (or three: a hard negative) texts, their score (None: a positive pair) and where it came from."""
    texts: tuple
    score: float | None = None
    where: str = ""


def read_pairs(path, scored: bool = False) -> list[Pair]:
    """The rows of an embedding file (see the module doc); scored: the file must have sentence1, sentence2, score
    (a dev file). An empty text or a score that is not a number is an error naming the file and line."""
    header, rows = read_rows(path)
    layout = next((cols for cols in LAYOUTS[2 if scored else 0:] if set(cols) <= set(header)), None)
    if layout is None:
        want = "sentence1, sentence2, score" if scored else "anchor, positive (, negative) or sentence1, sentence2, score"
        raise ValueError(f"{path}: expected the columns {want}; the columns are: {', '.join(map(str, header)) or 'none'}")
    if not rows:
        raise ValueError(f"{path}: no examples")
    texts, out = [c for c in layout if c != "score"], []
    for line, row in rows:
        got = tuple(row.get(c) for c in texts)
        if any(not isinstance(t, str) or not t.strip() for t in got):
            raise ValueError(f"{path} line {line}: {' and '.join(texts)} must be non-empty texts")
        score = None
        if "score" in layout:
            try:
                score = float(row["score"])
            except (TypeError, ValueError):
                raise ValueError(f"{path} line {line}: score {row['score']!r} is not a number") from None
            if not math.isfinite(score):
                raise ValueError(f"{path} line {line}: score {row['score']!r} is not a finite number")
        out.append(Pair(got, score, f"{path}:{line}"))
    return out


def read(name: str, files: Files, splits, options, head: HeadConfig | None = None) -> Data:
    """--train (pairs, triples or scored pairs) and --dev (scored pairs: sentence1, sentence2, score), or the last
    dev_fraction of a scored --train file as the dev set."""
    train_file = files.train or files.data
    need_train = "train" in splits or (files.dev is None and options.dev_fraction)
    if need_train and train_file is None:
        raise ValueError(f"task {name!r} needs a training file (--train)")
    train = read_pairs(train_file) if need_train else []
    dev = read_pairs(files.dev, scored=True) if files.dev else []
    notes = []
    if not files.dev and options.dev_fraction:
        if train[0].score is None:
            raise ValueError(f"{train_file}: a dev set is held out of scored pairs only; give a --dev file of "
                             f"sentence1, sentence2, score")
        train, dev = holdout(train, options.dev_fraction)
        notes.append(f"the last {len(dev)} pairs of {train_file} are the dev set")
    if "dev" in splits and not dev:
        raise ValueError(f"task {name!r} has no dev set: give a --dev file (sentence1, sentence2, score) or a dev "
                         f"fraction")
    bad = next((p for p in train if p.score is not None and not -1.0 <= p.score <= 1.0), None)
    if bad is not None and "train" in splits:
        raise ValueError(f"{bad.where}: score {bad.score:g} is outside [-1, 1]: CosineSimilarityLoss compares it "
                         f"with a cosine; rescale the scores (STS-B's 0-5: divide by 5)")
    if "dev" in splits:
        check_varied([p.score for p in dev], files.dev or f"{train_file} (its held-out end)")
    if train:
        hard = ", hard negatives" if len(train[0].texts) > 2 else ""
        notes.append("loss: " + ("CosineSimilarityLoss (scored pairs)" if train[0].score is not None else
                                 f"MultipleNegativesRankingLoss (in-batch negatives{hard}, scale {SCALE:g})"))
    return Data(name.lower(), "embed", [], ("spearman", "pearson"), train, {"": dev}, notes=notes)


# --- features ---------------------------------------------------------------------------------------------

@dataclass
class TextRows(TokenRows):
    """Token ids of single texts ([CLS] text [SEP]): what prediction embeds."""
    ids: list
    pad_id: int
    cut: list = field(default_factory=list)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        idx, mask = pad([self.ids[i] for i in rows], self.pad_id)
        return {"idx": idx, "attention_mask": mask}


@dataclass
class PairFeatures:
    """columns[c][i]: the ids of text c of example i; scores (None: positive pairs / triples); cut: the examples
    with a text cut to max_length."""
    columns: list
    scores: list | None
    pad_id: int
    cut: list = field(default_factory=list)

    def __len__(self):
        return len(self.columns[0])

    def lengths(self) -> np.ndarray:
        return np.array([max(len(c[i]) for c in self.columns) for i in range(len(self))], dtype=np.int64)

    def column(self, c: int) -> TextRows:
        return TextRows(self.columns[c], self.pad_id)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """idx<c>, mask<c> (B, T) for each text column c, every text padded to the batch's longest (so that one
        forward embeds them all: objective); labels (B,) when scored."""
        idx, mask = pad([column[i] for column in self.columns for i in rows], self.pad_id)
        batch = {}
        for c, (x, m) in enumerate(zip(idx.chunk(len(self.columns)), mask.chunk(len(self.columns)))):
            batch[f"idx{c}"], batch[f"mask{c}"] = x, m
        if self.scores is not None:
            batch["labels"] = torch.tensor([self.scores[i] for i in rows], dtype=torch.float32)
        return batch


def text_ids(tokenizer, texts, max_length: int) -> tuple[list, list]:
    """([CLS] text [SEP] of each text, cut to max_length as sentence-transformers' tokenizer cuts it, the numbers
    of the texts that were cut)."""
    ids, cut = [], []
    for i, t in enumerate(texts):
        x = tokenizer.encode(t)
        if len(x) > max_length:
            x = x[:max_length - 1] + [tokenizer.sep_id]
            cut.append(i)
        ids.append(x)
    return ids, cut


def encode(pairs, tokenizer, head: HeadConfig, options=None) -> PairFeatures:
    n = {len(p.texts) for p in pairs}
    if len(n) > 1:
        raise ValueError(f"examples with {sorted(n)} texts cannot share a batch")
    columns, cut = [], set()
    for c in range(n.pop() if n else 2):
        ids, cut_c = text_ids(tokenizer, [p.texts[c] for p in pairs], head.max_length)
        columns.append(ids)
        cut.update(cut_c)
    scores = [p.score for p in pairs] if pairs and pairs[0].score is not None else None
    return PairFeatures(columns, scores, tokenizer.pad_id, sorted(cut))


# --- the objectives ---------------------------------------------------------------------------------------

def embed_loss(embeddings: list, batch: dict, norm: dict | None = None):
    """CosineSimilarityLoss when the batch has labels, else MultipleNegativesRankingLoss (see the module doc); the
    sum over the batch divided by the step's examples (norm["n"])."""
    n = max((norm or {"n": embeddings[0].shape[0]})["n"], 1)
    anchors = embeddings[0].float()
    if "labels" in batch:
        cos = F.cosine_similarity(anchors, embeddings[1].float())
        loss = ((cos - batch["labels"]) ** 2).sum() / n
        return loss, {"loss": loss.detach()}
    others = torch.cat([e.float() for e in embeddings[1:]])                     # (k B, C): positives, negatives
    scores = SCALE * F.normalize(anchors, dim=-1) @ F.normalize(others, dim=-1).T          # (B, k B)
    right = torch.arange(len(anchors), device=scores.device)
    loss = F.cross_entropy(scores, right, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (scores.argmax(-1) == right).sum().float() / n}


def objective(family: str, head: HeadConfig, lm_coef: float = 0.0) -> Objective:
    def forward(m, b):
        """One forward over the texts of every column (one embedding gradient, matrices twice as tall), split back
        into the columns' embeddings."""
        n = sum(k.startswith("idx") for k in b)
        idx, mask = (torch.cat([b[f"{k}{c}"] for c in range(n)]) for k in ("idx", "mask"))
        return list(m(idx, None, mask).chunk(n))
    return Objective(forward=forward, loss=embed_loss, counts=lambda b: {"n": int(b["idx0"].shape[0])},
                     tokens=lambda b: sum(v.numel() for k, v in b.items() if k.startswith("idx")))


# --- prediction and scores --------------------------------------------------------------------------------

def embeddings(model, rows: TextRows, batch_size: int = 64) -> torch.Tensor:
    """(N, C) float32: the embedding of every text of `rows`, in order."""
    return torch.stack(run_model(lambda m, b: m(b["idx"], None, b["attention_mask"]), model, rows, batch_size))


def score(model, tokenizer, pairs, features=None, batch_size: int = 64) -> dict[str, float]:
    """Spearman (and Pearson) correlation of the pairs' cosines with their scores (STS-B's metrics)."""
    features = features or encode(pairs, tokenizer, model.head)
    a, b = (embeddings(model, features.column(c), batch_size) for c in (0, 1))
    cos = F.cosine_similarity(a, b).tolist()
    gold = [p.score for p in pairs]
    return {"spearman": spearman(cos, gold), "pearson": pearson(cos, gold)}


def predict(model, tokenizer, inputs, batch_size: int = 64) -> list[dict]:
    """Texts -> {"embedding": [C floats]}; "truncated": True marks a text cut to the model's max_length."""
    texts = [str(t) for t in inputs]
    ids, cut = text_ids(tokenizer, texts, model.head.max_length)
    out: list[dict] = [{"embedding": e.tolist()} for e in embeddings(model, TextRows(ids, tokenizer.pad_id), batch_size)]
    for i in cut:
        out[i]["truncated"] = True
    return out


def make_head(data: Data, family: str, options, block_size: int) -> HeadConfig:
    """Mean pooling, normalised (all-MiniLM-L6-v2's); finetune() puts the model's own pooling in its place."""
    if family != "bert":
        raise ValueError(f"task {data.name!r} pools BERT's token states: it needs a BERT model")
    return HeadConfig("embed", [], data.name, min(options.max_length or MAX_LENGTH, block_size))


def parse(given: PredictInputs) -> list[str]:
    return parse_texts(given, "an embedding model")


def line(text: str, prediction: dict) -> str:
    """The text, then its embedding's size and first values."""
    e = prediction["embedding"]
    return f"{text}\t{len(e)} dims: " + " ".join(f"{x:.4f}" for x in e[:4]) + " ..."


# This module is a duolm.tasks.base.Task: the functions above and what follows (tasks/__init__ checks it).
kinds: tuple[str, ...] = ("embed",)
names: tuple[str, ...] = ("embedding",)
unit = "training pairs"
percent: tuple[str, ...] = ()
route: str | None = "/v1/embeddings"
head = make_head
trained = list
