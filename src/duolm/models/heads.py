"""Fine-tuning heads: a pretrained backbone plus one small layer (BERT section 4, GPT-1 section 3.2).

    BERT, one label per input:   logits = W dropout(tanh(W_pool h[CLS] + b))       BertForSequence
    BERT, one label per token:   logits_i = W dropout(h_i)                         BertForTokens
    BERT, a span (SQuAD):        start_i = h_i . W_s,  end_i = h_i . W_e           BertForSpans
    BERT, one of N endings:      score_j = w . dropout(tanh(W_pool h_j[CLS] + b))  BertForChoice (softmax over j)
    BERT, a sentence embedding:  e = normalize(mean_i h_i) (or h[CLS]); no new layer  BertForEmbedding
    GPT, one label per input:    logits = W_y h_last  (h of the last real token)   GPT2ForSequence

A regressor is a classifier with one output (its loss is MSE; losses live in duolm.train). The head
says what it predicts in a HeadConfig: its kind and the label names, so a saved model maps its outputs
back to the strings of the training data. Module names follow the backbones (bert.*, gpt2.*) plus one
small layer (fc, or score for GPT as in transformers' GPT2ForSequenceClassification, which has no bias).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from duolm.models.bert import Bert, BertConfig, BertForPreTraining
from duolm.models.dropout import Dropout
from duolm.models.gpt2 import GPT2, GPT2Config

KINDS = ("classify", "regress", "tag", "span", "choice", "embed")
POOLINGS = ("mean", "cls")
MAX_LENGTH = 128         # input tokens at most (BERT's GLUE and CoNLL recipes)
SPAN_MAX_LENGTH = 384    # tokens per SQuAD window (BERT section 4.2)


@dataclass
class HeadConfig:
    """What a fine-tuned head predicts, and how its inputs were made (so predict() makes them the same way).

    kind: "classify" (a label per input), "regress" (a number per input), "tag" (a label per token),
          "span" (start and end of an answer in the input), "choice" (the best of N endings of a context).
    labels: class or tag names, id = position (classify, tag); empty for regress and span.
    task: the task it was trained on ("sst2", "mnli", "classify" for user data, ...), for evaluation.
    max_length: input tokens at most, as in training.
    both_orders: GPT sentence pairs were fed as A<d>B and B<d>A, their last states summed (GPT-1's similarity).
    null_threshold: span heads trained on SQuAD v2.0: the answer is "" when the no-answer score exceeds the best
          span's by more than this (chosen on dev); None: always the best span (v1.1).
    pooling, normalize: embed heads: the mean over real tokens or the [CLS] state, then L2-normalised or not
          (sentence-transformers' Pooling and Normalize modules).
    """
    kind: str
    labels: list = field(default_factory=list)
    task: str | None = None
    max_length: int = MAX_LENGTH
    both_orders: bool = False
    null_threshold: float | None = None
    pooling: str = "mean"
    normalize: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"head kind {self.kind!r} is not one of {KINDS}")
        self.labels = [str(x) for x in self.labels]
        if self.kind in ("classify", "tag") and len(self.labels) < 2:
            raise ValueError(f"a {self.kind} head needs at least 2 labels, got {self.labels}")
        if self.kind in ("regress", "span", "choice", "embed") and self.labels:
            raise ValueError(f"a {self.kind} head has no labels, got {self.labels}")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be distinct, got {self.labels}")
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r} is not one of {POOLINGS}")

    @property
    def n_out(self) -> int:
        """Outputs of the head's linear layer."""
        return {"regress": 1, "span": 2, "choice": 1, "embed": 0}.get(self.kind, len(self.labels))


def _init(linear: nn.Linear) -> nn.Linear:
    nn.init.normal_(linear.weight, 0.0, 0.02)     # both papers' N(0, 0.02)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


class _OnBert(nn.Module):
    """A head model over a Bert encoder, `bert`, for a head of one of `kinds`."""
    bert: Bert
    kinds: tuple[str, ...] = ()

    def __init__(self, config: BertConfig, head: HeadConfig):
        super().__init__()
        if head.kind not in self.kinds:
            raise ValueError(f"{type(self).__name__} predicts {' or '.join(self.kinds)}, not {head.kind!r}")
        self.config, self.head = config, head
        self.bert = Bert(config)

    @property
    def backbone(self) -> Bert:
        return self.bert


class BertForSequence(_OnBert):
    """A label (or a number) per input: the pooled [CLS] state (Bert's tanh pooler), dropout, linear."""

    kinds = ("classify", "regress")

    def __init__(self, config: BertConfig, head: HeadConfig):
        super().__init__(config, head)
        self.drop = Dropout(config.dropout)
        self.fc = _init(nn.Linear(config.n_embd, head.n_out))

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """idx, segment_ids, attention_mask (B, T) as Bert -> logits (B, n_out), from Bert.pooled (the last
        layer at [CLS] only)."""
        return self.fc(self.drop(self.bert.pooled(idx, segment_ids, attention_mask)))


class BertForTokens(_OnBert):
    """A label per token (NER): dropout, then Linear(C, n_labels) on every hidden state."""

    kinds = ("tag",)

    def __init__(self, config: BertConfig, head: HeadConfig):
        super().__init__(config, head)
        self.drop = Dropout(config.dropout)
        self.fc = _init(nn.Linear(config.n_embd, head.n_out))

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """-> logits (B, T, n_labels)."""
        hidden, _ = self.bert(idx, segment_ids, attention_mask)
        return self.fc(self.drop(hidden))


class BertForSpans(_OnBert):
    """Span QA: one Linear(C, 2) gives every token a start score (W_s) and an end score (W_e)."""

    kinds = ("span",)

    def __init__(self, config: BertConfig, head: HeadConfig):
        super().__init__(config, head)
        self.fc = _init(nn.Linear(config.n_embd, 2))

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """-> (start_logits (B, T), end_logits (B, T))."""
        hidden, _ = self.bert(idx, segment_ids, attention_mask)
        start, end = self.fc(hidden).unbind(-1)
        return start, end


class BertForChoice(_OnBert):
    """Multiple choice (BERT section 4.4, SWAG): each of N "[CLS] context [SEP] ending [SEP]" inputs gets a score
    from its pooled [CLS] state, the N scores are the logits of a softmax over the endings."""

    kinds = ("choice",)

    def __init__(self, config: BertConfig, head: HeadConfig):
        super().__init__(config, head)
        self.drop = Dropout(config.dropout)
        self.fc = _init(nn.Linear(config.n_embd, 1))

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """idx, segment_ids, attention_mask (B, N, T): N endings per example -> logits (B, N)."""
        B, N, T = idx.shape
        flat = lambda x: None if x is None else x.reshape(B * N, T)                        # noqa: E731
        pooled = self.bert.pooled(flat(idx), flat(segment_ids), flat(attention_mask))
        return self.fc(self.drop(pooled)).view(B, N)


def pool_states(hidden: torch.Tensor, mask: torch.Tensor, mode: str = "mean", normalize: bool = True) -> torch.Tensor:
    """hidden (B, T, C), mask (B, T) of 0/1 -> (B, C): the mean over real tokens ("mean") or the [CLS] state
    ("cls"), L2-normalised when `normalize` (sentence-transformers' Pooling + Normalize).

    Example: states [3, 0], [1, 2] and a padded [9, 9], mean -> [2, 1]; normalised -> [0.894, 0.447]."""
    if mode == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        vec = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    else:
        vec = hidden[:, 0]
    return F.normalize(vec, p=2, dim=-1) if normalize else vec


class BertForEmbedding(_OnBert):
    """A sentence embedding (sentence-transformers' bi-encoder): the encoder's states pooled as head.pooling says,
    L2-normalised when head.normalize; no new layer. Losses over pairs of embeddings live in duolm.tasks.embedding."""

    kinds = ("embed",)

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """-> embeddings (B, C)."""
        hidden, _ = self.bert(idx, segment_ids, attention_mask)
        mask = torch.ones_like(idx) if attention_mask is None else attention_mask
        return pool_states(hidden, mask, self.head.pooling, self.head.normalize)


class GPT2ForSequence(nn.Module):
    """A label (or a number) per input from the hidden state of its last real token (GPT-1 section 3.2).

    Inputs are right-padded: attention is causal, so the padding after a token never reaches it, and no
    attention mask is needed. forward gives GPT-1's two heads over the same hidden states, the task head
    and the LM head (for the auxiliary loss L = L_task + lambda L_LM, GPT-1 section 3.3), as GPT-1's
    training code and transformers' GPT2DoubleHeadsModel do; classify gives the task head alone.

    idx (B, T) or (B, S, T): S orderings of each input (GPT-1 fed similarity pairs both ways and summed
    the two final states); last (B,) or (B, S): position of each row's last real token.
    """

    def __init__(self, config: GPT2Config, head: HeadConfig):
        super().__init__()
        if head.kind not in ("classify", "regress"):
            raise ValueError(f"GPT2ForSequence predicts classify or regress, not {head.kind!r}")
        self.config, self.head = config, head
        self.gpt2 = GPT2(config)
        self.score = _init(nn.Linear(config.n_embd, head.n_out, bias=False))

    @property
    def backbone(self) -> GPT2:
        return self.gpt2

    def _task(self, h, last):
        """h (B*S, T, C), last (B,) or (B, S) -> task logits (B, n_out) from the last real tokens' states."""
        rows = torch.arange(h.shape[0], device=h.device)
        pooled = h[rows, last.reshape(-1)].view(*last.shape, -1)            # (B, [S,] C)
        if pooled.dim() == 3:
            pooled = pooled.sum(1)
        return self.score(pooled)

    def forward(self, idx, last):
        """-> (logits (B, n_out), lm_logits (B, [S,] T, vocab_size)): the task head and the LM head."""
        h = self.gpt2.hidden(idx.reshape(-1, idx.shape[-1]))                 # (B*S, T, C)
        return self._task(h, last), self.gpt2.head(h).view(*idx.shape, -1)

    def classify(self, idx, last):
        """-> logits (B, n_out): the task head alone (prediction; no LM logits are computed)."""
        return self._task(self.gpt2.hidden(idx.reshape(-1, idx.shape[-1])), last)


HEAD_MODELS = (BertForSequence, BertForTokens, BertForSpans, BertForChoice, BertForEmbedding, GPT2ForSequence)
HeadModel = BertForSequence | BertForTokens | BertForSpans | BertForChoice | BertForEmbedding | GPT2ForSequence


def head_model(family: str, config, head: HeadConfig) -> HeadModel:
    """The head class for a backbone family and a head kind."""
    if family == "gpt2":
        return GPT2ForSequence(config, head)
    if family != "bert":
        raise ValueError(f"family {family!r} is not 'gpt2' or 'bert'")
    cls: dict[str, Callable[[BertConfig, HeadConfig], HeadModel]] = {
        "classify": BertForSequence, "regress": BertForSequence, "tag": BertForTokens, "span": BertForSpans,
        "choice": BertForChoice, "embed": BertForEmbedding}
    return cls[head.kind](config, head)


def attach_head(pretrained: nn.Module, head: HeadConfig, dropout: float | None = None) -> HeadModel:
    """A head model around a copy of a pretrained GPT2, Bert or BertForPreTraining (its encoder; the MLM and
    NSP heads are left behind), with the backbone's dropout replaced when `dropout` is given. The new
    layer is drawn from the global RNG (seed it first)."""
    if not isinstance(pretrained, (GPT2, Bert, BertForPreTraining)):
        raise ValueError(f"cannot put a head on a {type(pretrained).__name__}; expected GPT2, Bert or BertForPreTraining")
    base = pretrained.backbone
    config = base.config if dropout is None else replace(base.config, dropout=dropout)
    model = head_model(config.family, config, head)
    model.backbone.load_state_dict(base.state_dict())
    return model.to(next(base.parameters()).device)
