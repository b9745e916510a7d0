"""BERT (Devlin et al., 2018): a bidirectional Transformer encoder pretrained with masked LM + NSP.

Read top to bottom like the paper: config and presets, attention, MLP, the post-LN block, the
encoder with its pooler (what every BERT checkpoint holds), then the two pretraining heads.

    h_0 = LayerNorm(E_token + E_segment + E_position)
    h_l = block(h_{l-1})                         post-LN: ln_1(x + attn(x)), then ln_2(x + mlp(x))
    pooled = tanh(W_pool h_n[CLS] + b)           sentence summary for NSP / classification

Names are short and match GPT-2's (wte, wpe, h, ln_1, attn.c_attn, mlp.c_fc); the HF/TF names are
mapped in duolm.convert. Query, key and value are one fused (3C, C) projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from duolm.models.dropout import Dropout, attention
from duolm.models.gpt2 import TiedLinear, check_ids, check_sizes

# Largest sizes a config may declare, checked before allocation.
LIMITS = {"vocab_size": 1 << 22, "block_size": 1 << 20, "n_layer": 1024, "n_head": 1024, "n_embd": 1 << 16,
          "n_inner": 1 << 18, "type_vocab_size": 1024}


# ---------------------------------------------------------------------------------------------
# Config

@dataclass
class BertConfig:
    family: ClassVar[str] = "bert"     # which model family: every model of it has a config with this
    vocab_size: int = 30522
    block_size: int = 512
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: int = 3072
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self):
        check_sizes(self, LIMITS)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in BERT_PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; choose one of {sorted(BERT_PRESETS)}")
        return cls(**{**BERT_PRESETS[name], **overrides})


# BERT-base: 12 layers, hidden 768, 12 heads (109,482,240 params with the pooler at vocab 30,522);
# BERT-large: 24 layers, 1024, 16 heads (335,141,888).
BERT_PRESETS = {
    "bert-base": dict(n_layer=12, n_head=12, n_embd=768, n_inner=3072),
    "bert-large": dict(n_layer=24, n_head=16, n_embd=1024, n_inner=4096),
    "tiny": dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64, n_inner=256),
}


# ---------------------------------------------------------------------------------------------
# Bidirectional self-attention

class SelfAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v, every query against every key: attention() (SDPA; its formula written out
    under dropout on the CPU). q, k, v (B, nh, T, hd), mask None or bool (B, 1, 1, T) -> (B, nh, T, hd). A module of
    its own so that another arrangement of the same numbers can be swapped in for inference, visibly (print(model)),
    as GPT-2's OneQueryAttention: scores_attention below, the one SDPA's fused kernel loses to at short lengths."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask=None):
        return attention(q, k, v, mask, self.dropout if self.training else 0.0)


SOFTMAX_ROW = 16      # keys a row of scores is padded to at least: a float vector under AVX-512, two under AVX2


def scores_attention(q, k, v, mask=None):
    """SelfAttention's numbers (no dropout) as three batched products: the (B*nh, T, T) scores in one baddbmm onto
    the additive mask (0 or -inf), their softmax, and the product with v. q (B, nh, Tq, hd), k, v (B, nh, T, hd) ->
    (B, nh, Tq, hd) (Tq = 1: Block.cls). Fewer than SOFTMAX_ROW keys are padded to it (keys and values 0, masked
    out: the same sums), as torch's softmax over a row shorter than a vector takes a scalar loop many times slower."""
    B, nh, Tq, hd = q.shape
    T = k.shape[2]
    S = max(T, SOFTMAX_ROW)
    bias = torch.zeros((B, 1, 1, S), dtype=q.dtype, device=q.device)
    if mask is not None:
        bias[..., :T].masked_fill_(~mask, float("-inf"))
    if S > T:
        bias[..., T:] = float("-inf")
        k, v = (F.pad(x, (0, 0, 0, S - T)) for x in (k, v))
    att = torch.baddbmm(bias.expand(B, nh, Tq, S).reshape(B * nh, Tq, S), q.reshape(B * nh, Tq, hd),
                        k.reshape(B * nh, S, hd).transpose(1, 2), alpha=hd ** -0.5)
    return torch.bmm(att.softmax(-1), v.reshape(B * nh, S, hd)).view(B, nh, Tq, hd)


class Attention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)   # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = Dropout(config.dropout)
        self.core = SelfAttention(config.dropout)

    def forward(self, x, mask=None):
        """x (B, T, C); mask None or bool (B, 1, 1, T), True = real key -> (B, T, C)."""
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        return self.attend(q, k, v, mask)

    def attend(self, q, k, v, mask=None):
        """Projected queries q (B, Tq, C) against keys and values k, v (B, T, C) -> (B, Tq, C): heads,
        scaled dot-product attention, output projection."""
        B, Tq, C = q.shape
        T = k.shape[1]
        q = q.view(B, Tq, self.n_head, -1).transpose(1, 2)    # (B, nh, T, hd), strided views
        k = k.view(B, T, self.n_head, -1).transpose(1, 2)
        v = v.view(B, T, self.n_head, -1).transpose(1, 2)
        y = self.core(q, k, v, mask)
        y = self.c_proj(y.transpose(1, 2).reshape(B, Tq, C))
        return self.resid_drop(y) if self.training and self.dropout > 0 else y


# ---------------------------------------------------------------------------------------------
# Position-wise MLP: C -> n_inner -> C with GELU (erf form)

class MLP(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dropout = config.dropout
        self.c_fc = nn.Linear(config.n_embd, config.n_inner)
        self.c_proj = nn.Linear(config.n_inner, config.n_embd)
        self.drop = Dropout(config.dropout)

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x)))
        return self.drop(y) if self.training and self.dropout > 0 else y


# ---------------------------------------------------------------------------------------------
# Post-LN Transformer block (the original Transformer's order)

class Block(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = Attention(config)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)

    def forward(self, x, mask=None):
        x = self.ln_1(x + self.attn(x, mask))
        x = self.ln_2(x + self.mlp(x))
        return x

    def cls(self, x, mask=None):
        """self(x, mask)[:, :1] computed for the first ([CLS]) query only -> (B, 1, C).

        The same equation on the one row the pooler reads: every position is still a key and a value (their
        projection is the block's own c_attn, queries included), but the attention, its output projection, both
        LayerNorms and the MLP run on [CLS] alone. (A second entry point: FSDP2 is told of it, duolm.train.parallel.)"""
        q, k, v = self.attn.c_attn(x).split(x.shape[-1], dim=2)  # (B, T, C) each: every key and value
        x = self.ln_1(x[:, :1] + self.attn.attend(q[:, :1], k, v, mask))
        x = self.ln_2(x + self.mlp(x))
        return x


# ---------------------------------------------------------------------------------------------
# The encoder with its pooler

def _init_weights(module: nn.Module) -> None:
    """BERT's init: N(0, 0.02) for every matrix and embedding, biases 0, LayerNorm 1/0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Bert(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        # Embeddings: token + segment (A/B) + learned position, then LayerNorm and dropout.
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, padding_idx=config.pad_token_id)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.wse = nn.Embedding(config.type_vocab_size, config.n_embd)
        self.ln_e = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.drop = Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.pool = nn.Linear(config.n_embd, config.n_embd)
        self.reset_parameters()

    def reset_parameters(self):
        _init_weights(self)
        if self.config.pad_token_id is not None and 0 <= self.config.pad_token_id < self.config.vocab_size:
            with torch.no_grad():
                self.wte.weight[self.config.pad_token_id].zero_()   # as nn.Embedding(padding_idx=...)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def backbone(self) -> Bert:
        """The encoder itself (a model with heads names its encoder so)."""
        return self

    def _check(self, idx, segment_ids, attention_mask):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a 2-D (B, T) tensor of token ids, got {shape}")
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"idx is empty: batch size {B}, sequence length {T}; both must be > 0")
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the context block_size="
                             f"{self.config.block_size}; truncate the input")
        check_ids(idx, self.config.vocab_size, "idx", "vocab_size")
        if segment_ids is not None:
            if tuple(segment_ids.shape) != (B, T):
                raise ValueError(f"segment_ids must have shape (B, T) = ({B}, {T}), got {tuple(segment_ids.shape)}")
            check_ids(segment_ids, self.config.type_vocab_size, "segment_ids", "type_vocab_size")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must have shape (B, T) = ({B}, {T}), got {tuple(attention_mask.shape)}")

    def _embed(self, idx, segment_ids, attention_mask):
        """Checked inputs -> (x (B, T, C): token + segment + position embeddings after LayerNorm and dropout,
        key mask (B, 1, 1, T) of bool, True = real token, or None)."""
        self._check(idx, segment_ids, attention_mask)
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        x = x + (self.wse.weight[0] if segment_ids is None else self.wse(segment_ids))
        x = self.ln_e(x)
        if self.training and self.config.dropout > 0:
            x = self.drop(x)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(device=idx.device, dtype=torch.bool)[:, None, None, :]
        return x, mask

    def forward(self, idx, segment_ids=None, attention_mask=None):
        """idx (B, T), segment_ids (B, T) of 0/1 (default all 0), attention_mask (B, T) of 0/1
        (1 = real token, default all real) -> (hidden (B, T, C), pooled (B, C)).

        Ids outside [0, vocab_size) or [0, type_vocab_size) and T > block_size are a ValueError (on CUDA
        and under torch.compile the id range is checked on the device: see check_ids)."""
        x, mask = self._embed(idx, segment_ids, attention_mask)
        for block in self.h:
            x = block(x, mask)
        return x, torch.tanh(self.pool(x[:, 0]))    # the pooler reads the [CLS] position

    def pooled(self, idx, segment_ids=None, attention_mask=None):
        """forward(...)[1] alone -> pooled (B, C), what the sequence heads read. Every layer but the last
        runs in full; in the last, only the keys and values are computed at every position and the rest at
        the [CLS] row alone (Block.cls), as that is all the pooler reads. Same numbers as forward up to
        fp32 rounding (another split of the same matmuls)."""
        x, mask = self._embed(idx, segment_ids, attention_mask)
        for block in self.h[:-1]:
            x = block(x, mask)
        x = self.h[-1].cls(x, mask)                       # (B, 1, C)
        return torch.tanh(self.pool(x[:, 0]))


# ---------------------------------------------------------------------------------------------
# Pretraining heads (losses live outside: duolm.train)

class BertMLMHead(nn.Module):
    """Masked LM: dense + GELU + LayerNorm, then the decoder tied to the token embedding (its
    weight is Bert's wte, not a copy) plus an own output bias. h (..., C) -> logits (..., vocab)."""

    def __init__(self, config: BertConfig, wte: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.n_embd, config.n_embd)
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.decoder = TiedLinear(wte)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        _init_weights(self)

    def forward(self, h):
        h = self.ln(F.gelu(self.dense(h)))
        return self.decoder(h) + self.bias


class BertNSPHead(nn.Module):
    """Next sentence prediction: 2-way classifier on the pooled [CLS] state (0 = B follows A)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2)
        _init_weights(self)

    def forward(self, pooled):
        return self.fc(pooled)


class BertForPreTraining(nn.Module):
    """Bert + MLM head + NSP head; state dict keys bert.*, mlm.*, nsp.*."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = Bert(config)
        self.mlm = BertMLMHead(config, self.bert.wte)
        self.nsp = BertNSPHead(config)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def backbone(self) -> Bert:
        """The encoder under the pretraining heads."""
        return self.bert

    def forward(self, idx, segment_ids=None, attention_mask=None, mlm_positions=None):
        """-> (mlm_logits (B, T, vocab), nsp_logits (B, 2)).

        mlm_positions (B, T) of bool: the MLM head runs at its True positions alone and mlm_logits is (N, vocab),
        their rows in row-major order — as the original implementation gathers the masked positions before the
        head: pretraining predicts ~15% of them, and the head's 30522-wide product is a fifth of BERT-base's."""
        hidden, pooled = self.bert(idx, segment_ids, attention_mask)
        if mlm_positions is not None:
            hidden = hidden[mlm_positions]
        return self.mlm(hidden), self.nsp(pooled)
