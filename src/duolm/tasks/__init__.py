"""Downstream tasks, one module per family, each read top to bottom like a paper's appendix (reader, features,
objective, prediction, scores, `duolm predict`'s inputs and lines), each one a typed `Task`:

    sentence   GLUE and the user's labelled texts: classification / regression, BERT and GPT (+ the LM loss)
    tagging    CoNLL-2003 NER, a label per word (BERT)
    span       SQuAD v1.1 / v2.0 span question answering (BERT)
    choice     SWAG-style multiple choice (BERT)
    embedding  sentence embeddings from pairs, triples or scored pairs (BERT, sentence-transformers' losses)

    from duolm.tasks import evaluate, load_finetuned, predict
    model, tok = load_finetuned("runs/sst2/best")
    predict(model, tok, ["a gripping film"])           # [{"label": "1", "probabilities": {...}}]

Adding a GLUE-shaped task is a line in sentence.GLUE; a new kind of task is a module listed in TASKS here, plus
its head in duolm.models.heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from duolm.checkpoint import load
from duolm.models.heads import HEAD_MODELS, HeadConfig
from duolm.objectives import Objective
from duolm.tasks import choice, embedding, sentence, span, tagging
from duolm.tasks.base import Data, Files, PredictInputs, Task, TaskBatches, TaskOptions, first

TASKS: tuple[Task, ...] = (sentence, tagging, span, choice, embedding)       # each module is a Task (mypy checks it here)
BY_NAME = {name: t for t in TASKS for name in t.names}
BY_KIND = {kind: t for t in TASKS for kind in t.kinds}


def task(name: str) -> Task:
    """The Task that reads task `name` (a GLUE name, classify, regress, conll2003, ner, squad, multiple-choice)."""
    key = name.lower()
    found = BY_NAME.get(key) or BY_NAME.get(key.replace("-", ""))
    if found is None:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(BY_NAME)}")
    return found


def head_task(head: HeadConfig) -> Task:
    """The Task of a fine-tuned head: what its predictions are, how they are read, printed and served."""
    return BY_KIND[head.kind]


@dataclass
class Prepared:
    """A task ready for the training loop: the head to attach, the encoded training examples, the objective,
    the dev examples and their features (validated after every epoch), the metrics (the first selects), and
    what to tell the user (info: sizes, notes, inputs cut)."""
    task: Task
    head: HeadConfig
    train: object
    objective: Objective
    dev: dict
    dev_features: dict
    metrics: tuple
    info: dict

    def validate(self, model, tokenizer, batch_size: int) -> dict:
        """The dev metrics as fractions, "val_<prefix><metric>" (and SQuAD v2.0's chosen "val_null_threshold")."""
        out = {}
        for prefix, items in self.dev.items():
            got = self.task.score(model, tokenizer, items, self.dev_features[prefix], batch_size)
            out.update({f"val_{prefix}{k}": v / 100 if k in self.task.percent else v for k, v in got.items()
                        if isinstance(v, float)})
        return out


def prepare(name: str, tokenizer, family: str, options: TaskOptions, files: Files, block_size: int,
            lm_coef: float = 0.0) -> Prepared:
    """Task `name` read from `files`, encoded for a `family` model of `block_size` positions."""
    t = task(name)
    if options.both_orders and family != "gpt2":
        raise ValueError("both_orders is GPT's way of feeding sentence pairs; BERT reads one [CLS] A [SEP] B [SEP]")
    data = t.read(name, files, ("train", "dev"), options)
    data.train = first(data.train, options.max_train_examples, data.notes, t.unit)
    head = t.head(data, family, options, block_size)
    train = t.encode(t.trained(data.train), tokenizer, head, options)
    dev = {p: t.encode(items, tokenizer, head, options) for p, items in data.dev.items()}
    info = {"task": data.name, "kind": data.kind, "labels": data.labels, "train": len(data.train),
            "dev": {p or "dev": len(items) for p, items in data.dev.items()}, "notes": data.notes,
            "truncated": {"train": len(train.cut), **{(p or "dev"): len(f.cut) for p, f in dev.items()}}}
    return Prepared(t, head, train, t.objective(family, head, lm_coef), data.dev, dev, data.metrics, info)


def predict(model, tokenizer, inputs, batch_size: int = 64) -> list[dict]:
    """Predictions of a fine-tuned model, whatever its head: classify / regress: texts or (text, text) pairs ->
    {"label", "probabilities"} / {"score"}; tag: texts -> {"entities"}; span: (question, context) pairs ->
    {"answer", "start", "end", "score"}; choice: (context, [endings]) -> {"label", "probabilities"}; embed: texts ->
    {"embedding"}."""
    return head_task(model.head).predict(model, tokenizer, inputs, batch_size)


def evaluate(model, tokenizer, files: Files, split: str = "dev", options: TaskOptions | None = None,
             batch_size: int = 64) -> tuple[dict, list]:
    """The official metrics of a fine-tuned model on the dev (or train) data of the task it was trained on, its
    inputs made as `options` say (NER's context and stride, the held-out dev_fraction), as validation during
    fine-tuning makes them (None: TaskOptions()) -> ({prefix + metric: value}, notes about the data)."""
    options = options or TaskOptions()
    t, head = head_task(model.head), model.head
    splits = ("train", "dev") if split == "train" or options.dev_fraction else ("dev",)
    data = t.read(head.task or head.kind, files, splits, options, head)
    items = {"": data.train} if split == "train" else data.dev
    out = {}
    for prefix, examples in items.items():
        features = t.encode(examples, tokenizer, head, options)
        out.update({prefix + k: v for k, v in t.score(model, tokenizer, examples, features, batch_size).items()})
    return out, data.notes


def load_finetuned(path, device="cpu"):
    """-> (head model, tokenizer) of a fine-tuned model directory or run (a run's best/ model)."""
    model, tok = load(path, device)
    if not isinstance(model, HEAD_MODELS):
        raise ValueError(f"{path} holds a {type(model).__name__} without a fine-tuning head; fine-tune it first "
                         f"(duolm finetune {path} --task ...)")
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files (vocab.txt, or vocab.json + merges.txt)")
    return model, tok


__all__ = ["Task", "TASKS", "task", "head_task", "Prepared", "prepare", "predict", "evaluate", "load_finetuned", "Data",
           "Files", "TaskOptions", "TaskBatches", "PredictInputs"]
