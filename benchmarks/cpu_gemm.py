"""The library engines for CPU matrix products against duolm's kernels, on GPT-2 124M's decoding products.

One decoding step multiplies every weight once: per layer (2304, 768), (768, 768), (3072, 768) and (768, 3072), x 12
layers, then the tied output layer (50304, 768): 124M weights, ~500 MB in fp32, more than the CPU's caches, so each
step streams them from memory as decoding does. Each candidate runs that step's 49 products (no bias) on the same
random weights and inputs at 1, 8 and 32 rows (decoding) and 512 (a prompt, an encoder's batch):

  * fp32: the engines of duolm.engines.candidates(): F.linear (MKL), oneDNN on the weight packed by pack_onednn and
    on the plain weight, duolm's kernel (kernels.pack_fp32 + fp32_linear); and inductor's CPU GEMM: torch.compile of
    a module holding the weights, mode="max-autotune", freezing on, under torch.no_grad() (compile seconds apart);
  * int8 (dynamic activations, per-row int8 weights): duolm.precision.Int8Linear (on the int8 engines timed here:
    duolm's VNNI kernel where it runs); the same formula on torch._int_mm (duolm.engines.int8_mm, the other engine);
    torchao's Int8DynamicActivationInt8WeightConfig, eager and compiled (default mode, freezing on); torchao's int8
    weight-only; int4 weight-only where torchao has a CPU layout (Int4WeightOnlyConfig, else the prototype CPU one;
    each skip printed with why). All on fp32 activations, as duolm's decoding feeds them.

Each candidate's outputs are checked first against F.linear in fp32: an fp32 engine more than 1e-4 off is reported and
not timed; an int8 engine's max relative error (max |y - ref| / max |ref| over a product) is printed beside its
times. The candidates alternate within every round (A B C A B C ...); each figure is the median of --rounds rounds
of one step, as ms a step and GB/s of weights read (each engine's own bytes: 4, 1 or 0.5 a weight); then the
fastest at each row count and duolm's time over the best library engine's (< 1: duolm faster). Prints the CPU
(duolm.precision.machine()) and the load average at start and end; --json writes the numbers.

    python benchmarks/cpu_gemm.py [--threads 2] [--rounds 5] [--rows 1 8 32 512] [--model gpt2] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the `tokenizers` package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import select_algorithm

from duolm import engines
from duolm.fileio import write_json
from duolm.models.gpt2 import GPT2Config
from duolm.precision import Int8Linear, machine

FP32_NAMES = {"mkl": "F.linear (MKL)", "onednn": "oneDNN packed", "onednn plain": "oneDNN plain",
              "duolm": "duolm kernel"}
DUOLM = {"fp32": "duolm kernel", "int8": "duolm Int8Linear"}


def decoding_weights(config: GPT2Config, seed: int = 0) -> list[torch.Tensor]:
    """Every weight one decoding step reads, in its order: each layer's four, then the tied output layer."""
    C, g = config.n_embd, torch.Generator().manual_seed(seed)
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)] * config.n_layer + [(config.padded_vocab_size, C)]
    return [torch.randn(s, generator=g) * 0.02 for s in shapes]


class Products(nn.Module):
    """A decoding step's products as one module: each linear on x (its width) or on h (the MLP's 4C width)."""

    def __init__(self, linears: list[nn.Module], widths: list[int]):
        super().__init__()
        self.linears, self.widths = nn.ModuleList(linears), widths

    def forward(self, x, h):
        return [f(x if k == x.shape[-1] else h) for f, k in zip(self.linears, self.widths)]


def plain_linears(weights) -> list[nn.Linear]:
    out = []
    for w in weights:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w, requires_grad=False)          # the same storage: no copy
        out.append(lin)
    return out


def fp32_candidates(weights, widths) -> dict:
    """name -> (step(x, h) -> outputs, bytes a weight)."""
    out = {}
    for key, (prepare, run) in engines.candidates().items():
        forms = [prepare(w) for w in weights]
        out[FP32_NAMES[key]] = (lambda x, h, forms=forms, run=run:
                                [run(x if k == x.shape[-1] else h, f) for f, k in zip(forms, widths)], 4)
    compiled = torch.compile(Products(plain_linears(weights), widths), mode="max-autotune", dynamic=False)
    out["inductor max-autotune"] = (compiled, 4)
    return out


def torchao_module(weights, widths, config) -> Products:
    from torchao.quantization import quantize_
    m = Products(plain_linears(weights), widths)
    quantize_(m, config)
    return m


def int8_candidates(weights, widths, skipped: dict) -> dict:
    out = {DUOLM["int8"]: (Products([Int8Linear(w, None) for w in weights], widths), 1)}
    prepare, run = engines.candidates("int8")["torch"]             # the other int8 engine duolm.engines times
    forms = [prepare(w) for w in weights]
    step = lambda x, h: [run(x if k == x.shape[-1] else h, f) for f, k in zip(forms, widths)]   # noqa: E731
    out["torch._int_mm (int8_mm)"] = (step, 1)
    try:
        import torchao
        from torchao.quantization import (Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig,
                                          Int8WeightOnlyConfig)
    except Exception as e:                                          # noqa: BLE001 - any import failure is a skip
        skipped["torchao"] = f"{type(e).__name__}: {e}"
        return out
    print(f"torchao {torchao.__version__}")
    dynamic = Int8DynamicActivationInt8WeightConfig
    tries = [("torchao int8 dynamic", lambda: torchao_module(weights, widths, dynamic()), 1),
             ("torchao int8 dynamic, compiled",
              lambda: torch.compile(torchao_module(weights, widths, dynamic()), dynamic=False), 1),
             ("torchao int8 weight-only", lambda: torchao_module(weights, widths, Int8WeightOnlyConfig()), 1),
             ("torchao int4 weight-only", lambda: torchao_module(weights, widths, Int4WeightOnlyConfig()), 0.5)]
    for name, build, size in tries:                                 # a failed run is measure()'s to report
        try:
            out[name] = (build(), size)
        except Exception as e:                                      # noqa: BLE001 - reported, not fatal
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "torchao int4 weight-only" in skipped:                       # int4's CPU layout, where this version has one
        try:
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
            out["torchao int4 weight-only (prototype CPU)"] = (
                torchao_module(weights, widths, PrototypeInt4WeightOnlyConfig()), 0.5)
        except Exception as e:                                      # noqa: BLE001
            skipped["torchao int4 weight-only (prototype CPU)"] = f"{type(e).__name__}: {e}"
    return out


def error(ys, refs, relative: bool) -> float:
    """The largest error over the products: absolute, or relative to each product's largest |ref|."""
    return max(((y - r).abs().max() / (r.abs().max() if relative else 1)).item() for y, r in zip(ys, refs))


def measure(precision, candidates, weights, rows, rounds, compile_s, skipped) -> dict:
    """{name: {m: {"ms", "gbs", "err"}}}: each candidate checked on the inputs of m rows, then timed alternating."""
    n_weights = sum(w.numel() for w in weights)
    results: dict = {name: {} for name in candidates}
    g = torch.Generator().manual_seed(1)
    for m in rows:
        x, h = torch.randn(m, weights[0].shape[1], generator=g), torch.randn(m, weights[-2].shape[1], generator=g)
        refs = [F.linear(x if w.shape[1] == x.shape[1] else h, w) for w in weights]
        live = {}
        for name, (step, size) in candidates.items():
            if name in skipped:
                continue
            start = time.perf_counter()
            try:
                with torch._inductor.config.patch(freezing=True, max_autotune_report_choices_stats=False):
                    ys = step(x, h)                                 # (read when a graph compiles: the first call)
            except Exception as e:                                  # noqa: BLE001 - reported, not fatal
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            if "compiled" in name or "inductor" in name:
                compile_s.setdefault(name, {})[m] = round(time.perf_counter() - start, 1)
            err = error(ys, refs, relative=precision == "int8")
            if precision == "fp32" and err > 1e-4:
                print(f"  {name} at {m} rows: WRONG, max abs error {err:.2e} against F.linear; not timed")
                continue
            live[name] = (step, size, err)
        times: dict = {name: [] for name in live}
        for _ in range(rounds):
            for name, (step, _, _) in live.items():
                start = time.perf_counter()
                step(x, h)
                times[name].append(time.perf_counter() - start)
        for name, (_, size, err) in live.items():
            t = statistics.median(times[name])
            results[name][m] = {"ms": t * 1e3, "gbs": n_weights * size / t / 1e9, "err": err}
    return {name: r for name, r in results.items() if r}


def table(precision: str, results: dict, rows, n_weights: int) -> None:
    print(f"\n{precision}: ms a step (GB/s of weights read), {n_weights / 1e6:.1f}M weights, median of the rounds")
    width = max(map(len, results)) + 2
    print(" " * width + "".join(f"{f'{m} rows':>17}" for m in rows) + ("  max rel. err" if precision == "int8" else ""))
    for name, r in results.items():
        cells = "".join(f"{r[m]['ms']:>9.2f} ({r[m]['gbs']:>5.1f})" if m in r else f"{'-':>17}" for m in rows)
        errs = max(v["err"] for v in r.values())
        print(f"{name:<{width}}{cells}" + (f"  {errs:.2e}" if precision == "int8" else ""))
    ratio, fastest = "", []
    for m in rows:
        timed = {n: r[m]["ms"] for n, r in results.items() if m in r}
        library = {n: t for n, t in timed.items() if n != DUOLM[precision]}
        ok = DUOLM[precision] in timed and library
        ratio += f"{timed[DUOLM[precision]] / min(library.values()):>17.2f}" if ok else f"{'-':>17}"
        if ok:
            fastest.append(f"{m} rows {min(timed, key=timed.get)} (best library: {min(library, key=library.get)})")
    print(f"{'duolm / best library':<{width}}{ratio}\nfastest: " + "; ".join(fastest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--model", default="gpt2", help="a GPT-2 preset whose decoding products to time (tiny: a check)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)        # torchao's and inductor's notices
    select_algorithm.PRINT_AUTOTUNE = False        # inductor's autotuning tables, ~120 lines
    config = GPT2Config.preset(args.model)
    weights = decoding_weights(config)
    widths = [w.shape[1] for w in weights]
    n_weights = sum(w.numel() for w in weights)
    load = [os.getloadavg()[0]]
    m = machine()
    print(f"CPU: {m['cpu']} ({m['capability']}), {args.threads} threads; torch {torch.__version__}; "
          f"load average at start: {load[0]:.2f}")
    print(f"{args.model} decoding step: {len(weights)} products, {n_weights / 1e6:.1f}M weights "
          f"({n_weights * 4 / 1e6:.0f} MB fp32); rows {args.rows}; median of {args.rounds} rounds")
    out: dict = {"machine": m, "torch": torch.__version__, "rows": args.rows, "rounds": args.rounds,
                 "weights": n_weights, "compile_s": {}, "skipped": {}}
    with torch.no_grad():
        for precision, build in (("fp32", fp32_candidates), ("int8", int8_candidates)):
            candidates = build(weights, widths) if precision == "fp32" else build(weights, widths, out["skipped"])
            if precision == "int8":
                print(f"Int8Linear here: {candidates[DUOLM['int8']][0].linears[0].extra_repr().split('kernel=')[1]}")
            out[precision] = measure(precision, candidates, weights, args.rows, args.rounds, out["compile_s"],
                                     out["skipped"])
            table(precision, out[precision], args.rows, n_weights)
            del candidates
            torch._dynamo.reset()                                   # the compiled graphs and their frozen weights
    for name, why in out["skipped"].items():
        print(f"skipped {name}: {why}")
    for name, secs in out["compile_s"].items():
        print(f"compile (first call, s) of {name}: " + ", ".join(f"{m} rows {s}" for m, s in secs.items()))
    load.append(os.getloadavg()[0])
    out["load"], out["torchao"] = load, getattr(sys.modules.get("torchao"), "__version__", None)
    print(f"load average at start {load[0]:.2f}, at end {load[1]:.2f}")
    if args.json:
        write_json(args.json, out, indent=1)


if __name__ == "__main__":
    main()
