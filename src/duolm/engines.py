"""Which engine multiplies matrices on this CPU, fp32 and int8, chosen by timing the candidates once on the machine
and kept on disk (as cuDNN's benchmark mode chooses, but kept: every process on a machine reads the same choice, so a
resumed run, an evaluation and a server compute the same numbers bit for bit). The candidates:

    fp32  "duolm"   duolm.kernels' fp32 kernel on a weight packed for it (where the kernels build: AVX2, AVX-512)
          "onednn"  oneDNN's matmul (torch.ops.mkldnn) on a weight packed into its blocked layout, or on the plain one
          "mkl"     PyTorch's F.linear (MKL's sgemm on x86)
    int8  "duolm"   duolm.kernels' int8 kernel on int8 rows packed for it (AVX2, or AVX-512 with VNNI)
          "torch"   int8_mm: the same formula around torch._int_mm (oneDNN's int8 GEMM on x86; exact int32 sums)

    fp32_choice()   # {"few": "duolm", "wide": "onednn", "times": {...}, "key": ...}: the engine for products of up to
                    # FEW_ROWS rows (decoding: a token of each sequence) and the one for more (prompts, encoders)
    int8_choice()   # the same for int8

"few" is timed at 1 and 8 rows, "wide" at 512 rows, on a 768-wide model's MLP matrices, 256 MB in all (fp32; 64 MB as
int8): more than a CPU's last-level cache, so that, as when decoding a real model, every product streams its weight
from memory, and an engine's work around the product weighs as it does in such a model. An engine wins by more than
3% or the earlier one in the order above stays (a tie is noise). The choice is kept under the key of what decides it
(the CPU's model and flags, the vector width torch dispatches, torch's version, the threads, the kernels' source and
this file's); a file that is missing, unreadable or for another key is measured again (~10 s with the packing) and
rewritten, with one line on stderr. duolm.precision's quantize() asks for it, the visible moment; `duolm env` prints
it. kept_choice keeps any choice of the machine so (duolm.precision.attention_choice: the lengths at which BERT's
attention runs as three products rather than SDPA).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from duolm import kernels
from duolm.fileio import write_json

FEW_ROWS = 32                                   # KernelLinear's kernel runs up to this many rows
CACHE = Path.home() / ".cache" / "duolm" / "engines"                   # fp32-<key>.json, int8-<key>.json
log = logging.getLogger("duolm.engines")


def onednn_rows(m: int) -> int:
    """The row count a oneDNN matmul of m rows runs at: m up to 64, above that m rounded up to a step of an eighth
    of the power of two below it (at most 12.5% more rows, padding). oneDNN keeps memory for every distinct (rows,
    weight shape) it has run; a server or an evaluation on inputs of varied length meets a new row count at almost
    every batch, and the memory would grow with each (tests/test_precision.py). Bucketed, the row counts are at
    most 64 + 8 per doubling.

    >>> [onednn_rows(m) for m in (1, 64, 65, 100, 128, 129, 1000, 1024, 1025)]
    [1, 64, 72, 104, 128, 144, 1024, 1024, 1152]
    """
    if m <= 64:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def pack_onednn(w: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """w in the layout oneDNN picks for products of `rows` rows; one packing serves every row count. For fp32,
    rows > 1 gives its blocked layout, read by its AVX-512 kernels whatever the row count (rows=1 keeps the plain
    layout, read with AVX2 code: benchmarks/cpu_engines.py times both)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def on_rows(f, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """f(x) for a product f of each row of x, run on `rows` rows (None: onednn_rows()): x padded with zero rows, which
    the result leaves out."""
    m = x.numel() // x.shape[-1]
    rows = rows or onednn_rows(m)
    if rows == m:
        return f(x)
    padded = x.new_zeros(rows, x.shape[-1])
    padded[:m] = x.reshape(m, -1)
    y = f(padded)[:m]
    return y.view(*x.shape[:-1], y.shape[-1])


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None):
    """x @ W.T + bias through oneDNN on W packed (pack_onednn) or plain, on `rows` rows (None: onednn_rows())."""
    return on_rows(lambda v: torch.ops.mkldnn._linear_pointwise(v, w, bias, "none", [], ""), x, rows)


@functools.cache
def onednn_runs() -> bool:
    """Whether torch's oneDNN matmul runs here (x86, oneDNN built in, the private op present); warns once if not."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    return works("oneDNN matmul", lambda: onednn_linear(torch.randn(2, 8), pack_onednn(torch.randn(4, 8)), None),
                 "F.linear runs instead")


def works(name: str, call, instead: str) -> bool:
    """Whether `call()`, a private torch op on a tiny input, runs here; where it does not, one warning says so and
    what runs `instead`."""
    try:
        call()
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        warnings.warn(f"duolm: torch's {name} is unavailable here ({type(e).__name__}: {e}); {instead}",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w (N, K) ~= q (N, K) * scale (N,), |q| <= 127; an all-zero
    row (GPT-2's vocabulary padding) gets q = 0.

    >>> q, s = int8_rows(torch.tensor([[0.5, -1.27], [0.0, 0.0]]))
    >>> q.tolist(), [round(x, 4) for x in s.tolist()]
    ([[50, -127], [0, 0]], [0.01, 0.0])
    """
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale.clamp(min=1e-12)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor, bias: torch.Tensor | None,
            q_sums: torch.Tensor) -> torch.Tensor:
    """kernels.int8_linear's formula (the same u8 of each row of x) with the integer sums by torch._int_mm, which
    multiplies int8 by int8: u8 - 128 goes in, and 128 * q_sums (q_sums[n] = sum_k q[n, k], int32) comes back, exactly.

    A row [0, 1, 3] (u8 [0, 85, 255]) times the int8 row [1, 2, 0], scale 0.5: _int_mm gives -128 - 86 + 0 = -214,
    plus 128 * 3 = 170 = 0 + 170 + 0, then 170 * (3 / 255) * 0.5 = 1.0 (as kernels.int8_reference).

    >>> q, s = torch.tensor([[1, 2, 0]], dtype=torch.int8), torch.tensor([0.5])
    >>> row_sums, q_sums = (q.float() * s[:, None]).sum(1), q.sum(1, dtype=torch.int32)
    >>> int8_mm(torch.tensor([[0.0, 1.0, 3.0]]), q, s, row_sums, None, q_sums)
    tensor([[1.]])
    """
    v = x.reshape(-1, x.shape[-1])
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-30)
    u8 = torch.round((v - lo) * torch.full_like(span, 255.0).div(span))
    sums = torch._int_mm((u8 - 128).to(torch.int8), q.t()) + 128 * q_sums
    y = torch.addcmul(lo * row_sums, sums.float(), span / 255.0 * scale)
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], q.shape[0])


def _int8_form(w: torch.Tensor) -> tuple:
    """What int8_mm reads of w: its int8 rows, their scales, row sums (of q * scale) and integer row sums."""
    q, scale = int8_rows(w)
    return q, scale, (q.float() * scale[:, None]).sum(1), q.sum(1, dtype=torch.int32)


def _int8_packed(w: torch.Tensor) -> tuple:
    """What kernels.int8_linear reads of w: its int8 rows packed, their scales and row sums."""
    q, scale, row_sums, _ = _int8_form(w)
    return kernels.pack_int8(q), scale, row_sums


def candidates(kind: str = "fp32") -> dict:
    """The `kind` ("fp32", "int8") engines that run here -> (prepare(w) -> the form the engine reads, run(x, form) ->
    x @ w.T, int8: of w as int8 rows)."""
    if kind == "int8":
        out = {"torch": (_int8_form, lambda x, f: int8_mm(x, f[0], f[1], f[2], None, f[3]))}
        if kernels.ready() and kernels.int8_supported(kernels.cpuinfo("flags") or ""):
            out["duolm"] = (_int8_packed, lambda x, f: kernels.int8_linear(x, *f, None))
        return out
    out = {"mkl": (lambda w: w, lambda x, w: F.linear(x, w))}
    if onednn_runs():
        out["onednn"] = (pack_onednn, lambda x, p: onednn_linear(x, p, None))
        out["onednn plain"] = (lambda w: w, lambda x, w: onednn_linear(x, w, None))
    if kernels.ready():
        out["duolm"] = (lambda w: (kernels.pack_fp32(w), len(w)), lambda x, p: kernels.fp32_linear(x, p[0], None, p[1]))
    return out


def best_times(runs: dict, repeats: int = 5, budget: float = 2.0) -> dict:
    """{name: the least seconds one call of runs[name]() took} after a warm-up call each, over `repeats` rounds in
    which the runs alternate (a burst of other load slows them alike); a run's rounds end once its calls have taken
    `budget` seconds in all (one far slower here is not timed `repeats` times over)."""
    for run in runs.values():
        run()
    best, spent = {}, dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, run in runs.items():
            if spent[name] > budget:
                continue
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            spent[name] += took
            best[name] = min(best.get(name, took), took)
    return best


def time_engines(kind: str = "fp32", rows=(1, 8, 512), megabytes: int = 256, repeats: int = 5,
                 budget: float = 2.0) -> dict:
    """{engine: {rows: seconds for one product of each weight}} (best_times: the candidates alternating) for the
    `kind` candidates, on the MLP matrices of a 768-wide model (GPT-2 124M, BERT-base: 3072 x 768 and 768 x 3072, 9 MB
    each in fp32) adding up to `megabytes`: the weights streamed from memory, as decoding a real model streams them,
    and the work around a product (an int8 engine's quantization) in its proportion to the product at such widths."""
    g = torch.Generator().manual_seed(0)
    n = max(2, megabytes * 2**20 // (3072 * 768 * 4) // 2 * 2)
    weights = [torch.randn(*((3072, 768) if i % 2 else (768, 3072)), generator=g) * 0.02 for i in range(n)]
    engines = candidates(kind)
    times: dict = {name: {} for name in engines}
    with torch.inference_mode():
        forms = {name: [prepare(w) for w in weights] for name, (prepare, _) in engines.items()}
        for m in rows:
            xs = [torch.randn(m, w.shape[1], generator=g) for w in weights[:2]]
            runs = {name: lambda run=run, fs=forms[name]: [run(xs[i % 2], f) for i, f in enumerate(fs)]
                    for name, (_, run) in engines.items()}
            for name, t in best_times(runs, repeats, budget).items():
                times[name][m] = t
    return times


ORDER = {"fp32": (["duolm", "onednn", "mkl"], ["onednn plain", "onednn", "mkl"]),   # few rows, wide
         "int8": (["duolm", "torch"], ["duolm", "torch"])}


def choose(times: dict, kind: str = "fp32", margin: float = 0.03) -> dict:
    """The engine for few rows (the sum of the 1- and 8-row times) and for wide products (512 rows) from time_engines'
    `times`: the fastest, unless it beats the first in ORDER[kind] that is within `margin` of it (fp32's wide
    products: oneDNN on the plain weight stands for "onednn", which KernelLinear and PackedLinear both run).

    >>> choose({"mkl": {1: 3.0, 8: 3.0, 512: 9.0}, "onednn": {1: 2.0, 8: 2.0, 512: 6.0},
    ...         "onednn plain": {1: 2.5, 8: 2.5, 512: 6.1}, "duolm": {1: 1.5, 8: 2.4, 512: 8.0}})
    {'few': 'duolm', 'wide': 'onednn'}
    >>> choose({"torch": {1: 2.0, 8: 2.0, 512: 6.0}, "duolm": {1: 1.0, 8: 1.0, 512: 6.1}}, "int8")
    {'few': 'duolm', 'wide': 'duolm'}
    """
    def best(names, cost):
        names = [n for n in names if n in times]
        fastest = min(cost(n) for n in names)
        return next(n for n in names if cost(n) <= fastest * (1 + margin))
    few_order, wide_order = ORDER[kind]
    few = best(few_order, lambda n: times[n][1] + times[n][8])
    wide = best(wide_order, lambda n: times[n][512])
    return {"few": few, "wide": "onednn" if wide.startswith("onednn") else wide}


def machine_key(sources: tuple = ()) -> str:
    """What decides the choice: the CPU's model and flags, the vector width torch dispatches, torch, the threads, and
    duolm's kernels (whether they run here, their source: a new kernel is timed anew), this file (the timing) and the
    `sources` of a choice timed elsewhere (duolm.precision's attention: its own file)."""
    parts = [kernels.cpuinfo("model name") or platform.processor(), kernels.cpuinfo("flags") or platform.machine(),
             torch.backends.cpu.get_cpu_capability(), torch.__version__, str(torch.get_num_threads()),
             str(kernels.ready()),
             *(hashlib.sha256(f.read_bytes()).hexdigest() for f in (kernels.SOURCE, Path(__file__), *sources))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def kept_choice(kind: str, cache: Path | None, measure, fits, sources: tuple = ()) -> dict:
    """This machine's `kind` choice (a dict, its "times" and "key" among it): read from `cache` (default
    CACHE/<kind>-<key>.json: processes with other thread counts keep theirs apart) where it holds this
    machine_key(sources) and fits(kept), else measure() -> (the choice with its "times", what it chose in words),
    written there and said in one line (a cache that cannot be written is said too, and the choice kept for the
    process)."""
    key = machine_key(sources)
    path = cache or CACHE / f"{kind}-{key}.json"
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("key") == key and fits(kept):
            return kept
    except (OSError, ValueError, AttributeError):
        pass
    start = time.perf_counter()
    choice, chose = measure()
    choice = {**choice, "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, choice, indent=1)
        where = f"kept in {path}"
    except OSError as e:
        where = f"not kept ({path}: {e.strerror or e})"
    log.warning("duolm: timed the %s engines on this CPU in %.1f s: %s; %s", kind, time.perf_counter() - start, chose,
                where)
    return choice


def json_times(times: dict) -> dict:
    """{engine: {size: seconds}} with the sizes as strings, as JSON keeps them."""
    return {n: {str(m): t for m, t in ts.items()} for n, ts in times.items()}


def _choice(kind: str, cache: Path | None) -> dict:
    """This machine's `kind` engines ({"few", "wide", "times", "key"}): time_engines, choose, kept (kept_choice)."""
    def measure():
        times = time_engines(kind)
        choice = {**choose(times, kind), "times": json_times(times)}
        return choice, f"{choice['few']} for few rows, {choice['wide']} for more"
    names = set(ORDER[kind][0] + ORDER[kind][1])
    return kept_choice(kind, cache, measure, lambda kept: {kept.get("few"), kept.get("wide")} <= names)


@functools.cache
def fp32_choice(cache: Path | None = None) -> dict:
    """This machine's fp32 engines (_choice)."""
    return _choice("fp32", cache)


@functools.cache
def int8_choice(cache: Path | None = None) -> dict:
    """This machine's int8 engines (_choice)."""
    return _choice("int8", cache)
