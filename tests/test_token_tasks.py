"""Token-level fine-tuning (NER tagging, SQuAD span QA): heads against transformers step by step, readers and
their errors, features (first-piece labels, document context, windows with max context), answers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from duolm.checkpoint import load
from duolm.data.features import TaskBatches
from duolm.data.tasks import Question, Sentence, read_conll, read_squad, tag_scheme
from duolm.data.token_tasks import (IGNORE, SpanFeatures, collate_spans, collate_tags, max_context, span_features,
                                    tag_features, windows, word_pieces)
from duolm.models.heads import HeadConfig, attach_head
from duolm.train import TrainConfig, lr_at, train
from duolm.train.finetune import token_objective
from test_finetune import _reference_losses, minilm_dir, one_thread  # noqa: F401

transformers = pytest.importorskip("transformers")

STEPS = TrainConfig(max_steps=20, batch_size=4, lr=1e-4, warmup_steps=2, decay="linear", weight_decay=0.01,
                    betas=(0.9, 0.999), eps=1e-6, grad_clip=1.0, eval_every=0)


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


@pytest.fixture(scope="module")
def conll(data_dir):
    return read_conll(data_dir / "conll2003" / "eng.train")


@pytest.fixture(scope="module")
def squad(data_dir):
    return read_squad(data_dir / "squad" / "dev-v1.1-articles-01-24.json")[0]


def test_tagger_trains_as_transformers(minilm, conll, one_thread):
    """MiniLM as our BertForTokens and as BertForTokenClassification: same head, batches, AdamW: 20 steps equal."""
    model, tok = minilm
    labels = sorted({t for s in conll for t in s.tags})
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("tag", labels), dropout=0.0)
    hf = transformers.BertForTokenClassification.from_pretrained(
        minilm_dir(), num_labels=len(labels), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.fc.weight)
        hf.classifier.bias.copy_(ours.fc.bias)
    batches = TaskBatches(tag_features(conll[:200], tok, labels, max_length=32), seed=0, collate_fn=collate_tags)
    got = [r["loss"] for r in train(ours, token_objective("tag"), batches, STEPS)["rows"]]
    hf.train()
    ref = _reference_losses(STEPS, batches, hf, lambda b: hf(
        input_ids=b["idx"], attention_mask=b["attention_mask"], token_type_ids=b["segment_ids"], labels=b["labels"]).loss)
    assert min(ref[-5:]) < ref[0] - 0.5
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


def _full_windows(f: SpanFeatures, length: int) -> SpanFeatures:
    keep = [i for i, x in enumerate(f.ids) if len(x) == length and f.start[i] > 0]
    return dataclasses.replace(f, **{k.name: [getattr(f, k.name)[i] for i in keep] for k in dataclasses.fields(f)
                                     if isinstance(getattr(f, k.name), list)})


def test_span_head_trains_as_transformers(minilm, squad, one_thread):
    """MiniLM as our BertForSpans and as BertForQuestionAnswering (windows without padding: transformers' loss
    counts padded positions, ours leaves them out): 20 steps equal."""
    model, tok = minilm
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("span"), dropout=0.0)
    hf = transformers.BertForQuestionAnswering.from_pretrained(
        minilm_dir(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.qa_outputs.weight.copy_(ours.fc.weight)
        hf.qa_outputs.bias.copy_(ours.fc.bias)
    feats = _full_windows(span_features(squad[:300], tok, max_length=48, stride=16), 48)
    assert len(feats) >= 100
    batches = TaskBatches(feats, seed=0, collate_fn=collate_spans)
    got = [r["loss"] for r in train(ours, token_objective("span"), batches, STEPS)["rows"]]
    hf.train()
    ref = _reference_losses(STEPS, batches, hf, lambda b: hf(
        input_ids=b["idx"], attention_mask=b["attention_mask"], token_type_ids=b["segment_ids"],
        start_positions=b["start"], end_positions=b["end"]).loss)
    assert min(ref[-5:]) < ref[0] - 0.5
    assert got == pytest.approx(ref, abs=1e-5, rel=0)
