"""The static-shape decode step (duolm.generation.static) against generate's eager path: the same ids, greedy and
seeded sampling, batches of prompts of different lengths; compiled once and reused (dynamo's counters); the CLI's
--compile. On CUDA the same step is replayed as a CUDA graph (tests/test_cuda.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters   # test-only: dynamo's own count of the graphs it compiled

from duolm import engines, kernels, precision
from duolm.generation import generate, static
from duolm.generation.static import (_DECODERS, StaticDecoder, advance, cache_length, decoder_of, own_code,
                                    prompt_length)
from duolm.models import GPT2, GPT2Config, KVCache
from duolm.models.gpt2 import one_query_attention


def sharpen(model, scale=0.3, seed=0):
    """Matrices N(0, scale): next-token distributions far from uniform, so greedy ids have no near ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def ids(model, prompts, n, compile, **kw):
    gen = generate(model, prompts, n, compile=compile, **kw)
    for _ in gen:
        pass
    return gen.tokens, gen.stop_reasons


def prompts_of(B, seed, vocab, lo=3, hi=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(B)]


SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3)


def test_cache_length_doubles_from_64_up_to_the_window():
    assert [cache_length(n, 1024) for n in (1, 64, 65, 160, 513, 1024)] == [64, 64, 128, 256, 1024, 1024]
    assert cache_length(100, 96) == 96


def test_prompt_length_doubles_from_16_up_to_the_window():
    assert [prompt_length(n, 1024) for n in (1, 16, 17, 100, 513, 1024)] == [16, 16, 32, 128, 1024, 1024]
    assert prompt_length(50, 48) == 48


def test_compiled_prefill_equals_the_eager_forward_one_graph_a_bucket():
    """A server's prefill of one prompt (StaticDecoder.prefill): compiled at the bucketed length, right-padded; the
    hidden states, keys and values of the prompt's positions are the eager forward's (a 1-row cache of its own) up to
    the last bits; prompts of lengths 1, 5, 16 share bucket 16, 17 and 30 bucket 32: two builds, two graphs, and a
    prompt of a built length compiles nothing."""
    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=64)))
    dec, before = StaticDecoder(model), counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for P in (1, 5, 16, 17, 30, 3):
            prompt = torch.randint(0, 512, (P,), generator=g).tolist()
            h, k, v = dec.prefill(prompt)
            cache = KVCache(model.config, 1, max_len=P)
            want = model.hidden(torch.tensor([prompt]), None, cache)
            assert h.shape == want.shape and k[0].shape == cache.k[0].shape
            torch.testing.assert_close(h, want, rtol=0, atol=1e-5)
            for a, b in zip(k + v, cache.k + cache.v):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert dec.built == 2 and counters["stats"]["unique_graphs"] == before + 2


PREFILL_ONCE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_static import sharpen
from duolm.generation.static import StaticDecoder
from duolm.models import GPT2, GPT2Config, KVCache
torch.manual_seed(0)
model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=64)))
prompt = list(range(7, 40, 3))
with torch.inference_mode():
    h = StaticDecoder(model).prefill(prompt)[0]
    want = model.hidden(torch.tensor([prompt]), None, KVCache(model.config, 1, max_len=len(prompt)))
torch.testing.assert_close(h, want, rtol=0, atol=1e-5)
"""


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                    reason="torch does not dispatch AVX-512 kernels on this CPU: no graph of that width to cache")
def test_a_graph_cached_under_avx512_is_not_reused_under_avx2(tmp_path):
    """inductor's on-disk cache is shared by processes that dispatch different vector widths: the compiled prefill of a
    process held to AVX2 (ATEN_CPU_CAPABILITY=avx2, as on most laptops) after one on AVX-512 filled the cache equals
    the eager forward, where inductor's reused code, written for 16 floats a vector, left half of each vector NaN
    (static.isa_options keys the cache by the width)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    for capability in ("avx512", "avx2"):
        done = subprocess.run([sys.executable, "-c", PREFILL_ONCE, str(Path(__file__).parent)], capture_output=True,
                              text=True, env=env | {"ATEN_CPU_CAPABILITY": capability}, timeout=300)
        assert done.returncode == 0, (capability, done.stderr[-2000:])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_one_query_attention_equals_sdpa(dtype, tol):
    """The static step's attention, written out, against F.scaled_dot_product_attention on the same inputs: 3 rows
    of 12 heads over 96 columns, each row masked differently (one sees a single column), fp32 and bf16 (SDPA's math
    in fp32 on the CPU)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 12, n, 64, generator=g).to(dtype) for n in (1, 96, 96))
    mask = torch.rand(3, 1, 1, 96, generator=g) < 0.6
    mask[0] = False
    mask[0, ..., 7] = True
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    got = one_query_attention(q, k, v, mask)
    assert got.dtype == dtype and got.shape == (3, 12, 1, 64)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got[0].float(), v[0, :, 7:8].float())      # one column seen: its values


@pytest.mark.parametrize("preset", ["tiny", "gpt2"])
@pytest.mark.parametrize("B", [1, 8])
def test_static_step_gives_the_eager_ids(preset, B):
    """Uncompiled, the static step is the same arithmetic over a longer, masked cache: the eager path's ids, greedy
    and seeded sampling (top-k, top-p, repetition penalty), prompts of different lengths (left padding), a stop
    sequence ending one row early. GPT-2 124M's shapes with a short window."""
    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config.preset(preset, block_size=64)))
    _DECODERS[model] = StaticDecoder(model, compile=False)
    prompts = prompts_of(B, seed=B, vocab=model.config.vocab_size)
    n = 24 if preset == "tiny" else 6
    want = ids(model, prompts, n, False, temperature=0)
    assert ids(model, prompts, n, True, temperature=0) == want
    stop = [want[0][0][2:4]]                               # row 0 stops after its 4th token
    got = ids(model, prompts, n, True, temperature=0, stop=stop)
    assert got == ids(model, prompts, n, False, temperature=0, stop=stop) and len(got[0][0]) == 4
    sampled = [ids(model, prompts, n, c, generator=torch.Generator().manual_seed(5), **SAMPLING) for c in (0, 1)]
    assert sampled[0] == sampled[1] and sampled[0][0] != want[0]


def test_static_step_fills_the_window_as_the_eager_path():
    """A prompt whose generation reaches block_size: the cache bucket is the window itself; both stop "context"."""
    model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=48)))
    _DECODERS[model] = StaticDecoder(model, compile=False)
    prompts = prompts_of(2, seed=1, vocab=512, lo=30, hi=40)
    want = ids(model, prompts, 100, False, temperature=0)
    assert ids(model, prompts, 100, True, temperature=0) == want
    assert [r.value for r in want[1]] == ["context", "context"]


def built():
    """What has been compiled in this process: dynamo's graphs, AOTInductor's packages."""
    return counters["stats"]["unique_graphs"], sum(len(v) for v in static._PACKAGES.values())


@pytest.mark.parametrize("ahead", [True, False])
def test_compiled_step_gives_the_eager_ids_and_compiles_once(ahead, monkeypatch):
    """The compiled step, on the CPU compiled ahead of time by AOTInductor (where torch.export can trace the model) or
    by torch.compile(fullgraph) (where it cannot: an `exportable` False): the eager ids for 128 greedy steps and for
    seeded sampling; a second and a third generation in the same (batch, cache length) bucket, other prompts and
    lengths, reuse the step: nothing is built or compiled again (one package or one graph in all)."""
    if not ahead:
        monkeypatch.setattr(static, "exportable", lambda model: False)
    torch.manual_seed(0)
    model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=256, n_layer=3)))       # a structure of its own
    prompts = prompts_of(3, seed=0, vocab=512)
    before = built()
    assert ids(model, prompts, 128, True, temperature=0) == ids(model, prompts, 128, False, temperature=0)
    dec = decoder_of(model)
    after = built()
    assert dec.ahead == ahead and dec.built == 1 and dec.compile_s > 0
    assert after == ((before[0], before[1] + 1) if ahead else (before[0] + 1, before[1]))   # one for all 127 steps
    for seed in (1, 2):
        other = prompts_of(3, seed=seed, vocab=512)
        kw = dict(generator=torch.Generator().manual_seed(seed), **SAMPLING)
        assert ids(model, other, 120, True, **kw) == ids(model, other, 120, False,
                                                         **{**kw, "generator": torch.Generator().manual_seed(seed)})
    assert (dec.built, built()) == (1, after)


@pytest.mark.skipif(not kernels.ready(), reason="duolm.kernels do not run on this CPU (AVX2 or AVX-512): no KernelLinear")
def test_ahead_of_time_steps_serve_ranges_of_batches(monkeypatch):
    """AOTInductor's steps of KernelLinear's model (fp32_choice() forced to "duolm"): batch 1 a package of its own;
    batch 3 one whose batch is dynamic up to KERNEL_ROWS (KernelLinear runs F.linear above it: export bounds the
    range), which batch 5 reuses (its runner too); a model of the same structure loads the packages, compiling nothing;
    the eager ids at each batch and cache length."""
    from duolm.precision import KERNEL_ROWS

    monkeypatch.setattr(precision, "fp32_choice", lambda: {"few": "duolm", "wide": "mkl"})
    torch.manual_seed(0)
    model = precision.quantize(sharpen(GPT2(GPT2Config.preset("tiny", block_size=128))), "fp32")
    before = built()
    for B, n in ((1, 20), (3, 100), (5, 30)):
        prompts = prompts_of(B, seed=B, vocab=512)
        assert ids(model, prompts, n, True, temperature=0) == ids(model, prompts, n, False, temperature=0)
    assert built() == (before[0], before[1] + 2)
    ranges = [r[:2] for r in static._PACKAGES[(repr(model), 128)]]
    assert ranges == [(1, 1), (2, KERNEL_ROWS)] and len(decoder_of(model)._ahead_fns) == 2   # a runner a package
    twin = precision.quantize(sharpen(GPT2(GPT2Config.preset("tiny", block_size=128)), seed=1), "fp32")
    prompts = prompts_of(4, seed=9, vocab=512)
    assert ids(twin, prompts, 30, True, temperature=0) == ids(twin, prompts, 30, False, temperature=0)
    assert built() == (before[0], before[1] + 2) and decoder_of(twin).built == 1


def test_models_of_other_shapes_compile_steps_of_their_own(monkeypatch):
    """Dynamo keeps a bounded number of graphs for each code object (8; 1 here): each structure of model has a step
    function of its own, so a process decodes models of any number of shapes; models of one shape share theirs (the
    torch.compile route: an `exportable` False)."""
    monkeypatch.setattr(static, "exportable", lambda model: False)
    a, b = (sharpen(GPT2(GPT2Config.preset("tiny", block_size=64, n_layer=n))) for n in (1, 2))
    assert own_code(advance, a) is own_code(advance, sharpen(GPT2(GPT2Config.preset("tiny", block_size=64, n_layer=1))))
    assert own_code(advance, a).__code__ is not own_code(advance, b).__code__
    with torch._dynamo.config.patch(recompile_limit=1):                  # test-only: dynamo's private setting
        for model in (a, b):
            assert ids(model, [[1, 2, 3]], 8, True, temperature=0) == ids(model, [[1, 2, 3]], 8, False, temperature=0)


def test_a_decoder_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = GPT2(GPT2Config.preset("tiny")).eval()
    _DECODERS[model] = StaticDecoder(model, compile=False)
    ids(model, [[1, 2, 3]], 4, True, temperature=0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_compiled_step_of_a_packed_fp32_model(monkeypatch):
    """A model swapped by quantize(model, "fp32") where oneDNN runs it (PackedLinear: every product on x86 CPUs other
    than Intel's): torch.export cannot trace the packed weight, so the step is torch.compile's, which traces F.linear
    (inductor cannot lower a weight packed outside it), and gives the eager ids."""
    monkeypatch.setattr(precision, "fp32_choice", lambda: {"few": "onednn", "wide": "onednn"})
    model = precision.quantize(sharpen(GPT2(GPT2Config.preset("tiny", block_size=256))), "fp32")
    assert any(isinstance(m, precision.PackedLinear) for m in model.modules())
    prompts = prompts_of(2, seed=3, vocab=512)
    assert ids(model, prompts, 40, True, temperature=0) == ids(model, prompts, 40, False, temperature=0)
    assert not decoder_of(model).ahead


@pytest.mark.parametrize("engine", list(engines.candidates("int8")))
def test_compiled_step_of_an_int8_model(engine, monkeypatch):
    """A model swapped by quantize(model, "int8") on each int8 engine that runs here (duolm.kernels' operator
    duolm_cpu::int8_linear, or int8_mm around torch._int_mm): the step compiled ahead of time (AOTInductor) calls it
    as it is and gives the eager int8 ids for 3 prompts; a deep copy decodes through the same package: nothing is
    compiled again."""
    import copy

    monkeypatch.setattr(precision, "int8_choice", lambda: {"few": engine, "wide": engine})
    model = precision.quantize(sharpen(GPT2(GPT2Config.preset("tiny", block_size=256))), "int8")
    linears = [m for m in model.modules() if isinstance(m, precision.Int8Linear)]
    assert linears and all(m.engines == (engine, engine) for m in linears)
    prompts = prompts_of(3, seed=4, vocab=512)
    want = ids(model, prompts, 40, False, temperature=0)
    assert ids(model, prompts, 40, True, temperature=0) == want and decoder_of(model).ahead
    other = copy.deepcopy(model)              # a model of the same shape shares the package: none is compiled
    before = built()
    assert ids(other, prompts, 40, True, temperature=0) == want
    assert built() == before and decoder_of(other).ahead


@pytest.mark.parametrize("compiled_wins", [True, False])
def test_the_faster_decode_step_is_kept(compiled_wins, monkeypatch, caplog):
    """A compiled step is kept only where it beats the same step run op by op: each (batch, cache length) timed once
    (StaticStep.seconds, here answering for each side), alternating, one line saying which is kept; the kept step
    gives generate's eager ids either way, and a second generation of that shape times nothing again."""
    monkeypatch.setattr(StaticDecoder, "keep_faster", True)
    timed = []

    def seconds(step, calls=5):
        eager = step._fn is advance
        timed.append(eager)
        return 2e-3 if eager == compiled_wins else 1e-3
    monkeypatch.setattr(static.StaticStep, "seconds", seconds)
    model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=64)))
    prompts = prompts_of(2, seed=5, vocab=512)
    want = ids(model, prompts, 20, False, temperature=0)
    dec = StaticDecoder(model)
    _DECODERS[model] = dec
    with caplog.at_level("WARNING", logger="duolm.generation"):
        assert ids(model, prompts, 20, True, temperature=0) == want
    assert timed == [False, True] * 3 and list(dec.compiled.values()) == [compiled_wins]
    kept = "compiled" if compiled_wins else "eager"
    assert [r.getMessage().endswith(f"keeping the {kept} one") for r in caplog.records] == [True]
    assert (dec.get(2, 30)._fn is advance) != compiled_wins
    assert ids(model, prompts, 20, True, temperature=0) == want and len(timed) == 6


def test_an_ahead_of_time_step_refuses_strided_buffers():
    """A step compiled ahead of time reads its inputs as laid out when compiled (contiguous): a server's ids and
    positions as two columns of one tensor would be read wrong, so bind() refuses them before building anything."""
    model = sharpen(GPT2(GPT2Config.preset("tiny", block_size=64)))
    dec = StaticDecoder(model)
    both = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous"):
        dec.bind(KVCache(model.config, 2, max_len=64), both[:, :1], both[:, 1:], torch.zeros(1, dtype=torch.long),
                 torch.zeros(2, 64, dtype=torch.bool))
    assert dec.ahead and dec.built == 0


@pytest.mark.parametrize("B", [1, 8])
def test_compiled_step_of_gpt2_124m_shapes_gives_the_eager_ids(B):
    """GPT-2 124M's matrices (768 wide, 12 heads, the 50,257-token vocabulary; 2 of its 12 layers, a short window),
    random and swapped for the CPU's fp32 kernels: the compiled step (ahead of time on the CPU) gives the eager ids,
    greedy and with seeded sampling, for prompts of different lengths."""
    torch.manual_seed(0)
    model = precision.quantize(sharpen(GPT2(GPT2Config.preset("gpt2", block_size=64, n_layer=2))), "fp32")
    prompts = prompts_of(B, seed=B, vocab=model.config.vocab_size)
    assert ids(model, prompts, 12, True, temperature=0) == ids(model, prompts, 12, False, temperature=0)
    assert ids(model, prompts, 12, True, generator=torch.Generator().manual_seed(7), **SAMPLING) == \
        ids(model, prompts, 12, False, generator=torch.Generator().manual_seed(7), **SAMPLING)
