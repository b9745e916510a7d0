"""duolm.kernels: the fp32 product of a few rows against F.linear, the int8 product against its formula
in torch ops (int8_reference(): the same u8, exact sums), both at GPT-2's shapes and at widths that are no multiple of
their blocks; KernelLinear and Int8Linear running them on the row counts they are for; an int8 row's result the same
in any batch; torch.compile over models that hold them; their build (a killed build that stops nobody, two builds at
once, a built library loaded quietly) and the fallback where they do not build. They run on every CPU where torch
dispatches AVX2 or AVX-512 (int8 under AVX-512: with VNNI), built for that set; elsewhere (another architecture) the
tests that run them say so as they skip."""
from __future__ import annotations

import copy
import doctest
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import torch.nn.functional as F

from duolm import engines, kernels
from duolm import precision
from duolm.precision import KERNEL_ROWS, Int8Linear, KernelLinear, int8_rows

vnni = pytest.mark.skipif("duolm" not in engines.candidates("int8"), reason="duolm.kernels' int8 kernel does not run "
                          "on this CPU (AVX2, or AVX-512 with VNNI; Int8Linear runs torch._int_mm: test_precision.py)")
fp32 = pytest.mark.skipif(not kernels.ready(), reason="duolm.kernels do not run on this CPU (AVX2 or AVX-512): "
                          "PackedLinear or F.linear run (tests/test_precision.py)")
AVX512 = "avx512f avx512bw avx512vl avx512dq"                # what torch's AVX-512 kernels need of a CPU


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


@pytest.mark.parametrize("engine", list(engines.candidates("int8")))
def test_a_row_gets_the_same_numbers_in_any_batch(engine):
    """Each row is quantized on its own and summed in exact integers, by either int8 engine (duolm's kernel, torch's
    _int_mm): a row alone, beside a row of 100x larger values (another request, a padding position) and in a batch of
    13 gives the same bits."""
    torch.manual_seed(1)
    prepare, run = engines.candidates("int8")[engine]
    form = prepare(torch.randn(3072, 768) * 0.02)
    x = torch.randn(13, 768)
    x[5] *= 100
    batch = run(x, form)
    for i in (0, 4, 12):
        assert torch.equal(run(x[i:i + 1], form)[0], batch[i])
        assert torch.equal(run(x[[i, 5]], form)[0], batch[i])


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


def test_the_set_torch_dispatches_decides_and_without_a_compiler_torchs_kernels_run(monkeypatch):
    """The kernels are built for the instruction set torch dispatches (AVX2: its int8 kernel too; AVX-512: int8 with
    VNNI only), for a CPU that has it, on no other; where there is no compiler a warning says so once, and an
    Int8Linear for which duolm's kernel was chosen (a choice kept on disk before the compiler went) runs torch's
    engine."""
    for capability, flags, fp32_runs, int8_runs in [("AVX2", "avx2 fma", True, True), ("AVX2", "avx2", False, False),
                                                    ("AVX512", AVX512, True, False),
                                                    ("AVX512", AVX512 + " avx512_vnni", True, True),
                                                    ("DEFAULT", AVX512 + " avx2 fma", False, False)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert (kernels.supported(flags), kernels.int8_supported(flags)) == (fp32_runs, int8_runs), capability
    assert kernels.layout() == (16, 4)
    monkeypatch.setattr(kernels, "COMPILERS", ("duolm-no-such-compiler",))
    _avx512(monkeypatch)
    flags = AVX512 + " avx512_vnni (a CPU of this test)"
    with pytest.warns(RuntimeWarning, match="did not build .*no C\\+\\+ compiler") as warned:
        assert not kernels.available(flags)
    assert len(warned) == 1
    assert not kernels.available(flags)                              # once: the answer is kept
    monkeypatch.setattr(kernels, "cpuinfo", lambda field: flags if field == "flags" else None)
    monkeypatch.setattr(precision, "int8_choice", lambda: {"few": "duolm", "wide": "duolm"})
    q = Int8Linear(torch.randn(32, 16), None)
    assert q.engines == ("torch", "torch") and q.packed is None


def _avx512(monkeypatch):
    """kernels.supported() true for flags with AVX512 on any machine (for the tests that load nothing)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")


def _compiler(folder, body, version="echo 'the compiler of this test 1.0'"):
    """A C++ compiler of a test: a shell script that runs `version` for --version and `body` for anything else."""
    script = folder / "cxx"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then {version}; exit; fi\n{body}\n')
    script.chmod(0o755)
    return str(script)


FAILURES = {           # what the test's compiler does when asked to compile, what the warning says
    "a failed compile": ("echo 'kernels.cpp:1:1: error: this compile fails' >&2; exit 1",
                         "RuntimeError: .*cxx failed: kernels.cpp:1:1: error: this compile fails"),
    "a compile over the timeout": ("exec sleep 60", "RuntimeError: .*cxx ran over 1 s"),
    "a folder that cannot be written": ("exit 1", "NotADirectoryError: .*Not a directory"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_a_build_that_fails_warns_once_and_torchs_kernels_run(case, tmp_path, monkeypatch):
    """Each way a build fails ends the same: one RuntimeWarning that says why, available() False (duolm.precision on
    torch's kernels), no exception, and no file left in the cache folder. The compiler is a script of the test (no
    real build): one that fails, one that outlives the timeout (1 s here)."""
    compile_, match = FAILURES[case]
    monkeypatch.setattr(kernels, "COMPILERS", (_compiler(tmp_path, compile_),))
    monkeypatch.setattr(kernels, "build", functools.partial(kernels.build, timeout=1))
    cache = tmp_path / "cache"
    if case == "a folder that cannot be written":
        (tmp_path / "a file").write_text("")
        cache = tmp_path / "a file" / "cache"                  # root writes past a chmod, not under a file
    _avx512(monkeypatch)
    with pytest.warns(RuntimeWarning, match=f"did not build \\({match}") as warned:
        assert not kernels.available(f"{AVX512} ({case})", cache)
    assert len(warned) == 1
    assert not cache.is_dir() or list(cache.iterdir()) == []


# ---- the build, in processes of their own: a library loads into a process once ---------------------------------

builds = pytest.mark.skipif(not kernels.ready(), reason="duolm.kernels do not build here (neither AVX2 nor AVX-512, or "
                            "no C++ compiler)")

LOAD = """
import sys, torch, torch.nn.functional as F
from pathlib import Path
from duolm import kernels
kernels.COMPILERS = tuple(sys.argv[2:]) or kernels.COMPILERS
assert kernels.available(kernels.cpuinfo("flags"), Path(sys.argv[1]))
w, x = torch.randn(37, 100), torch.randn(3, 100)
torch.testing.assert_close(kernels.fp32_linear(x, kernels.pack_fp32(w), None, 37), F.linear(x, w), atol=1e-5,
                           rtol=1e-5)
"""


def _load(cache, *compilers):
    """A process that builds or loads the kernels from `cache` and checks fp32_linear against F.linear, in a session of
    its own (the whole of it can be killed)."""
    return subprocess.Popen([sys.executable, "-c", LOAD, str(cache), *compilers], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stderr(process):
    """`process`'s stderr once it exits 0, within 10 minutes (a hang fails, killed)."""
    try:
        err = process.communicate(timeout=600)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err
    return err


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache folder where a build was killed (SIGKILL, the compiler's too) 2 s into its compile, then two processes
    built at once: (the folder, its files after the kill, the killed build's state, the two builders' stderr)."""
    cache = tmp_path_factory.mktemp("kernels")
    killed = _load(cache)
    for _ in range(1200):                                   # its temporary file: the compiler's run begins
        if killed.poll() is not None or list(cache.glob("*.tmp")):
            break
        time.sleep(0.1)
    time.sleep(2)
    compiling = killed.poll() is None
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    after_kill = sorted(p.name for p in cache.iterdir())
    builders = [_load(cache) for _ in range(2)]
    return cache, after_kill, compiling, [_stderr(p) for p in builders]


@builds
def test_a_killed_build_stops_nobody_and_builds_at_once_agree(built):
    """The user's report: a build killed mid-way (an OOM kill) left torch's lock, and every later process waited on it
    forever. Now the killed build leaves its temporary file only; two processes that then build into the folder at
    once each build, load and compute F.linear's numbers, and leave one library (the same name) beside the killed
    build's file."""
    cache, after_kill, compiling, stderrs = built
    assert compiling and len(after_kill) == 1 and after_kill[0].endswith(".tmp")
    for err in stderrs:                                     # the one line of a build: what, where, how long
        assert len(re.findall(r"duolm\.kernels: built .*/duolm_kernels-\w+\.so from kernels\.cpp with .* in [\d.]+ s\n",
                              err)) == 1
    library = [p.name for p in cache.glob("*.so")]
    assert len(library) == 1 and sorted(p.name for p in cache.iterdir()) == sorted(library + after_kill)


@builds
def test_a_built_library_is_loaded_quietly_and_killed_builds_are_cleared(built, tmp_path):
    """A process that finds the library builds nothing (its compiler fails any compile, answering --version as the
    real one: the same name) and says nothing; it removes killed builds' temporary files older than an hour and keeps a
    younger one (a build under way)."""
    cache, after_kill, _, _ = built
    os.utime(cache / after_kill[0], (time.time() - 7200,) * 2)
    under_way = cache / "duolm_kernels-0.1.under-way.tmp"
    under_way.write_text("")
    library = sorted(cache.glob("*.so"))
    real = next(filter(None, map(shutil.which, kernels.COMPILERS)))
    err = _stderr(_load(cache, _compiler(tmp_path, "exit 1", version=f"exec {real} --version")))
    assert "duolm.kernels" not in err
    assert sorted(cache.iterdir()) == sorted(library + [under_way])


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
    """quantize(model, "fp32") swaps in KernelLinear where fp32_choice() says "duolm" (forced: on every CPU the kernel
    runs on): up to KERNEL_ROWS rows on the kernel, more (and training forwards) through F.linear, its bits; a GPT-2's
    logits within 1e-5 of the plain model's, and under torch.compile the kernel's bits (its operator inside the
    graph)."""
    monkeypatch.setattr(precision, "fp32_choice", lambda: {"few": "duolm", "wide": "mkl"})
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

attention = pytest.mark.skipif(not kernels.ready(), reason="duolm.kernels' attention does not run on this CPU (AVX2 "
                               "or AVX-512): the static step's formula in torch ops and SDPA run instead")


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
    """generate(), left-padded prompts of different lengths, greedy: the same ids with the kernel quantize swaps in
    (KernelAttention) as with PyTorch's SDPA (the model's own OneQueryAttention put back; the compiled step, which
    runs the kernel too, gives eager's ids: tests/test_static.py)."""
    from duolm.models.gpt2 import OneQueryAttention
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
    swapped = [b.attn for b in model.h]
    assert all(type(a.one_query) is precision.KernelAttention for a in swapped)
    for a in swapped:
        a.one_query = OneQueryAttention()
    assert ids() == with_kernel and len(calls) == 22


# ---- structured output's mask ------------------------------------------------------------------------------------

@pytest.mark.skipif(not kernels.ready(), reason="duolm.kernels do not run on this CPU (AVX2 or AVX-512): the penalty "
                    "is added instead (tests/test_structured.py)")
@pytest.mark.parametrize("B,rows,V", [(1, [0], 50257), (5, [0, 2, 3], 50304), (3, [1], 37), (2, [1, 0], 64)])
def test_masked_logits_is_the_penalty_added(B, rows, V):
    """masked_logits on random bitmasks (a word of no token and one of every token among them; vocabularies that are
    no multiple of 32) equals duolm.generation.grammar's plain path, penalty_rows (0 or -inf) added, on the rows
    given; the other rows come back as they are; the logits given are not changed; a row out of range or given twice
    and a short bitmask are errors that say so."""
    from duolm.generation.grammar import penalty_rows

    g = torch.Generator().manual_seed(B * V)
    logits = torch.randn(B, V + 3, generator=g)[:, :V]            # a view, as a model's head returns its logits
    given = logits.clone()
    masks = [torch.randint(-2**31, 2**31 - 1, (1, (V + 31) // 32), dtype=torch.int32, generator=g) for _ in rows]
    masks[0][0, :2] = torch.tensor([0, -1])                      # a word of no token, one of every token
    want = given.clone()
    for r, m in zip(rows, masks):
        want[r] += penalty_rows(m, V)[0]
    assert torch.equal(kernels.masked_logits(logits, masks, rows), want) and torch.equal(logits, given)
    with pytest.raises(RuntimeError, match=f"row {B} of {B}, once"):
        kernels.masked_logits(logits, masks[:1], [B])
    with pytest.raises(RuntimeError, match=f"row {rows[0]} of {B}, once"):
        kernels.masked_logits(logits, masks[:1] * 2, rows[:1] * 2)
    with pytest.raises(RuntimeError, match="contiguous int32 words"):
        kernels.masked_logits(logits, [masks[0][:, :-1]], [0])
