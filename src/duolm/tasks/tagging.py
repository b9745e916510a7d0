"""Token tagging for BERT: named entities (CoNLL-2003, or the user's files in its column format), a label per word.
Read top to bottom: the reader, the features, the objective, prediction, scores.

    L = CE over the first piece of every word (the other pieces are ignored)          BERT section 5.3

Each word is split into word pieces and its label sits on the first piece; the other pieces, [CLS] and [SEP]
carry IGNORE (no loss, no prediction), as the BERT paper does for CoNLL-2003. A text is each sentence alone, or
with context="document" each document whole (BERT's "maximal document context"); one longer than max_length is
cut into overlapping windows (starts `stride` pieces apart, half a window by default), and each word is labelled
(trained and predicted) in the one window where its first piece has the most context: the rule of SQuAD's
windows (min(pieces left, pieces right) + 0.01 * window length, run_squad.py's _check_is_max_context; Devlin in
google-research/bert #66), so no word is left unlabelled for want of room. Entity F1 is conlleval's
(duolm.metrics.entity_scores).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm.metrics import entities, entity_scores, invalid_starts
from duolm.models.heads import HeadConfig
from duolm.objectives import IGNORE, Objective
from duolm.tasks.base import (MAX_LENGTH, Data, Files, PredictInputs, TokenRows, holdout, max_context_table, pad,
                              parse_texts, run_model, windows)
from duolm.tokenizers import WordPiece

SCHEMES = ("IOB1", "IOB2", "IOBES")


# --- the reader -------------------------------------------------------------------------------------------

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
    out: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    doc, first, n_cols = 0, 0, None

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
        for t in s.tags or ():
            if t != "O" and (t[:2] not in ("B-", "I-", "E-", "S-") or len(t) < 3):
                raise ValueError(f"{s.where}: tag {t!r} is not O or B-/I-/E-/S-<type>: unknown tag scheme")
            prefixes.add(t[0])
            i_start |= t[0] == "I" and (prev == "O" or prev[2:] != t[2:])
            prev = t
    if prefixes & {"E", "S"}:
        return "IOBES"
    return "IOB1" if i_start else "IOB2"


def tag_labels(train: list[Sentence], dev: list[Sentence], known: list[str] | None = None) -> list[str]:
    """The tag set of the training sentences ("O" first), or `known` (a trained model's); a dev tag not among
    them is an error."""
    labels = known or sorted({t for s in train for t in s.tags or ()}, key=lambda t: (t != "O", t[2:], t))
    for s in dev:
        bad = [t for t in s.tags or () if t not in labels]
        if bad:
            raise ValueError(f"{s.where}: tag {bad[0]!r} was not seen in training (tags: {', '.join(labels)})")
    return labels


def read(name: str, files: Files, splits, options, head: HeadConfig | None = None) -> Data:
    """conll2003: its folder (eng.train, and eng.testa: its dev set unless --dev names another file, which alone
    is enough to score a model); ner: CoNLL-format --train / --dev files (or the last dev_fraction of the training
    sentences). A trained model's data must use its tags."""
    train_file, dev_file, notes = files.train, files.dev, []
    if name.lower() == "conll2003" and files.data is not None:
        train_file, dev_file = Path(files.data) / "eng.train", dev_file or Path(files.data) / "eng.testa"
    elif name.lower() == "conll2003" and (dev_file is None or "train" in splits):
        raise ValueError("task 'conll2003' needs its folder (--data conll2003/, with eng.train and eng.testa), "
                         "or a --dev file to score")
    elif files.data is not None:
        train_file = train_file or files.data
    need_train = "train" in splits or (dev_file is None and options.dev_fraction)
    if need_train and train_file is None:
        raise ValueError(f"task {name!r} needs a training file (--train)")
    train = read_conll(train_file) if need_train else []
    dev = read_conll(dev_file) if dev_file else []
    if not dev_file and options.dev_fraction:
        train, dev = holdout(train, options.dev_fraction)
        notes.append(f"the last {len(dev)} sentences of {train_file} are the dev set")
    if "dev" in splits and not dev:
        raise ValueError(f"task {name!r} has no dev set: give a dev file or a dev fraction")
    scheme = tag_scheme(train + dev)
    labels = tag_labels(train, dev, head.labels if head is not None else None)
    repaired = sum(invalid_starts(s.tags or []) for s in train + dev) if scheme != "IOB1" else 0
    notes.append(f"tag scheme {scheme}" + (f"; {repaired} chunk(s) start with I- or E-, read as starts as conlleval "
                                           f"does" if repaired else ""))
    return Data(name.lower(), "tag", labels, ("f1", "precision", "recall"), train, {"": dev}, notes=notes)


# --- features ---------------------------------------------------------------------------------------------

def word_pieces(tok: WordPiece, words: list[str]) -> list[list[int]]:
    """The piece ids of each word (as tokenizing the words one by one; a word may give no piece, e.g. a
    control character)."""
    text = " ".join(words)
    enc = tok.encode_with_offsets(text)
    bounds, pos = [], 0
    for w in words:
        bounds.append((pos, pos + len(w)))
        pos += len(w) + 1
    out: list[list[int]] = [[] for _ in words]
    j = 0
    for piece, (start, _) in zip(enc.ids[1:-1], enc.offsets[1:-1]):
        while bounds[j][1] <= start:
            j += 1
        out[j].append(piece)
    return out


@dataclass
class TagFeatures(TokenRows):
    """One row per window: ids ([CLS] pieces [SEP]), labels (IGNORE but at the first piece of each word the
    window labels); where[s][w]: (row, position) of the first piece of sentence s's word w in the window that
    labels it ((-1, -1): the word got no piece). No word is left out, so `cut` stays empty."""
    ids: list
    labels: list
    where: list
    pad_id: int
    cut: list = field(default_factory=list)

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """idx, segment_ids, attention_mask, labels (B, T), padded to the longest row (labels with IGNORE)."""
        idx, mask = pad([self.ids[i] for i in rows], self.pad_id)
        labels = pad([self.labels[i] for i in rows], IGNORE)[0]
        return {"idx": idx, "segment_ids": torch.zeros_like(idx), "attention_mask": mask, "labels": labels}


def tag_features(sentences: list[Sentence], tok: WordPiece, labels: list[str], max_length: int = MAX_LENGTH,
                 context: str = "sentence", stride: int | None = None) -> TagFeatures:
    """Features for tagging (see the module doc): each sentence alone, or each document whole (context
    "document"), cut into windows of max_length - 2 pieces whose starts are `stride` pieces apart (None: half a
    window); a word is labelled in the window where its first piece has the most context. Untagged sentences
    get all-IGNORE labels."""
    if context not in ("sentence", "document"):
        raise ValueError(f"context must be 'sentence' or 'document', not {context!r}")
    room = max_length - 2
    stride = stride or max(1, room // 2)
    index = {t: i for i, t in enumerate(labels)}
    out = TagFeatures([], [], [[] for _ in sentences], tok.pad_id)
    for group in _groups(sentences, context):
        pieces: list[int] = []
        words = []                                      # (sentence, word, its first piece in `pieces`, label)
        for n in group:
            s = sentences[n]
            for w, p in enumerate(word_pieces(tok, s.words)):
                words.append((n, w, len(pieces) if p else -1, index[s.tags[w]] if s.tags is not None else IGNORE))
                pieces += p
        spans = windows(len(pieces), room, stride)
        owner, row0 = max_context_table(spans, len(pieces)), len(out.ids)
        for start, length in spans:
            out.ids.append([tok.cls_id] + pieces[start:start + length] + [tok.sep_id])
            out.labels.append([IGNORE] * (length + 2))
        for n, w, at, label in words:
            row, pos = (row0 + owner[at], at - spans[owner[at]][0] + 1) if at >= 0 else (-1, -1)
            out.where[n].append((row, pos))
            if at >= 0:
                out.labels[row][pos] = label
    return out


def _groups(sentences: list[Sentence], context: str) -> list[list[int]]:
    """The sentence numbers fed together: each sentence alone, or the runs of sentences of one document."""
    if context == "sentence":
        return [[n] for n in range(len(sentences))]
    groups: list[list[int]] = []
    for n, s in enumerate(sentences):
        if groups and sentences[groups[-1][-1]].doc == s.doc:
            groups[-1].append(n)
        else:
            groups.append([n])
    return groups


def encode(sentences, tokenizer, head: HeadConfig, options=None) -> TagFeatures:
    return tag_features(sentences, tokenizer, head.labels, head.max_length, options.context if options else "sentence",
                        options.stride if options else None)


# --- the objective ----------------------------------------------------------------------------------------

def tag_counts(batch: dict) -> dict[str, int]:
    return {"tokens": int((batch["labels"] != IGNORE).sum())}


def tag_loss(logits: torch.Tensor, batch: dict, norm: dict | None = None):
    """Cross-entropy of logits (B, T, n_labels) at the labelled pieces (the first piece of each word); metrics
    loss and accuracy over those pieces."""
    n = max((norm or tag_counts(batch))["tokens"], 1)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum") / n
    return loss, {"loss": loss.detach(), "accuracy": (logits.argmax(-1) == labels).sum().float() / n}


def objective(family: str, head: HeadConfig, lm_coef: float = 0.0) -> Objective:
    return Objective(forward=lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), loss=tag_loss,
                     counts=tag_counts, tokens=lambda b: b["idx"].numel())


# --- prediction and scores --------------------------------------------------------------------------------

def predict_tags(model, tok, sentences: list[Sentence], features=None, batch_size: int = 64):
    """-> (tags, scores) per sentence: the argmax tag of each word's first piece in the window that labels it,
    and its probability (a word without a piece gets "O" and probability 0)."""
    head = model.head
    features = features or tag_features(sentences, tok, head.labels, head.max_length)
    probs = [p.softmax(-1) for p in run_model(lambda m, b: m(b["idx"], b["segment_ids"], b["attention_mask"]), model,
                                             features, batch_size)]
    tags, scores = [], []
    for where in features.where:
        best = [probs[r][t].max(-1) if r >= 0 else None for r, t in where]
        tags.append([head.labels[int(b.indices)] if b is not None else "O" for b in best])
        scores.append([float(b.values) if b is not None else 0.0 for b in best])
    return tags, scores


def score(model, tok, sentences, features=None, batch_size: int = 64) -> dict:
    """conlleval's entity precision / recall / F1 (overall and per type) of the model on tagged sentences."""
    pred, _ = predict_tags(model, tok, sentences, features, batch_size)
    return entity_scores([s.tags for s in sentences], pred)


def _words(tok: WordPiece, text: str) -> list[tuple[int, int]]:
    """Character spans of the words of `text` as BERT splits them (whitespace and punctuation)."""
    enc = tok.encode_with_offsets(text)
    spans: list[tuple[int, int]] = []
    for i, (a, b) in zip(enc.ids[1:-1], enc.offsets[1:-1]):
        if spans and tok.inv[i].startswith("##"):
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


def predict(model, tok, texts, batch_size: int = 64, stride: int | None = None) -> list[dict]:
    """The entities of each text, {"entities": [{"type", "text", "start", "end" (characters), "score" (the mean
    probability of its words' tags)}]}, words as BERT splits the text, chunks read by conlleval's rules; a text
    longer than the window is read in windows `stride` pieces apart (None: half a window)."""
    texts = list(texts)
    spans = [_words(tok, t) for t in texts]
    sentences = [Sentence([t[a:b] for a, b in sp], None) for t, sp in zip(texts, spans)]
    features = tag_features(sentences, tok, model.head.labels, model.head.max_length, stride=stride)
    tags, probs = predict_tags(model, tok, sentences, features, batch_size)
    out = []
    for text, sp, tg, pr in zip(texts, spans, tags, probs):
        out.append({"entities": [{"type": type_, "text": text[sp[i][0]:sp[j][1]], "start": sp[i][0], "end": sp[j][1],
                                  "score": sum(pr[i:j + 1]) / (j + 1 - i)} for type_, i, j in entities(tg)]})
    return out


def make_head(data: Data, family: str, options, block_size: int) -> HeadConfig:
    if family != "bert":
        raise ValueError(f"task {data.name!r} tags word pieces: it needs a BERT model with a WordPiece vocabulary")
    return HeadConfig("tag", data.labels, data.name, min(options.max_length or MAX_LENGTH, block_size))


def parse(given: PredictInputs) -> list[str]:
    return parse_texts(given, "a tagger")


def line(text: str, prediction: dict) -> str:
    """The text, then each entity: its type, text, character span and score."""
    return text + "\t" + "  ".join(f"{e['type']} {e['text']!r} [{e['start']}:{e['end']}] {e['score']:.3f}"
                                   for e in prediction["entities"])


# This module is a duolm.tasks.base.Task: the functions above and what follows (tasks/__init__ checks it).
kinds: tuple[str, ...] = ("tag",)
names: tuple[str, ...] = ("conll2003", "ner")
unit = "training sentences"
percent: tuple[str, ...] = ()
route: str | None = "/v1/ner"
head = make_head
trained = list
