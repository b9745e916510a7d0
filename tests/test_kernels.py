"""duolm.kernels: the fp32 product of a few rows against F.linear, the AVX512-VNNI int8 product against its formula
in torch ops (int8_reference(): the same u8, exact sums), both at GPT-2's shapes and at widths that are no multiple of
their blocks; KernelLinear and Int8Linear running them on the row counts they are for; an int8 row's result the same
in any batch; torch.compile over models that hold them; the fallback where they do not build. On a CPU without
AVX-512 (fp32) or AVX512-VNNI (int8) they do not run, and the tests that run them say so as they skip."""
from __future__ import annotations

import copy
import doctest

import pytest
import torch

import torch.nn.functional as F

from duolm import kernels
from duolm import precision
from duolm.precision import KERNEL_ROWS, WIDE_ROWS, Int8Linear, KernelLinear, int8_rows

vnni = pytest.mark.skipif(not precision.vnni_rows(), reason="this CPU lacks AVX512-VNNI: duolm.kernels' int8 kernel "
                          "does not run here (Int8Linear runs torch's x86 int8 kernels, tests/test_precision.py)")
fp32 = pytest.mark.skipif(not kernels.ready(), reason="this CPU lacks AVX-512: duolm.kernels' fp32 kernel does not "
                          "run here (PackedLinear or F.linear, tests/test_precision.py)")


def _weights(n, k, bias=True):
    q, scale = int8_rows(torch.randn(n, k) * 0.02)
    return q, scale, (q.float() * scale[:, None]).sum(1), torch.randn(n) if bias else None


def test_worked_examples():
    assert doctest.testmod(kernels).failed == 0                # the packs' layouts, int8_reference's arithmetic


@vnni
@pytest.mark.parametrize("n,k", [(2304, 768), (768, 3072), (50304, 768), (37, 100), (5, 13), (16, 4)])
def test_int8_kernel_is_its_formula(n, k):
    """GPT-2 124M's shapes (the tied output layer's padded 50,304 rows included) and widths that are no multiple of 16
    outputs or 4 inputs (the packing's zero padding), with and without a bias, from 1 to 41 rows (whole and partial
    tiles of 8): int8_reference()'s numbers within float rounding of the output's scale."""
    torch.manual_seed(n + k)
    for bias in (True, False):
        q, scale, row_sums, b = _weights(n, k, bias)
        packed = kernels.pack_int8(q)
        for m in (1, 2, 7, 8, 9, 16, 41):
            x = torch.randn(m, k) * 3
            got = kernels.int8_linear(x, packed, scale, row_sums, b)
            want = kernels.int8_reference(x, q, scale, row_sums, b)
            torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=0)


@vnni
def test_int8_constant_rows_and_shapes():
    """A constant row (span 0: every u8 0) gives its value times the row sums plus the bias, exactly as the
    reference; a 3-D input keeps its leading shape; no rows give an empty result; a width the weight was not
    packed for is an error."""
    torch.manual_seed(0)
    q, scale, row_sums, b = _weights(48, 40)
    packed = kernels.pack_int8(q)
    x = torch.randn(2, 3, 40)
    x[1, 2] = 0.5
    got = kernels.int8_linear(x, packed, scale, row_sums, b)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got[1, 2], 0.5 * row_sums + b, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, kernels.int8_reference(x, q, scale, row_sums, b), atol=1e-5, rtol=0)
    assert kernels.int8_linear(torch.empty(0, 40), packed, scale, row_sums, b).shape == (0, 48)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        kernels.int8_linear(torch.randn(2, 44), packed, scale, row_sums, b)


@vnni
def test_a_row_gets_the_same_numbers_in_any_batch():
    """Each row is quantized on its own and summed in exact integers: a row alone, beside a row of 100x larger values
    (another request, a padding position) and in a batch of 13 gives the same bits."""
    torch.manual_seed(1)
    q, scale, row_sums, b = _weights(3072, 768)
    packed = kernels.pack_int8(q)
    x = torch.randn(13, 768)
    x[5] *= 100
    batch = kernels.int8_linear(x, packed, scale, row_sums, b)
    for i in (0, 4, 12):
        assert torch.equal(kernels.int8_linear(x[i:i + 1], packed, scale, row_sums, b)[0], batch[i])
        assert torch.equal(kernels.int8_linear(x[[i, 5]], packed, scale, row_sums, b)[0], batch[i])


@vnni
@pytest.mark.parametrize("amx", [True, False])
def test_int8_linear_runs_the_kernel_below_wide_rows(amx, monkeypatch):
    """Int8Linear holds the packed weight and runs the kernel on fewer than WIDE_ROWS rows; WIDE_ROWS rows and more go
    to torch's kernels, oneDNN's where the CPU has AMX (then no fbgemm weight is kept), fbgemm's where it has not.
    Close to the exact product either way."""
    monkeypatch.setattr(precision, "amx_int8", lambda: amx)
    torch.manual_seed(2)
    lin = torch.nn.Linear(768, 2304)
    q = Int8Linear(lin.weight, lin.bias)
    assert q.packed_rows is not None and "AVX512-VNNI rows" in repr(q)
    assert (q.packed is None) == amx and (q.packed_wide is not None) == amx
    calls = []
    kernel = kernels.int8_linear
    monkeypatch.setattr(kernels, "int8_linear", lambda x, *a: calls.append(len(x)) or kernel(x, *a))
    for rows in (1, 8, WIDE_ROWS - 1, WIDE_ROWS, 100):
        x = torch.randn(rows, 768)
        with torch.no_grad():
            got, exact = q(x), lin(x)
        assert ((exact - got).norm() / exact.norm()).item() < 0.01
        assert (calls[-1:] == [rows]) == (rows < WIDE_ROWS)
        if rows < WIDE_ROWS:
            torch.testing.assert_close(got, kernels.int8_reference(x, q.qweight, q.scale, q.row_sums, q.bias),
                                       atol=1e-5, rtol=0)


@vnni
def test_compile_calls_the_kernel_as_an_operator():
    """torch.compile(fullgraph=True) over an int8 GPT-2 traces the kernel as the operator duolm_cpu::int8_linear (its
    shape function registered): the eager logits, the same bits."""
    from duolm.models import GPT2, GPT2Config

    torch.manual_seed(0)
    model = precision.quantize(GPT2(GPT2Config(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32)), "int8")
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        want = model(idx)
        got = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")(idx)
    assert torch.equal(got, want)


def test_without_avx512_or_without_a_build_torchs_kernels_run(monkeypatch):
    """A CPU without AVX-512 never builds the kernels (one without VNNI runs no int8 kernel); where the build fails (no
    compiler, say) a warning says so once, Int8Linear holds torch's packed weight and fp32 swaps to PackedLinear."""
    assert not kernels.available("avx2 fma") and not kernels.int8_supported("avx512f avx512bw")
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'duolm_kernels'")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    flags = "avx512f avx512bw avx512_vnni (a CPU of this test)"
    with pytest.warns(RuntimeWarning, match="did not build .*Error building extension"):
        assert not kernels.available(flags)
    assert not kernels.available(flags)                              # once: the answer is kept
    monkeypatch.setattr(precision, "_cpuinfo", lambda field: {"flags": flags, "vendor_id": "GenuineIntel"}.get(field))
    q = Int8Linear(torch.randn(32, 16), None)
    assert q.packed_rows is None and (q.packed is not None) == precision._works("int8")
    assert precision.fp32_engine() != "duolm" and precision._swap("fp32", torch.device("cpu")) is not KernelLinear


@fp32
@pytest.mark.parametrize("n,k", [(2304, 768), (768, 3072), (50304, 768), (37, 100), (5, 13)])
def test_fp32_kernel_is_f_linear(n, k):
    """GPT-2 124M's shapes and widths that are no multiple of 16 outputs, with and without a bias, 1 to 41 rows:
    F.linear's numbers within float rounding (the sums in another order)."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * 0.02
    packed = kernels.pack_fp32(w)
    for b in (torch.randn(n), None):
        for m in (1, 3, 8, 9, 32, 41):
            x = torch.randn(m, k)
            torch.testing.assert_close(kernels.fp32_linear(x, packed, b, n), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        kernels.fp32_linear(torch.randn(2, k + 1), packed, None, n)


@fp32
def test_kernel_linear_runs_the_kernel_up_to_kernel_rows(monkeypatch):
    """quantize(model, "fp32") swaps in KernelLinear where fp32_engine() is "duolm" (forced: on every CPU the kernel
    runs on): up to KERNEL_ROWS rows on the kernel, more (and training forwards) through F.linear, its bits; a GPT-2's
    logits within 1e-5 of the plain model's, and under torch.compile the kernel's bits (its operator inside the
    graph)."""
    monkeypatch.setattr(precision, "fp32_engine", lambda: "duolm")
    from duolm.models import GPT2, GPT2Config

    torch.manual_seed(0)
    w, b = torch.randn(2304, 768) * 0.02, torch.randn(2304)
    lin = KernelLinear(w, b)
    calls = []
    kernel = kernels.fp32_linear
    monkeypatch.setattr(kernels, "fp32_linear", lambda x, *a: calls.append(x.shape) or kernel(x, *a))
    with torch.no_grad():
        for shape in ((1, 768), (2, 3, 768), (KERNEL_ROWS, 768), (KERNEL_ROWS + 1, 768), (4, 20, 768)):
            x = torch.randn(shape)
            got = lin(x)
            ran = calls[-1:] == [shape]
            calls.clear()
            assert ran == (x.numel() <= KERNEL_ROWS * 768)
            if ran:
                torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=0)
            else:
                assert torch.equal(got, F.linear(x, w, b))
    x = torch.randn(2, 768, requires_grad=True)
    assert torch.equal(lin(x), F.linear(x, w, b)) and not calls
    model = GPT2(GPT2Config(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    fast = precision.quantize(copy.deepcopy(model), "fp32")
    assert sum(isinstance(m, KernelLinear) for m in fast.modules()) == 9       # 4 matrices x 2 blocks + lm_head
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        want = model(idx)
        got = fast(idx)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        compiled = torch.compile(fast, fullgraph=True, dynamic=False, backend="aot_eager")(idx)
    assert torch.equal(compiled, got)               # the kernel's bits: the operator inside the graph, not F.linear


# ---- one-query attention ---------------------------------------------------------------------------------------

attention = pytest.mark.skipif(not kernels.ready(), reason="this CPU lacks AVX-512: duolm.kernels' attention does "
                               "not run here (the static step's formula in torch ops and SDPA run instead)")


@attention
@pytest.mark.parametrize("B,H,L,D", [(1, 12, 100, 64), (8, 12, 160, 64), (2, 3, 1, 20), (3, 2, 40, 33)])
def test_one_query_attention_is_sdpa(B, H, L, D):
    """PyTorch's SDPA on the same q, k, v and bool mask (each row with columns hidden anywhere, one row's mask for
    every row, no mask), k and v slices of a longer cache as decoding passes them; head sizes that are no multiple
    of 16 floats: the same numbers within float rounding."""
    torch.manual_seed(B * L + D)
    cache_k, cache_v = torch.randn(2, B, H, L + 7, D).unbind(0)
    k, v, q = cache_k[:, :, :L], cache_v[:, :, :L], torch.randn(B, H, 1, D) * 3
    masks = torch.rand(B, 1, 1, L) < 0.7
    masks[..., -1] = True                                  # every row sees a column (its own, in decoding)
    for mask in (masks, masks[:1], None):
        got = kernels.one_query_attention(q, k, v, mask)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="mask bool"):
        kernels.one_query_attention(q, k, v, masks.float())


@attention
def test_one_query_attention_reads_only_the_columns_shown(monkeypatch):
    """Columns the mask hides are never read (NaN there changes nothing: a static step's unwritten cache), and a row
    that sees no column gets NaN, as the formula's softmax over -inf alone (gpt2.one_query_attention, the kernel off)."""
    from duolm.models import gpt2

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 1, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    mask = torch.zeros(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :5] = True
    got = kernels.one_query_attention(q, k, v, mask)
    k[:, :, 5:], v[:, :, 5:] = float("nan"), float("nan")
    assert torch.equal(kernels.one_query_attention(q, k, v, mask)[0], got[0])
    monkeypatch.setattr(kernels, "ready", lambda: False)
    want = gpt2.one_query_attention(q, k.nan_to_num(), v.nan_to_num(), mask)
    torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=1e-5)
    assert want[1].isnan().all() and got[1].isnan().all()


@attention
@pytest.mark.parametrize("precision_", ["fp32", "int8"])
def test_decoding_with_the_attention_kernel_is_decoding_with_sdpa(monkeypatch, precision_):
    """generate(), left-padded prompts of different lengths, greedy: the same ids with the kernel as with PyTorch's
    SDPA (the compiled step, which runs the kernel too, gives eager's ids: tests/test_static.py)."""
    from duolm.generation import generate
    from duolm.models import GPT2, GPT2Config

    torch.manual_seed(0)
    model = precision.quantize(GPT2(GPT2Config(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval(),
                               precision_)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]

    def ids():
        with torch.inference_mode():
            return list(generate(model, prompts, 12, temperature=0))
    calls = []
    kernel = kernels.one_query_attention
    monkeypatch.setattr(kernels, "one_query_attention", lambda *a: calls.append(1) or kernel(*a))
    with_kernel = ids()
    assert len(calls) == 2 * 11                                 # every layer of the 11 steps after the prefill
    monkeypatch.setattr(kernels, "ready", lambda: False)
    assert ids() == with_kernel and len(calls) == 22
