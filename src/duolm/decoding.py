"""Faster GPT-2 decoding on CPU: the exact fp32 decode layout, and weight-only int8 / bf16 quantization.

Batch-1 decoding is memory-bound: every token reads every weight once. Storing the matmul weights
in 1 byte (int8, one fp scale per output row) or 2 bytes (bf16) instead of 4 reads fewer bytes per
token. Activations, LayerNorms, the residual stream and the KV cache stay fp32; only the matmuls
(the blocks' linears and the tied output layer) use the narrow weights, each computed in bf16 with
its result returned as fp32. Embedding lookups read a few rows and keep the fp32 table.

    fast = decode_layout(model)      # exact fp32, more tokens/s (the CLI's default)
    q = quantize(model, "int8")      # approximate: 1-byte weights
    generate(fast, prompts, ...)     # new modules with GPT2's interface; the model is left as it is

`decode_layout` changes no number (it is not a quantization): it keeps fp32 and only changes which
kernel a few-row matmul meets, as GPT2 itself computes every matmul the plain way:

  * one row (batch-1 decoding): the matrices that gain from it get a contiguous (in, out) copy beside
    their (out, in) weight, read as x @ W_t. MKL's single-row kernel streams that layout faster on CPU,
    as transformers' Conv1D (in, out) weights do; see DECODE_KINDS.
  * 2-16 rows (a decoding batch): the tied output layer, the largest matrix, is multiplied in slices
    of its vocabulary rows (sliced_head): MKL picks a poor kernel for so few rows against a whole
    (V, C) matrix, and a good one for each slice.

The cost is memory: the transposed copies sit beside the shared originals (for GPT-2 124M, +226 MB for
the blocks' c_attn / attn.c_proj / c_fc and +154 MB for the tied output layer, whose (out, in) matrix is
the token embedding wte). benchmarks/generation.py measures the speed against the plain model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ("int8", "bf16")


def _int8_rows(w: torch.Tensor):
    """Symmetric per-output-row int8: w (N, K) ~= q (N, K) * scale (N, 1), |q| <= 127."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale_bf16: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (q * scale).T -> (..., N) fp32, reading 1 byte per weight.

    aten's _weight_int8pack_mm is the CPU kernel for weight-only int8 (bf16 activations); on other
    devices, or where it is missing, the weight is dequantized on the fly (correct, not faster)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    if x2.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        y = torch.ops.aten._weight_int8pack_mm(x2, q, scale_bf16)
    else:
        y = F.linear(x2, q.to(torch.bfloat16) * scale_bf16[:, None])
    return y.float().reshape(*shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """nn.Linear with an int8 weight and per-row scales; bias and output fp32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = _int8_rows(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                   requires_grad=False)

    def forward(self, x):
        y = _int8_matmul(x, self.weight_int8, self.scale)
        return y if self.bias is None else y + self.bias


class BF16Linear(nn.Module):
    """nn.Linear with a bf16 weight: the matmul runs in bf16, the output is fp32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16).clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                   requires_grad=False)

    def forward(self, x):
        y = F.linear(x.to(torch.bfloat16), self.weight_bf16).float()
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------------------------------------
# fp32 decode layout: (in, out) copies for few-row matmuls

# Which matrices get an (in, out) copy: those whose single-row matmul streams the (in, out) layout faster
# (benchmarks/generation.py measures each). mlp.c_proj, the one (4C -> C) matrix, streams faster as
# (out, in) and keeps it; the output layer's copy is DecodeGPT2.head_t.
DECODE_KINDS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc")
# At most this many rows (sequences x new positions) take the (in, out) copies; larger inputs (prefill,
# batches) are faster through the shared (out, in) originals.
DECODE_MAX_ROWS = 1
# 2..HEAD_SLICE_ROWS rows multiply the output layer in slices of HEAD_SLICE vocabulary rows (sliced_head).
HEAD_SLICE_ROWS = 16
HEAD_SLICE = 1024


def sliced_head(h: torch.Tensor, w: torch.Tensor, vocab_size: int, block: int = HEAD_SLICE) -> torch.Tensor:
    """h (..., C) @ w[:vocab_size].T -> logits (..., vocab_size), a view of rows of w.shape[0] floats as
    GPT2.head returns, computed as one matmul per `block` rows of w (V_padded, C) into one output.
    Each slice is the same dot products as the whole matmul: only the kernel differs. No autograd (the
    slices are written in place); h and w of one dtype."""
    rows = h.numel() // h.shape[-1]
    h2 = h.reshape(rows, -1)
    out = h.new_empty(rows, w.shape[0])
    for i in range(0, w.shape[0], block):
        torch.mm(h2, w[i:i + block].t(), out=out[:, i:i + block])
    return out.view(*h.shape[:-1], -1)[..., :vocab_size]


class DecodeLinear(nn.Module):
    """nn.Linear sharing the original weight and bias, plus a contiguous (in, out) copy of the
    weight that inputs of at most `max_rows` rows multiply: same fp32 values, another kernel."""

    def __init__(self, linear: nn.Linear, max_rows: int = DECODE_MAX_ROWS):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias                 # shared, not copied
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())   # (in, out)
        self.max_rows = max_rows

    def forward(self, x):
        if x.numel() > self.max_rows * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class _GPT2ForDecoding(nn.Module):
    """What generation needs of a GPT2 (config, wte, hidden(), head(), forward()) around `inner`, a
    copy of the model with some linears swapped; subclasses give the output layer, head()."""

    @property
    def wte(self):
        return self.inner.wte

    def hidden(self, idx, attention_mask=None, cache=None):
        return self.inner.hidden(idx, attention_mask, cache)

    def forward(self, idx, attention_mask=None, cache=None):
        return self.head(self.hidden(idx, attention_mask, cache))


class DecodeGPT2(_GPT2ForDecoding):
    """A GPT2 for fp32 decoding: the matrices in `kinds` and the tied output layer get an (in, out)
    copy used for inputs of at most `max_rows` rows (DecodeLinear, head_t), and the output layer of a
    decoding batch is computed in vocabulary slices (head); every other tensor is the original's, shared.
    Logits equal the plain model's up to fp32 rounding (another summation order).
    Same interface as GPT2 for generation: config, wte, hidden(), head(), forward()."""

    def __init__(self, model: nn.Module, kinds=DECODE_KINDS, head=True, max_rows: int = DECODE_MAX_ROWS):
        super().__init__()
        self.mode = "decode"
        self.config = model.config
        self.max_rows = max_rows
        # A structural copy: the memo maps every parameter and buffer to itself, so nothing is duplicated.
        memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        inner = copy.deepcopy(model, memo)
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name.endswith(tuple(kinds)):
                parent_name, _, attr = name.rpartition(".")
                setattr(inner.get_submodule(parent_name), attr, DecodeLinear(m, max_rows))
        self.inner = inner.eval()
        # (C, V_padded): the tied output layer in (in, out) layout, rows of a multiple of 64 floats as
        # GPT2.head returns them; wte itself stays (V_padded, C) for lookups.
        self.register_buffer("head_t", model.wte.weight.detach().t().contiguous() if head else None)

    def head(self, h):
        """The tied output layer for the row count at hand: one row through the (in, out) copy head_t,
        2..HEAD_SLICE_ROWS rows without autograd in vocabulary slices (sliced_head), more rows (prefill
        of a batch, training) as GPT2.head. The same logits up to fp32 rounding."""
        rows = h.numel() // h.shape[-1]
        if self.head_t is not None and rows <= self.max_rows:
            return (h @ self.head_t)[..., :self.config.vocab_size]
        w = self.inner.wte.weight
        if 1 < rows <= HEAD_SLICE_ROWS and not torch.is_grad_enabled() and h.dtype == w.dtype:
            return sliced_head(h, w, self.config.vocab_size)
        return self.inner.head(h)


# ---------------------------------------------------------------------------------------------
# weight-only int8 / bf16

class WeightOnlyGPT2(_GPT2ForDecoding):
    """A GPT2 whose linears and tied output layer read int8 or bf16 weights (inference only).
    Same interface as GPT2 for generation: config, wte, hidden(), head(), forward()."""

    def __init__(self, model: nn.Module, mode: str):
        super().__init__()
        if mode not in ("int8", "bf16"):
            raise ValueError(f"weight-only mode {mode!r} is not one of ('int8', 'bf16')")
        self.mode = mode
        self.config = model.config
        wrap = Int8Linear if mode == "int8" else BF16Linear
        # Deep-copy the embeddings/norms, but not the fp32 linear weights we are about to replace.
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        memo = {id(m.weight): None for m in linears.values()}
        inner = copy.deepcopy(model, memo)
        for name, lin in linears.items():
            parent_name, _, attr = name.rpartition(".")
            parent = inner.get_submodule(parent_name) if parent_name else inner
            setattr(parent, attr, wrap(lin))
        self.inner = inner.eval().requires_grad_(False)
        V = model.config.vocab_size
        w = model.wte.weight[:V]
        if mode == "int8":
            q, scale = _int8_rows(w)
            self.register_buffer("head_int8", q)
            self.register_buffer("head_scale", scale.to(torch.bfloat16))
        else:
            self.register_buffer("head_bf16", w.detach().to(torch.bfloat16).clone())

    def head(self, h):
        if self.mode == "int8":
            return _int8_matmul(h, self.head_int8, self.head_scale)
        return F.linear(h.to(torch.bfloat16), self.head_bf16).float()


def _check_gpt2(model):
    if not hasattr(model, "hidden") or not hasattr(model, "wte"):
        raise ValueError(f"takes a GPT2 model, got {type(model).__name__}")


def decode_layout(model: nn.Module) -> nn.Module:
    """A GPT2 for fp32 decoding on CPU with the same numbers and more tokens/s (DecodeGPT2): (in, out)
    copies of the matrices that one-row matmuls read faster, and the output layer in vocabulary slices
    for 2-16 rows. Everything else is shared with `model`, which is left as it is. Costs ~380 MB more
    for GPT-2 124M."""
    _check_gpt2(model)
    return DecodeGPT2(model)


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """A GPT2 with weight-only "int8" or "bf16" matmul weights (WeightOnlyGPT2; slightly different
    numbers, fewer bytes read per token); `model` is not modified."""
    _check_gpt2(model)
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r} is not one of {MODES} (for the exact fp32 layout "
                         f"use decode_layout)")
    return WeightOnlyGPT2(model, mode)
