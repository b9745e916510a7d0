"""Dropout as both model families run it in training, and attention with dropout on the attention weights.

On the CPU, PyTorch draws a Bernoulli variate per element for F.dropout, and its scaled-dot-product attention with
dropout falls back to its math path doing the same for every attention weight: several times slower than the rest
of a dropout layer (benchmarks/models.py, bert-train, times a BERT step). Here the masks come from 16 random bits
per element, two elements per 32-bit draw of torch's generator (so torch.manual_seed reproduces them and a resumed
run continues them), and attention with dropout is that math written out. On other devices (CUDA's fused kernels)
and without dropout, PyTorch's own calls run.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def dropout_cut(p: float) -> tuple[int, float]:
    """Dropout from 16 random bits per element: an element is kept when its bits, read as an int16, are at
    least `cut`, and kept values are multiplied by `scale` so their mean is the input's. The probability of
    dropping is p rounded to a multiple of 1/65536.

    >>> dropout_cut(0.1)                # 6554 of the 65536 values (-32768 .. -26215) drop: p = 0.100006
    (-26214, 1.1111186463666882)
    """
    drop = round(p * 65536)
    return drop - 32768, 65536 / (65536 - drop)


def dropout_keep(shape, p: float) -> tuple[torch.Tensor, float]:
    """(keep, scale): a bool mask of `shape` and the factor for kept values (dropout_cut), its bits drawn from
    torch's CPU generator two elements per 32-bit draw."""
    n = math.prod(shape)
    bits = torch.randint(-2**31, 2**31, ((n + 1) // 2,), dtype=torch.int32).view(torch.int16)[:n]
    cut, scale = dropout_cut(p)
    return (bits >= cut).view(shape), scale


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training): on the CPU with dropout_keep's mask, elsewhere PyTorch's."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    keep, scale = dropout_keep(x.shape, p)
    return torch.where(keep, x, 0.0).mul_(scale)


class Dropout(nn.Dropout):
    """nn.Dropout through dropout()."""

    def forward(self, x):
        return dropout(x, self.p, self.training)


def attention(q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal); with dropout on the CPU, its formula
    written out, dropout() on the attention weights: softmax(q k^T / sqrt(d) + mask) v, the softmax in fp32 (as
    under autocast). mask: bool (True = may attend) or additive."""
    if dropout_p == 0 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if is_causal:
        mask = torch.ones(att.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else att + mask
    return dropout(att.float().softmax(-1), dropout_p) @ v
