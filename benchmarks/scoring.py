"""Sentence scoring speed: duolm vs minicons on the same sentences and the same random weights, one run, alternating.

  * BERT-base pseudo-log-likelihood ("original": one masked copy a token), duolm.evaluation.scoring.score_sentences
    against minicons' MaskedLMScorer.sequence_score;
  * GPT-2 124M log-likelihood (the first token after <|endoftext|>), against minicons' IncrementalLMScorer with
    bos_token=True.

The sentences are BLiMP's (../shared/data/blimp, both sentences of each pair, in file order). minicons needs
transformers < 5: it runs in a process of its own (.venv/minicons-reference and .venv/qa-reference first on its
PYTHONPATH, as the tests run it), which loads its model once and scores each batch it is sent; its time is measured
there, around the scoring alone. duolm runs in this process, in fp32 on the engines quantize() picks (as `duolm
score` runs), and in int8 (`duolm score --precision int8`), its scores compared with fp32's (the largest difference,
the BLiMP pairs ordered alike). Each round times the three on every sentence; the median of --rounds rounds; the
scores' largest difference is printed too. The CPU's fp32 peak (one 2048^3 product) is timed first, and each model's
rate is also printed as GFLOP/s of the products its scoring needs at least (products_gflop) against it. Prints the
CPU and the load average.

    python benchmarks/scoring.py [--threads 2] [--rounds 3] [--bert-sentences 200] [--gpt2-sentences 1000]
                                 [--batch 20] [--tiny] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def worker(model_dir: str, kind: str, threads: int) -> None:
    """Run with minicons importable: reads a JSON list of sentences a line, answers [seconds, scores]."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    from minicons import scorer

    total = lambda x: x.sum(0).item()                     # noqa: E731
    if kind == "gpt2":
        lm = scorer.IncrementalLMScorer(model_dir, "cpu")
        score = lambda b: lm.sequence_score(b, reduction=total, bos_token=True)          # noqa: E731
    else:
        lm = scorer.MaskedLMScorer(model_dir, "cpu")
        score = lambda b: lm.sequence_score(b, reduction=total, PLL_metric="original")   # noqa: E731
    print("ready", flush=True)
    for line in sys.stdin:
        batches = json.loads(line)
        start = time.perf_counter()
        with torch.inference_mode():
            out = [s for b in batches for s in score(b)]
        print(json.dumps([time.perf_counter() - start, out]), flush=True)


class Minicons:
    def __init__(self, model_dir: Path, kind: str, threads: int):
        venv = Path(sys.prefix)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(venv / "minicons-reference"),
                                                             str(venv / "qa-reference")])}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(model_dir), kind, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while self.proc.stdout.readline().strip() != "ready":
            if self.proc.poll() is not None:
                raise RuntimeError("the minicons worker ended before it was ready")

    def __call__(self, batches: list[list[str]]) -> tuple[float, list[float]]:
        self.proc.stdin.write(json.dumps(batches) + "\n")
        self.proc.stdin.flush()
        seconds, scores = json.loads(self.proc.stdout.readline())
        return seconds, scores

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def sentences(n: int) -> list[str]:
    out = []
    for f in sorted((DATA / "blimp").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            out += [item["sentence_good"], item["sentence_bad"]]
    return out[:n]


def models(folder: Path, tiny: bool):
    """Random GPT-2 124M and BERT-base (with its pretraining heads), or (tiny) models of 2 layers 64 wide with the
    same vocabularies, saved by duolm in HF's layout with the real vocabularies; loaded back by duolm as `duolm
    score` loads them."""
    import duolm
    from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config

    torch.manual_seed(0)
    bpe = duolm.ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    wp = duolm.WordPiece.from_vocab(DATA / "bert-vocab" / "bert-base-uncased-vocab.txt")
    small = dict(n_layer=2, n_head=2, n_embd=64) if tiny else {}
    duolm.save(GPT2(GPT2Config.preset("gpt2", **small)), folder / "gpt2", tokenizer=bpe, format="hf")
    duolm.save(BertForPreTraining(BertConfig.preset("bert-base", **small, **({"n_inner": 256} if tiny else {}))),
               folder / "bert", tokenizer=wp, format="hf")


def peak_gflops(n: int = 2048) -> float:
    """The CPU's fp32 product rate, as one n x n x n product (torch.mm, the best of 10 after a warm-up) reaches it on
    torch's threads: what no fp32 scorer's products can pass here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def products_gflop(kind: str, config, tok, texts: list[str]) -> float:
    """The floating-point operations of the products that scoring `texts` needs at least (no padding, no attention
    scores), in GFLOP: GPT-2 each sentence's t tokens (<|endoftext|> first) through the blocks, the output layer at
    the t - 1 scored; BERT's PLL, for a sentence of n pieces, n masked copies of n + 2 tokens ([CLS], [SEP]) through
    the encoder and the MLM head (its transform and decoder) at the masked position."""
    C, V = config.n_embd, config.vocab_size
    block = config.n_layer * (4 * C * C + 2 * C * getattr(config, "n_inner", 4 * C))    # a token's MACs
    macs = 0
    for s in texts:
        if kind == "gpt2":
            t = len(tok.encode(s)) + 1
            macs += t * block + (t - 1) * V * C
        else:
            n = len(tok.encode(s)) - 2
            macs += n * (n + 2) * block + n * (C * C + V * C)
    return 2 * macs / 1e9


def measure(kind: str, folder: Path, texts: list[str], batch: int, rounds: int, threads: int) -> dict:
    """duolm in fp32 (as `duolm score` runs by default) and in int8 (`--precision int8`: the precision module's int8
    engines; its scores against fp32's: their largest difference and the share of BLiMP pairs, texts[2i] against
    texts[2i + 1], that both order alike) against minicons (fp32), alternating."""
    from duolm.checkpoint import load
    from duolm.evaluation.scoring import score_sentences
    from duolm.precision import quantize

    model, tok = load(folder / kind)
    engines = {"duolm": quantize(copy.deepcopy(model), "fp32"), "duolm int8": quantize(model, "int8")}
    theirs = Minicons(folder / kind, kind, threads)
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    times: dict = {"duolm": [], "duolm int8": [], "minicons": []}
    scores: dict = {}
    for _ in range(rounds + 1):                              # the first round warms them up, untimed
        for name, m in engines.items():
            start = time.perf_counter()
            scores[name] = [r["score"] for r in score_sentences(m, tok, texts)]
            times[name].append(time.perf_counter() - start)
        seconds, scores["minicons"] = theirs(batches)
        times["minicons"].append(seconds)
    theirs.close()
    rate = {k: len(texts) / statistics.median(v[1:]) for k, v in times.items()}
    ours, int8 = scores["duolm"], scores["duolm int8"]
    same = sum((ours[i] > ours[i + 1]) == (int8[i] > int8[i + 1]) for i in range(0, len(texts) - 1, 2))
    return {"sentences": len(texts), "sentences_per_s": rate, "ratio": rate["duolm"] / rate["minicons"],
            "gflop_per_sentence": products_gflop(kind, model.config, tok, texts) / len(texts),
            "ratio_int8": rate["duolm int8"] / rate["minicons"],
            "max_abs_diff": max(abs(a - b) for a, b in zip(ours, scores["minicons"])),
            "int8_max_abs_diff": max(abs(a - b) for a, b in zip(ours, int8)),
            "int8_pairs_alike": same / (len(texts) // 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bert-sentences", type=int, default=200)
    ap.add_argument("--gpt2-sentences", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=20, help="sentences a minicons call")
    ap.add_argument("--tiny", action="store_true", help="models of 2 layers 64 wide (the vocabularies as they are)")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], int(args.worker[2]))
    from duolm.precision import machine

    torch.set_num_threads(args.threads)
    out = {"machine": machine(), "load_start": os.getloadavg()[0], "rounds": args.rounds, "tiny": args.tiny}
    print(f"CPU: {out['machine']['cpu']}, {args.threads} threads; load average at start: {out['load_start']:.2f}")
    out["peak_gflops"] = peak_gflops()
    print(f"fp32 peak: {out['peak_gflops']:.0f} GFLOP/s (one 2048 x 2048 x 2048 product)")
    with tempfile.TemporaryDirectory() as tmp:
        models(Path(tmp), args.tiny)
        names = ("tiny BERT", "tiny GPT-2") if args.tiny else ("BERT-base", "GPT-2 124M")
        for kind, n, what in (("bert", args.bert_sentences, f"{names[0]} pseudo-log-likelihood (original)"),
                              ("gpt2", args.gpt2_sentences, f"{names[1]} log-likelihood")):
            r = out[kind] = measure(kind, Path(tmp), sentences(n), args.batch, args.rounds, args.threads)
            per, peak = r["gflop_per_sentence"], out["peak_gflops"]
            ours, theirs = (per * r["sentences_per_s"][k] for k in ("duolm", "minicons"))
            print(f"{what}, {r['sentences']} BLiMP sentences, median of {args.rounds} rounds: duolm "
                  f"{r['sentences_per_s']['duolm']:.1f} sentences/s, minicons {r['sentences_per_s']['minicons']:.1f}: "
                  f"{r['ratio']:.2f}x (scores differ by at most {r['max_abs_diff']:.1e} nats); duolm int8 "
                  f"{r['sentences_per_s']['duolm int8']:.1f} sentences/s: {r['ratio_int8']:.2f}x minicons (fp32), its "
                  f"scores within {r['int8_max_abs_diff']:.2f} nats of duolm fp32's, {r['int8_pairs_alike']:.1%} of the "
                  f"pairs ordered alike")
            print(f"  its products: {per:.2f} GFLOP a sentence; duolm fp32 {ours:.0f} GFLOP/s ({ours / peak:.0%} of the "
                  f"fp32 peak), minicons {theirs:.0f} ({theirs / peak:.0%}); 5x minicons would take {5 * theirs:.0f} "
                  f"GFLOP/s, {5 * theirs / peak:.1f}x the peak")
    out["load_end"] = os.getloadavg()[0]
    print(f"load average at the end: {out['load_end']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
