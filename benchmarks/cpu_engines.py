"""duolm vs CTranslate2 vs transformers on one CPU, the same random weights (saved once by transformers).

  * GPT-2 124M greedy decoding: a 32-token prompt, 128 new tokens (no early end), batch 1 and 8, in fp32
    (duolm: duolm.precision.quantize(model, "fp32"): duolm.kernels' fp32 kernel on few rows where fp32_choice() says
    "duolm", oneDNN on packed weights where it is "onednn";
    CTranslate2 compute_type float32;
    transformers' generate) and in int8 (duolm: int8 weights and dynamically quantized
    activations, as CTranslate2's compute_type int8); duolm's bf16 beside them (CTranslate2 has none on CPUs);
    duolm fp32 and int8 each eager (generate's default) and compiled (generate(compile=True): the static-shape step
    of duolm.generation.static, compiled in the warm-up before the rounds, kept where it beat the eager step when
    built; its seconds and the step kept printed apart); torchao's int8 (Int8DynamicActivationInt8WeightConfig,
    PyTorch's own CPU int8) on the same model, through the same compiled step;
  * a BERT-base encoder forward at 32 x 128 in fp32 (duolm Bert; CTranslate2 Encoder; transformers BertModel) and
    in int8 (duolm and CTranslate2, as for decoding);
  * in each batch's rounds, the matrix products of duolm's fp32 decoding alone (every weight once a step, on the
    batch's rows, nothing else): the rate duolm would reach if the rest (attention over the cache, norms, Python)
    cost nothing; a step's time split in two, its products and the rest;
  * duolm's fp32 weight layouts: GPT-2's matrices packed for oneDNN in the plain layout (rows hint 1) and the blocked
    one duolm.precision uses (rows hint 64), timed on 1, 8 and 128 rows.

The process first calls duolm.malloc.keep_freed_memory() and huge_pages(), as the `duolm` command does
(--default-malloc: glibc's and torch's defaults); transformers, in the same process, runs under the same settings,
CTranslate2 in its own process under glibc's defaults (its memory is its own allocator's, not torch's).

The engines alternate within each round (A B C A B C ...) and each row reports the median of --rounds
rounds, then the ratios in the same run. CTranslate2 runs in a process of its own (called in turn, its
result sent back): in the benchmark's own process, once it has run, PyTorch's kernels stay at ~0.55x their
speed for the rest of the process (measured: duolm int8 batch-1 decoding ~100 -> ~57 tokens/s), which made
earlier runs of this script compare a slowed duolm and transformers with CTranslate2.

Batch-1 decoding is memory-bound: the bound printed beside it is the read bandwidth measured here over the bytes
of weights one token reads (every matrix once, the tied output layer included; int8 rows: a byte a weight, a
quarter of that). The bandwidth is a streaming sum over 1 GiB timed in the batch-1 rounds beside the engines (the
median of its rounds): a shared machine's memory speed drifts over a run, and a bound measured once at the start
can be minutes away from the decoding it is compared with; its tensor sits on huge pages as the weights do (the
machine's best streaming read). Prints the CPU, its bf16 support and the load average.

    python benchmarks/cpu_engines.py [--threads 2] [--rounds 5] [--new-tokens 128] [--batches 1 8] [--default-malloc]
                                     [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the
# `tokenizers` package that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import torch

from duolm.checkpoint import load
from duolm.generation import generate
from duolm.generation.static import decoder_of
from duolm.malloc import huge_pages, keep_freed_memory
from duolm.models.gpt2 import TiedLinear
from duolm.engines import onednn_linear, pack_onednn
from duolm.precision import SWAPPED, fp32_choice, int8_choice, machine, quantize

PROMPT = 32
PRODUCTS = "duolm fp32, products alone"       # the matrix products of decoding without the rest
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


READ = "read 1 GiB"        # batch 1: the streaming sum whose rate is the bandwidth bound's numerator


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def save_models(folder: Path):
    """Random GPT-2 124M and BERT-base saved by transformers (HF directories), and their CTranslate2
    conversions in float32 and int8."""
    import transformers

    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    gpt.save_pretrained(folder / "gpt2")
    bert = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=True).eval()
    bert.save_pretrained(folder / "bert")
    # CTranslate2 converts the vocabulary too: the real GPT-2 BPE and BERT WordPiece files beside the weights
    shutil.copy(DATA / "gpt2" / "encoder.json", folder / "gpt2" / "vocab.json")
    shutil.copy(DATA / "gpt2" / "vocab.bpe", folder / "gpt2" / "merges.txt")
    shutil.copy(DATA / "bert-vocab" / "bert-base-uncased-vocab.txt", folder / "bert" / "vocab.txt")
    # CTranslate2's BERT converter (with transformers 5) wants the field transformers 5 no longer writes
    cfg = json.loads((folder / "bert" / "config.json").read_text())
    (folder / "bert" / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "absolute"}))
    import multiprocessing as mp

    convert = mp.get_context("spawn").Process(target=_convert, args=(folder,))   # CTranslate2 stays out of here
    convert.start()
    convert.join()
    if convert.exitcode:
        sys.exit(f"CTranslate2's conversion failed (exit code {convert.exitcode})")
    return gpt, bert


def _convert(folder: Path):
    import ctranslate2

    for name, q in (("gpt2", "float32"), ("gpt2", "int8"), ("bert", "float32")):
        ctranslate2.converters.TransformersConverter(str(folder / name)).convert(
            str(folder / f"{name}-ct2-{q}"), quantization=q, force=True)


class Isolated:
    """A CTranslate2 model ("Generator" or "Encoder") in a process of its own: `call(method, pick, *args)` runs
    model.method(*args) there and returns pick(result) (a module-level function; None: nothing comes back)."""

    def __init__(self, kind: str, path: Path, compute_type: str, threads: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, str(path), compute_type, threads), daemon=True)
        self.proc.start()

    def call(self, method: str, pick, *args, **kwargs):
        self.conn.send((method, pick, args, kwargs))
        ok, out = self.conn.recv()
        if not ok:
            raise RuntimeError(f"CTranslate2 worker: {out}")
        return out

    def close(self):
        self.conn.send(None)
        self.proc.join()


def _serve(conn, kind, path, compute_type, threads):
    import ctranslate2

    model = getattr(ctranslate2, kind)(path, device="cpu", compute_type=compute_type, intra_threads=threads,
                                       inter_threads=1)
    while (msg := conn.recv()) is not None:
        method, pick, args, kwargs = msg
        try:
            out = getattr(model, method)(*args, **kwargs)
            conn.send((True, None if pick is None else pick(out)))
        except Exception as e:                                       # noqa: BLE001 - reported to the caller
            conn.send((False, repr(e)))


def _ids(results):
    return [r.sequences_ids[0] for r in results]


def _states(out):
    return np.asarray(out.last_hidden_state)


def torchao_int8(model):
    """`model` (fp32) with its nn.Linear weights as torchao's int8 (Int8DynamicActivationInt8WeightConfig: per-row
    int8 weights, activations quantized per token at run time; the tied output layer, not an nn.Linear, stays fp32),
    decoded through torch.compile's step (torch.export does not trace torchao's tensors here)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    model.exportable = False
    return model


def decode_rows(folder, gpt_hf, batch, new, rounds, threads):
    ours, _ = load(folder / "gpt2")
    ours.eval()
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 50000, (batch, PROMPT), generator=g).tolist()
    ct2 = {q: Isolated("Generator", folder / f"gpt2-ct2-{q}", q, threads) for q in ("float32", "int8")}
    # CTranslate2 takes token strings: the ids' names in its vocabulary file
    vocab = json.loads((folder / "gpt2-ct2-float32" / "vocabulary.json").read_text())
    ct2_prompts = [[vocab[i] for i in p] for p in prompts]
    fp32, int8, bf16 = (quantize(copy.deepcopy(ours), p) for p in ("fp32", "int8", "bf16"))
    ao = torchao_int8(copy.deepcopy(ours))

    def duolm(model, compile=False):
        def run():
            with torch.inference_mode():
                return [list(row) for row in zip(*generate(model, prompts, new, temperature=0, compile=compile))]
        return run

    def ctranslate(q):
        def run():
            out = ct2[q].call("generate_batch", _ids, ct2_prompts, max_length=new, min_length=new, sampling_topk=1,
                              include_prompt_in_result=False)
            assert all(len(r) == new for r in out)
            return out
        return run

    def hf():
        with torch.inference_mode():
            out = gpt_hf.generate(torch.tensor(prompts), attention_mask=torch.ones(batch, PROMPT, dtype=torch.long),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            return out[:, PROMPT:].tolist()

    engines = {"duolm fp32": duolm(fp32), "duolm fp32 compiled": duolm(fp32, True),
               "CTranslate2 fp32": ctranslate("float32"), "transformers fp32": hf, "duolm int8": duolm(int8),
               "duolm int8 compiled": duolm(int8, True), "CTranslate2 int8": ctranslate("int8"),
               "duolm bf16": duolm(bf16), "torchao int8 compiled": duolm(ao, True)}
    ids = {k: f() for k, f in engines.items()}          # also the warm-up (and the compilation of the static steps)
    compiled = (("fp32", fp32), ("int8", int8), ("torchao", ao))
    compile_s = {k: decoder_of(m).compile_s for k, m in compiled}
    compile_s["kept"] = {k: "compiled" if all(decoder_of(m).compiled.values()) else "eager" for k, m in compiled}
    ref = ids["transformers fp32"]
    same = {k: sum(a == b for r, q in zip(ref, v) for a, b in zip(r, q)) / (batch * new) for k, v in ids.items()}
    # in the same rounds: what duolm's fp32 rate would be with nothing but products, and at batch 1 the bandwidth
    probes = {PRODUCTS: token_products(fp32, new, batch)}
    if batch == 1:
        probes[READ] = torch.ones((1 << 30) // 4).sum
    for f in probes.values():                           # their warm-up
        f()
    engines.update(probes)
    times = _rounds(engines, rounds)
    for worker in ct2.values():
        worker.close()
    return times, same, compile_s


def encoder_rows(folder, bert_hf, rounds, threads, batch=32, length=128):
    ours, _ = load(folder / "bert")
    ours.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1000, 30000, (batch, length), generator=g)
    idx[:, 0], idx[:, -1] = 101, 102
    enc = {q: Isolated("Encoder", folder / "bert-ct2-float32", q, threads) for q in ("float32", "int8")}
    vocab = (folder / "bert-ct2-float32" / "vocabulary.json")
    names = json.loads(vocab.read_text()) if vocab.exists() else None
    tokens = [[names[i] for i in row] for row in idx.tolist()] if names else None
    fp32, int8 = (quantize(copy.deepcopy(ours), p) for p in ("fp32", "int8"))

    def duolm(model=fp32):
        with torch.inference_mode():
            return model(idx)[0]

    def ct2(pick=None, q="float32"):           # the timed calls send nothing back
        return enc[q].call("forward_batch", pick, tokens if tokens is not None else idx.tolist())

    def hf():
        with torch.inference_mode():
            return bert_hf(idx).last_hidden_state

    # the same weights give the same states (a check that the engines computed the same thing); also the warm-up
    a, b, c = duolm(), torch.as_tensor(ct2(_states)), hf()
    diffs = {"CTranslate2": (b - a).abs().max().item(), "transformers": (c - a).abs().max().item()}
    a8, b8 = duolm(int8), torch.as_tensor(ct2(_states, "int8"))
    diffs.update({"duolm int8": (a8 - a).abs().max().item(), "CTranslate2 int8": (b8 - a).abs().max().item()})
    engines = {"duolm fp32": duolm, "CTranslate2 fp32": ct2, "transformers fp32": hf,
               "duolm int8": lambda: duolm(int8), "CTranslate2 int8": lambda: ct2(q="int8")}
    times = _rounds(engines, rounds)
    for worker in enc.values():
        worker.close()
    return times, diffs


def token_products(model, steps: int, rows: int = 1):
    """A function that runs the matrix products of `steps` decoding steps at batch `rows` and nothing else: every
    linear layer of `model` (a GPT-2 swapped by duolm.precision.quantize: decoding's own path), the tied output layer
    included, on `rows` rows each."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, TiedLinear, *SWAPPED))]
    xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in layers}

    def run():
        with torch.inference_mode():
            for _ in range(steps):
                for m in layers:
                    m(xs[m.weight.shape[1]])
    return run


def layout_rows(rounds, rows=(1, 8, 128), copies=12):
    """Median seconds of an fp32 product through oneDNN on each of GPT-2 124M's matrices, the weight in the plain
    layout (packed for 1 row) and in the blocked one (packed for 64): {(n, k, m): {"plain": s, "blocked": s}}.
    A layer's matrix comes in `copies` copies, run in turn, so that it streams from memory as in a model."""
    torch.manual_seed(0)
    out = {}
    for n, k in ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50304, 768)):
        ws = [torch.randn(n, k) * 0.02 for _ in range(1 if n > 10000 else copies)]
        forms = {"plain": [pack_onednn(w, 1) for w in ws], "blocked": [pack_onednn(w, 64) for w in ws]}
        for m in rows:
            x = torch.randn(m, k)
            runs = {name: (lambda f=f: [onednn_linear(x, w, None) for w in f]) for name, f in forms.items()}
            for f in runs.values():
                f()
            out[n, k, m] = {name: t / len(ws) for name, t in _rounds(runs, rounds).items()}
    return out


def _rounds(engines: dict, rounds: int) -> dict:
    """Median seconds of each engine over `rounds` rounds, the engines in turn within a round (after a warm-up
    call each: packing, kernel selection, the allocator)."""
    times = {k: [] for k in engines}
    for _ in range(rounds):
        for k, f in engines.items():
            times[k].append(_timed(f))
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], choices=[1, 8], help="decoding's batch sizes")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc and torch's pages at their defaults")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    kept = not args.default_malloc and keep_freed_memory()
    huge = not args.default_malloc and huge_pages()
    torch.set_num_threads(args.threads)
    m = machine()
    print(f"CPU: {m['cpu']}, native bf16: {m['native_bf16']}, {args.threads} threads; engines timed here (few rows, "
          f"more): fp32 {fp32_choice()['few']}, {fp32_choice()['wide']}; int8 {int8_choice()['few']}, "
          f"{int8_choice()['wide']}; "
          f"load average at start: {os.getloadavg()[0]:.2f}; freed memory kept, huge pages (duolm.malloc): "
          f"{kept}, {huge}")
    out = {"machine": m, "engines": {"fp32": fp32_choice(), "int8": int8_choice()}, "load_start": os.getloadavg()[0], "malloc_kept": kept, "huge_pages": huge, "decode": {},
           "encoder": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        gpt_hf, bert_hf = save_models(folder)
        weight_bytes = 4 * (sum(p.numel() for n, p in gpt_hf.named_parameters() if p.dim() == 2 and "wpe" not in n))
        print(f"\nGPT-2 124M greedy, {PROMPT}-token prompt, {args.new_tokens} new tokens, median of {args.rounds} rounds")
        for batch in args.batches:
            times, same, compile_s = decode_rows(folder, gpt_hf, batch, args.new_tokens, args.rounds, args.threads)
            if batch == 1:
                gbs = (1 << 30) / times.pop(READ) / 1e9
                bounds = {"fp32": gbs * 1e9 / weight_bytes, "bf16": gbs * 1e9 / (weight_bytes / 2),
                          "int8": gbs * 1e9 / (weight_bytes / 4)}                         # a byte a weight
                out["bandwidth_gbs"], out["bounds"] = gbs, bounds
                print(f"  read bandwidth in these rounds {gbs:.1f} GB/s; fp32 weights read per token "
                      f"{weight_bytes / 1e6:.0f} MB -> batch-1 bound {bounds['fp32']:.1f} tokens/s; bf16 weights "
                      f"(a half) -> {bounds['bf16']:.1f}; int8 weights (a quarter) -> {bounds['int8']:.1f}")
            tps = {k: batch * args.new_tokens / t for k, t in times.items()}
            out["decode"][batch] = {"tokens_per_s": tps, "greedy_ids_equal_to_transformers": same,
                                    "compile_s": compile_s}
            for k, v in tps.items():
                kind = next(p for p in ("int8", "bf16", "fp32") if p in k)
                extra = f"  ({100 * v / bounds[kind]:.0f}% of the {kind} bound)" if batch == 1 else ""
                ids = f"greedy ids as transformers': {100 * same[k]:5.1f}%" if k in same else \
                    f"every weight once a step, {batch} row{'s' * (batch > 1)}"
                print(f"  batch {batch}  {k:<19} {v:8.1f} tokens/s; {ids}{extra}")
            print(f"  batch {batch}  the compiled steps' compilation (before the rounds): fp32 {compile_s['fp32']:.1f} s, "
                  f"int8 {compile_s['int8']:.1f} s, torchao {compile_s['torchao']:.1f} s; the step kept (timed against "
                  f"eager): " + ", ".join(f"{k} {v}" for k, v in compile_s["kept"].items()))
            print(f"  batch {batch}  duolm / CTranslate2: fp32 {tps['duolm fp32'] / tps['CTranslate2 fp32']:.2f}x "
                  f"(compiled {tps['duolm fp32 compiled'] / tps['CTranslate2 fp32']:.2f}x), "
                  f"int8 {tps['duolm int8'] / tps['CTranslate2 int8']:.2f}x "
                  f"(compiled {tps['duolm int8 compiled'] / tps['CTranslate2 int8']:.2f}x; torchao int8 compiled "
                  f"{tps['torchao int8 compiled'] / tps['CTranslate2 int8']:.2f}x); duolm bf16 / duolm fp32 "
                  f"{tps['duolm bf16'] / tps['duolm fp32']:.2f}x (CTranslate2 has no bf16 on CPUs); "
                  f"duolm / transformers fp32 "
                  f"{tps['duolm fp32'] / tps['transformers fp32']:.2f}x (compiled "
                  f"{tps['duolm fp32 compiled'] / tps['transformers fp32']:.2f}x, the products alone "
                  f"{tps[PRODUCTS] / tps['transformers fp32']:.2f}x)")
            step, products = (1e3 * times[k] / args.new_tokens for k in ("duolm fp32", PRODUCTS))
            print(f"  batch {batch}  duolm fp32 a step {step:.1f} ms: its products {products:.1f} ms, the rest "
                  f"{step - products:.1f} ms (attention over the cache, norms, activations, the prompt's prefill, "
                  "Python)")
        times, diffs = encoder_rows(folder, bert_hf, args.rounds, args.threads)
        out["encoder"] = {"seconds": times, "max_abs_diff_vs_duolm": diffs}
        print("\nBERT-base encoder, 32 x 128, fp32 and int8, median of", args.rounds, "rounds")
        for k, t in times.items():
            print(f"  {k:<18} {1000 * t:8.1f} ms")
        print(f"  duolm / CTranslate2: fp32 {times['CTranslate2 fp32'] / times['duolm fp32']:.2f}x, int8 "
              f"{times['CTranslate2 int8'] / times['duolm int8']:.2f}x; duolm / transformers fp32 "
              f"{times['transformers fp32'] / times['duolm fp32']:.2f}x (hidden states differ from duolm fp32's by at "
              "most " + ", ".join(f"{v:.1e} ({k})" for k, v in diffs.items()) + ")")
    layouts = layout_rows(args.rounds)
    out["layouts"] = {f"{n}x{k} rows {m}": v for (n, k, m), v in layouts.items()}
    print(f"\nGPT-2 124M's weights through oneDNN in fp32, plain vs blocked layout, median of {args.rounds} rounds")
    for (n, k, m), v in layouts.items():
        print(f"  {n:>5} x {k:<4} {m:>3} rows: plain {1e6 * v['plain']:7.0f} us, blocked {1e6 * v['blocked']:7.0f} us: "
              f"{v['plain'] / v['blocked']:.2f}x")
    out["load_end"] = os.getloadavg()[0]
    print(f"\nload average at the end: {out['load_end']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
