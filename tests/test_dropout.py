"""duolm.models.dropout: the CPU's dropout masks (16 bits an element) and attention with dropout written out,
against their formulas and SDPA."""
import doctest

import pytest
import torch
import torch.nn.functional as F

from duolm.models import dropout as dropout_module
from duolm.models.dropout import Dropout, attention, dropout, dropout_keep


def test_dropout_cut_worked_example():
    assert doctest.testmod(dropout_module).failed == 0


def test_dropout_keep_drops_p_and_keeps_the_mean():
    torch.manual_seed(0)
    keep, scale = dropout_keep((1000, 1000), 0.1)
    p = 6554 / 65536                                   # 0.1 to 1/65536 (dropout_cut's worked example)
    assert keep.dtype == torch.bool and scale == 1 / (1 - p)
    assert abs((~keep).float().mean().item() - p) < 5 * (p * (1 - p) / 1e6) ** 0.5
    # both 16-bit halves of a 32-bit draw are fair and independent: at p = 0.5 an element keeps its sign bit
    torch.manual_seed(1)
    low, high = dropout_keep((500_000, 2), 0.5)[0].float().unbind(1)
    for share in (low.mean(), high.mean(), (low == high).float().mean()):
        assert abs(share.item() - 0.5) < 0.003           # 4 standard deviations
    torch.manual_seed(0)
    assert torch.equal(dropout_keep((1000, 1000), 0.1)[0], keep)        # torch's generator: reproducible


def test_training_dropout_is_keep_times_scale_forward_and_backward():
    """Dropout on the CPU: y = x * keep * scale with the mask dropout_keep draws from the same generator state,
    gradient keep * scale; off in eval mode, p = 0 untouched."""
    x = torch.randn(4, 7, 33, requires_grad=True)
    drop = Dropout(0.25)
    torch.manual_seed(5)
    y = drop(x)
    torch.manual_seed(5)
    keep, scale = dropout_keep(x.shape, 0.25)
    assert 0 < keep.sum() < keep.numel()
    torch.testing.assert_close(y, x.detach() * keep * scale, atol=0, rtol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep * scale * torch.ones_like(x), atol=0, rtol=0)
    assert torch.equal(drop.eval()(x), x) and torch.equal(dropout(x, 0.0), x)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal", "float"])
def test_attention_with_dropout_is_sdpa_math_with_the_drawn_mask(mask_kind):
    """attention() with dropout on the CPU: softmax(q k^T / sqrt(d) + mask) with dropout_keep's mask, times v — the
    math PyTorch's CPU SDPA runs with dropout on, here with the faster mask; without dropout SDPA itself."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    kwargs = {"none": {}, "causal": {"is_causal": True},
              "bool": {"attn_mask": torch.rand(2, 1, 1, 6) > 0.3},
              "float": {"attn_mask": torch.randn(2, 1, 6, 6)}}[mask_kind]
    torch.manual_seed(7)
    mask, causal = kwargs.get("attn_mask"), kwargs.get("is_causal", False)
    got = attention(q, k, v, mask, 0.2, causal)
    plain = attention(q, k, v, mask, 0.0, causal)
    torch.manual_seed(7)
    keep, scale = dropout_keep((2, 3, 6, 6), 0.2)
    att = q @ k.transpose(-2, -1) / 8 ** 0.5
    if mask_kind == "bool":
        att = att.masked_fill(~kwargs["attn_mask"], float("-inf"))
    elif mask_kind == "causal":
        att = att.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    elif mask_kind == "float":
        att = att + kwargs["attn_mask"]
    want = (att.softmax(-1) * keep * scale) @ v
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(plain, F.scaled_dot_product_attention(q, k, v, **kwargs), atol=0, rtol=0)
    torch.testing.assert_close(plain, att.softmax(-1) @ v, atol=1e-6, rtol=1e-5)    # the same formula


def test_attention_with_dropout_under_bf16_autocast():
    """Under bf16 autocast: bf16 out, as SDPA under autocast, and the fp32 formula's numbers to bf16's precision
    (the softmax is taken in fp32)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention(q, k, v, None, 0.2, is_causal=True)
    torch.manual_seed(7)
    want = attention(q, k, v, None, 0.2, is_causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
