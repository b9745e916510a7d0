"""Weight-only int8 / bf16 decoding for GPT-2 on CPU (opt-in).

Batch-1 decoding is memory-bound: every token reads every weight once. Storing the matmul weights
in 1 byte (int8, one fp scale per output row) or 2 bytes (bf16) instead of 4 reads fewer bytes per
token. Activations, LayerNorms, the residual stream and the KV cache stay fp32; only the matmuls
(the blocks' linears and the tied output layer) use the narrow weights, each computed in bf16 with
its result returned as fp32. Embedding lookups read a few rows and keep the fp32 table.

    q = quantize(model, "int8")      # a new module; the model is left as it is
    generate(q, prompts, ...)        # same interface: config, hidden(), head(), forward()
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


class WeightOnlyGPT2(nn.Module):
    """A GPT2 whose linears and tied output layer read int8 or bf16 weights (inference only).
    Same interface as GPT2 for generation: config, wte, hidden(), head(), forward()."""

    def __init__(self, model: nn.Module, mode: str):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"weight-only mode {mode!r} is not one of {MODES}")
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

    @property
    def wte(self):
        return self.inner.wte

    def hidden(self, idx, attention_mask=None, cache=None):
        return self.inner.hidden(idx, attention_mask, cache)

    def head(self, h):
        if self.mode == "int8":
            return _int8_matmul(h, self.head_int8, self.head_scale)
        return F.linear(h.to(torch.bfloat16), self.head_bf16).float()

    def forward(self, idx, attention_mask=None, cache=None):
        return self.head(self.hidden(idx, attention_mask, cache))


def quantize(model: nn.Module, mode: str = "int8") -> WeightOnlyGPT2:
    """A weight-only int8 or bf16 copy of a GPT2 for decoding; `model` is not modified."""
    if not hasattr(model, "hidden") or not hasattr(model, "wte"):
        raise ValueError(f"quantize() takes a GPT2 model, got {type(model).__name__}")
    return WeightOnlyGPT2(model, mode)
