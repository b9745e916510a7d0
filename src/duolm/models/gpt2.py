"""GPT-2 (Radford et al., 2019): a decoder-only Transformer trained as a causal language model.

Read top to bottom like the paper: config and presets, the key/value cache, attention, MLP, the
pre-LN block, and the model. Module names are OpenAI's (wte, wpe, h, ln_1, attn.c_attn, mlp.c_fc,
ln_f) so checkpoints map one to one; weights are nn.Linear (out, in), not OpenAI's Conv1D (in, out).

    h_0 = U W_e + W_p                        token embedding + learned position embedding
    h_l = block(h_{l-1}),  l = 1..n          pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x))
    P(u) = softmax(ln_f(h_n) W_e^T)          the output layer is tied to the token embedding
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from duolm.models.dropout import Dropout, attention


# ---------------------------------------------------------------------------------------------
# Config

# Largest sizes a config may declare (far above every released model), checked before allocation.
LIMITS = {"vocab_size": 1 << 22, "block_size": 1 << 20, "n_layer": 1024, "n_head": 1024, "n_embd": 1 << 16}
# The embedding matrix has vocab_size rows rounded up to this multiple, so that the output matmul writes
# rows of logits aligned to whole cache lines and SIMD blocks (GPT-2's odd 50,257 is not). The padding
# rows are zero, sliced off the logits (GPT2.head) and refused as ids (check_ids).
VOCAB_ALIGN = 64


def check_sizes(config, limits: dict) -> None:
    """Every size field an int in [1, its limit]: ValueError naming the field and the limit."""
    for name, limit in limits.items():
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit:
            raise ValueError(f"{name}={v!r} must be an integer in [1, {limit}]")


def check_ids(ids: torch.Tensor, n: int, name: str, limit: str) -> None:
    """Every id in [0, n), or a ValueError naming the first one outside, its position and the range.
    Worked example: check_ids(torch.tensor([[5, 512]]), 500, "idx", "vocab_size") raises
    ValueError("idx[0, 1] = 512 is outside [0, vocab_size=500)").

    The ids index embedding tables whose rows past n are padding (GPT-2's aligned vocabulary) or do not
    exist. On CPU the check reads the ids directly. Reading CUDA ids back would be a host-device sync per
    forward, and a data-dependent `if` cannot be traced by torch.compile, so on CUDA and while compiling
    it is torch._assert_async, queued with the forward: a bad id fails at the next synchronization, as a
    RuntimeError on CPU and as a device-side assert on CUDA (which leaves the CUDA context unusable). Ids
    still on the host are checked where they enter (tokenizers, data loaders, generate, fill_mask)."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer ids (int64), got dtype {ids.dtype}")
    if ids.device.type == "cuda" or torch.compiler.is_compiling():
        torch._assert_async(((ids >= 0) & (ids < n)).all(), f"{name}: an id is outside [0, {limit}={n})")
        return
    lo, hi = torch.aminmax(ids)
    if lo < 0 or hi >= n:
        where = ((ids < 0) | (ids >= n)).nonzero()[0].tolist()
        bad = ids[tuple(where)].item()
        raise ValueError(f"{name}[{', '.join(map(str, where))}] = {bad} is outside [0, {limit}={n})")


@dataclass
class GPT2Config:
    """Architecture facts (sizes are bounded by LIMITS, so a config file cannot ask for 2**40 rows)."""

    family: ClassVar[str] = "gpt2"     # which model family: every model of it has a config with this
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        check_sizes(self, LIMITS)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding matrix: vocab_size rounded up to a multiple of 64 (see GPT2.head)."""
        return -(-self.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPT2Config":
        if name not in GPT2_PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(GPT2_PRESETS)}")
        return cls(**{**GPT2_PRESETS[name], **overrides})


# The released GPT-2 sizes (paper: 117M/345M/762M/1542M; exact counts with the tied embedding
# counted once: 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200).
GPT2_PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    "tiny": dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64),
}


# ---------------------------------------------------------------------------------------------
# Key/value cache: explicit state handed to forward (the model holds none)

class KVCache:
    """Preallocated keys and values, one (B, n_head, max_len, head_dim) pair per layer.

    `forward(idx, cache=cache)` writes the T new positions at [length, length + T) and advances
    `length` by T, so decoding one token costs one position. `reorder(index)` selects batch rows
    (beam search)."""

    def __init__(self, config: GPT2Config, batch_size: int, max_len: int | None = None,
                 device=None, dtype=None):
        max_len = config.block_size if max_len is None else max_len
        if batch_size < 1 or not 1 <= max_len <= config.block_size:
            raise ValueError(f"KVCache needs batch_size >= 1 (got {batch_size}) and "
                             f"1 <= max_len <= block_size={config.block_size} (got {max_len})")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        shape = (batch_size, config.n_head, max_len, config.head_dim)
        # Positions >= length are never read, so the buffers need no zeroing.
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (B',) in that order, e.g. the surviving beams."""
        index = index.to(self.k[0].device)
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]


# ---------------------------------------------------------------------------------------------
# Causal self-attention

def one_query_attention(q, k, v, mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) under mask) v for one query a row, as products and sums in fp32: q (B, nh, 1, hd),
    k and v (B, nh, L, hd), mask bool (B, 1, 1, L) or None (every column) -> (B, nh, 1, hd) in v's dtype. A static decode step's attention
    (GPT2.step), which torch.compile fuses into three small reductions (the scores, the softmax, the weighted sum): a
    fused attention kernel tiles many queries, and for one query over the cache it cost a compiled GPU step more
    than its matrix products in fp32 (docs/benchmarks.md, the static step).

    With hd = 2, one row, one head, L = 3 columns of which the last is masked, q = [2, 0], keys [1, 0], [0, 1], [5, 5]:
    scores [2, 0] / sqrt(2) = [1.414, 0], softmax [0.804, 0.196], so values [1, 1], [3, 5], [9, 9] give
    0.804 [1, 1] + 0.196 [3, 5] = [1.39, 1.78].

    OneQueryAttention runs it; quantize() on a CPU where duolm.kernels run swaps in one call of theirs."""
    scores = (q.float() * k.float()).sum(-1) * q.shape[-1] ** -0.5                   # (B, nh, L)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, 0], float("-inf"))
    weights = scores.softmax(-1)
    return (weights[..., None] * v.float()).sum(-2, keepdim=True).to(v.dtype)


class OneQueryAttention(nn.Module):
    """Decoding's attention, one query a row over the cache: one_query_attention(q, k, v, mask) in a static step. A
    module of its own so that a faster one can be swapped in, visibly (print(model)): duolm.precision.KernelAttention,
    one fused call that also runs the eager decoding step's attention (`fused`), where plain torch runs SDPA."""

    fused = False

    def forward(self, q, k, v, mask):
        return one_query_attention(q, k, v, mask)


class Attention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)   # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = Dropout(config.dropout)
        self.one_query = OneQueryAttention()

    def forward(self, x, mask=None, kv=None):
        """x (B, T, C). mask: None (plain causal) or bool (B|1, 1, T, past + T), True = may attend.
        kv: None or (k_buf, v_buf, past) of this layer's cache; the new keys/values go in at past (an int), or at
        column `past` (a (1,) tensor: a static step, which attends over the whole buffer under its mask)."""
        B, T, C = x.shape
        # (B, T, 3C) -> q, k, v (B, nh, T, hd) as strided views; SDPA takes them without copies.
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if kv is not None and isinstance(kv[2], torch.Tensor):   # a static step (GPT2.step)
            k_buf, v_buf, at = kv
            k, v = k_buf.index_copy_(2, at, k), v_buf.index_copy_(2, at, v)   # the whole cache; the mask hides the rest
            y = self.one_query(q, k, v, mask)
        else:
            if kv is not None:
                k_buf, v_buf, past = kv
                k_buf.narrow(2, past, T).copy_(k)
                v_buf.narrow(2, past, T).copy_(v)
                k, v = k_buf.narrow(2, 0, past + T), v_buf.narrow(2, 0, past + T)
            if T == 1 and kv is not None and self.one_query.fused:
                y = self.one_query(q, k, v, mask)                   # decoding, on a fused kernel swapped in
            else:
                # Without a mask, SDPA's is_causal (top-left aligned) is exact when there is no past;
                # with a past, GPT2 builds the mask except for T == 1, where every key is visible.
                y = attention(q, k, v, mask, self.dropout if self.training else 0.0, is_causal=mask is None and T > 1)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_drop(y) if self.training and self.dropout > 0 else y


# ---------------------------------------------------------------------------------------------
# Position-wise MLP: C -> 4C -> C with GELU in GPT-2's tanh form

class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.dropout = config.dropout
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = Dropout(config.dropout)

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return self.drop(y) if self.training and self.dropout > 0 else y


# ---------------------------------------------------------------------------------------------
# Pre-LN Transformer block (GPT-2 moved LayerNorm to each sub-block's input)

class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, mask=None, kv=None):
        x = x + self.attn(self.ln_1(x), mask, kv)
        x = x + self.mlp(self.ln_2(x))
        return x


# ---------------------------------------------------------------------------------------------
# The model

def _trim_vocab_padding(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: checkpoints hold the real vocabulary rows only."""
    key = prefix + "wte.weight"
    if key in state_dict:
        state_dict[key] = state_dict[key][: module.config.vocab_size]


class TiedLinear(nn.Module):
    """The output layer tied to the token embedding (GPT-2 section 2.3; BERT's MLM decoder too): h (..., C) ->
    h @ wte.weight^T. The embedding is held in a tuple, not registered again, so its weight is saved once (as
    wte's); .to() and load_state_dict(assign=True) follow it. duolm.precision.quantize swaps it as it swaps an
    nn.Linear."""

    bias = None

    def __init__(self, wte: nn.Embedding):
        super().__init__()
        self._wte = (wte,)

    @property
    def weight(self) -> torch.Tensor:
        return self._wte[0].weight

    def forward(self, h):
        return F.linear(h, self.weight)

    def extra_repr(self):
        n, c = self.weight.shape
        return f"in_features={c}, out_features={n}, bias=False, tied to the token embedding"


def _restore_vocab_padding(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """load_state_dict pre-hook: append the (zero) padding rows to an unpadded wte."""
    key = prefix + "wte.weight"
    w = state_dict.get(key)
    cfg = module.config
    if w is not None and w.dim() == 2 and w.shape[0] == cfg.vocab_size:
        pad = w.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, w.shape[1])
        state_dict[key] = torch.cat([w, pad])


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = TiedLinear(self.wte)      # weight tying: the output layer is wte, transposed
        # The padding rows exist inside the model only: state dicts and checkpoints hold vocab_size rows.
        self.register_state_dict_post_hook(_trim_vocab_padding)
        self.register_load_state_dict_pre_hook(_restore_vocab_padding)
        self.reset_parameters()

    def reset_parameters(self):
        """N(0, 0.02) everywhere, biases 0, LayerNorm 1/0; the projections that write into the
        residual stream (attn.c_proj, mlp.c_proj) get std 0.02/sqrt(2 n_layer), since each of the
        2 n_layer residual branches adds its variance to the stream (GPT-2 paper, section 2.3)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, 0.0, 0.02)
        with torch.no_grad():
            self.wte.weight[self.config.vocab_size:].zero_()   # padding rows stay 0 (no gradient reaches them)

    def num_params(self) -> int:
        """Parameters with the tied embedding counted once and vocabulary padding excluded."""
        pad = (self.config.padded_vocab_size - self.config.vocab_size) * self.config.n_embd
        return sum(p.numel() for p in self.parameters()) - pad

    @property
    def backbone(self) -> GPT2:
        """The decoder itself (a model with a head names its decoder so)."""
        return self

    def _check(self, idx, attention_mask, cache, positions):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a 2-D (B, T) tensor of token ids, got {shape}")
        B, T = idx.shape
        if B == 0 or T == 0:
            raise ValueError(f"idx is empty: batch size {B}, sequence length {T}; both must be > 0")
        check_ids(idx, self.config.vocab_size, "idx", "vocab_size")
        past = 0 if cache is None else cache.length
        if positions is None and past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} (cache {past} + new {T}) exceeds the "
                             f"context block_size={self.config.block_size}; truncate the input")
        if cache is not None and (cache.batch_size != B or past + T > cache.max_len):
            raise ValueError(f"cache holds batch {cache.batch_size} x {cache.max_len} positions "
                             f"({past} used); got batch {B} with {T} new tokens")
        if positions is not None:
            if tuple(positions.shape) != (B, T) or attention_mask is None or attention_mask.dtype != torch.bool \
                    or tuple(attention_mask.shape) != (B, T, past + T):
                raise ValueError(f"packed sequences need positions (B, T) = ({B}, {T}) and a bool attention_mask "
                                 f"(B, T, past + T) = ({B}, {T}, {past + T})")
            check_ids(positions, self.config.block_size, "positions", "block_size")
            return
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask must have shape (B, past + T) = ({B}, {past + T}), "
                             f"got {tuple(attention_mask.shape)}")

    def hidden(self, idx, attention_mask=None, cache=None, positions=None):
        """idx (B, T) of ids in [0, vocab_size) -> hidden states (B, T, n_embd) after ln_f. An id outside
        that range (the padding rows of wte included) or past + T > block_size is a ValueError (on CUDA
        and under torch.compile the id range is checked on the device: see check_ids).

        attention_mask (B, past + T) of 0/1 marks left padding (1 = real token); positions then
        count real tokens only, so a padded row gives the same values as the unpadded row. With
        a cache, the T new keys/values are written into it and cache.length advances by T.

        positions (B, T) with a bool attention_mask (B, T, past + T): packed sequences, each token at the
        position given, seeing the keys its row of the mask marks (serve/prefill.py packs prompts so). Two
        prompts [p, a, b] and [p, a, c], p cached at column 0: new tokens a, b, c at positions [1, 2, 2],
        mask rows [1 1 0 0], [1 1 1 0], [1 1 0 1] (a computed once, b and c each after it)."""
        self._check(idx, attention_mask, cache, positions)
        B, T = idx.shape
        past = 0 if cache is None else cache.length
        S = past + T
        device = idx.device
        mask = None
        if positions is not None:                                          # packed
            pos_emb, mask = self.wpe(positions), attention_mask[:, None]     # (B, T, C), (B, 1, T, S)
        elif attention_mask is None:
            pos_emb = self.wpe.weight[past:S]                                 # (T, C)
            if past > 0 and T > 1:   # new queries see the whole past and causally among themselves
                q_pos = torch.arange(past, S, device=device)[:, None]
                mask = torch.arange(S, device=device)[None, :] <= q_pos       # (T, S)
        else:
            real = attention_mask.to(device=device, dtype=torch.bool)            # (B, S)
            pos = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]           # (B, T)
            pos_emb = self.wpe(pos)
            q_pos = torch.arange(past, S, device=device)[:, None]
            k_pos = torch.arange(S, device=device)[None, :]
            # Causal, real keys only; every query also sees itself so a padding row (no real key
            # yet) stays finite. Real queries never see padding keys.
            mask = (k_pos <= q_pos) & (real[:, None, :] | (k_pos == q_pos))    # (B, T, S)
            mask = mask[:, None]                                               # (B, 1, T, S)
        x = self.wte(idx) + pos_emb
        if self.training and self.config.dropout > 0:
            x = self.drop(x)
        for i, block in enumerate(self.h):
            kv = None if cache is None else (cache.k[i], cache.v[i], past)
            x = block(x, mask, kv)
        if cache is not None:
            cache.length = S
        return self.ln_f(x)

    def head(self, h):
        """Tied output layer: hidden (..., C) -> logits (..., vocab_size), a view of rows padded to
        padded_vocab_size floats (use .reshape or .view(-1, V), not a flat .view); the padding rows of
        wte are zero and are sliced off, so they never show."""
        return self.lm_head(h)[..., :self.config.vocab_size]

    def step(self, idx, pos, keys, cache, at):
        """One new position of every row, in shapes that never change (what a compiled step or a CUDA graph
        replays): idx (B, 1) the new ids, pos (B, 1) their positions (the real tokens before each), at (1,) the
        cache column they are written to, keys (B, L) bool the columns each row attends to (its real tokens, the
        new one included) -> logits (B, 1, vocab_size). The cache's whole length L is attended under that mask;
        nothing is checked (no host sync): duolm.generation.static keeps the invariants."""
        x = self.wte(idx) + self.wpe(pos)
        mask = keys[:, None, None, :]                                          # (B, 1, 1, L)
        for i, block in enumerate(self.h):
            x = block(x, mask, (cache.k[i], cache.v[i], at))
        return self.head(self.ln_f(x))

    def forward(self, idx, attention_mask=None, cache=None):
        """idx (B, T) -> logits (B, T, vocab_size). See hidden() for the mask and cache."""
        return self.head(self.hidden(idx, attention_mask, cache))
