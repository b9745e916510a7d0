"""duolm's zero-shot scoring against the plain transformers loops people write, same model, same text.

    .venv/bin/python benchmarks/eval.py                       # perplexity and lambada, 2 rounds each
    .venv/bin/python benchmarks/eval.py --cases mc            # multiple choice against lm-evaluation-harness
    .venv/bin/python benchmarks/eval.py --rounds 3 --cases lambada

GPT-2 124M with random weights (the shapes are what costs time), saved by duolm in HF format and
loaded by transformers, so both sides run the same weights. CPU, torch.set_num_threads(2). Each
round times one pass of each side back to back, alternating which goes first (A B, B A, ...); we
report the medians and their ratio. Both sides' numbers are checked to agree.

  perplexity  WikiText-2 test (de-tokenized), the first --ppl-tokens tokens, window 1024, stride 512.
              transformers: the sliding-window loop of HF's perplexity guide (model(input_ids,
              labels=...) per window). duolm: score_stream, --batch windows per forward, the output
              layer on the scored half of each window only. Unit: scored tokens / s.
  lambada     --lambada-examples passages of the LAMBADA development set. transformers: a loop that
              tokenizes each passage, runs the model and reads the target rows of the logits. duolm:
              lambada_scores (examples batched by length, output layer on the target rows only).
              Unit: passages / s.
  mc          --mc-items ARC-Easy test questions (4 choices each, llm-foundry's form). lm-evaluation-harness:
              its HFLM (`lm_eval --model hf`, in process) on the same HF export, loglikelihood of the
              (query, " " + choice) requests, --mc-batch requests per forward. duolm: multiple_choice (the
              query once through the KV cache, the choices as one batch on top). Unit: questions / s; acc
              and acc_norm checked equal item for item.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ holds tokenizers.py, which would shadow the `tokenizers` package transformers needs.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

import duolm
from duolm.evaluation import detokenize, score_stream
from duolm.evaluation.choice import item_metrics, multiple_choice, read_items
from duolm.evaluation.readers import lambada_examples
from duolm.evaluation.tasks import lambada_scores
from duolm.models import GPT2, GPT2Config

try:
    import transformers
except ImportError as e:   # pragma: no cover
    raise SystemExit(f"this benchmark compares against transformers, which is not installed: {e}")

transformers.logging.set_verbosity_error()
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def hf_guide_perplexity(hf, ids: torch.Tensor, max_length=1024, stride=512):
    """The loop of HF's perplexity guide, as written there (nll_sum over windows of loss * tokens)."""
    seq_len = ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = hf(input_ids, labels=target_ids)
            neg_log_likelihood = outputs.loss
        num_valid_tokens = (target_ids != -100).sum().item()
        num_loss_tokens = num_valid_tokens - target_ids.size(0)
        nll_sum += neg_log_likelihood * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return float(nll_sum), n_tokens


def hf_lambada_loop(hf, hf_tok, examples):
    """One passage at a time: tokenize, run the model, read the rows that predict the target."""
    nll, hits = 0.0, 0
    for ex in examples:
        ctx, tgt = hf_tok(ex.context)["input_ids"], hf_tok(ex.target)["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ctx + tgt[:-1]])).logits[0, len(ctx) - 1:]
        logp = torch.log_softmax(logits.float(), -1)
        nll -= float(logp[torch.arange(len(tgt)), torch.tensor(tgt)].sum())
        hits += logp[-1].argmax().item() == tgt[-1]
    return nll, hits


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def interleaved(name, unit, count, ours, theirs, rounds, check, reference="transformers"):
    t_ours, t_theirs = [], []
    for r in range(rounds):
        pair = [("ours", ours), ("theirs", theirs)]
        for side, fn in (pair if r % 2 == 0 else pair[::-1]):
            dt, out = timed(fn)
            (t_ours if side == "ours" else t_theirs).append(dt)
            check(side, out)
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    print(f"{name}: duolm {count / a:,.1f} {unit}/s, {reference} {count / b:,.1f} {unit}/s, "
          f"ratio {b / a:.2f}x  (medians of {rounds} rounds: {a:.1f} s vs {b:.1f} s)")


def lm_eval_mc(lm, items):
    """lm-evaluation-harness's HFLM on each item's (context, continuation) requests -> per-item (acc, acc_norm)."""
    from lm_eval.api.instance import Instance

    reqs = [Instance("loglikelihood", None, pair, k) for item in items for k, pair in enumerate(item.pairs)]
    lls = iter(ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True))
    out = []
    for item in items:
        got = [next(lls) for _ in item.pairs]
        out.append(tuple(item_metrics(got, list(item.chars), [1] * len(got), item.gold)[k] for k in ("acc", "acc_norm")))
    return out


def mc_case(model, tok, hf_dir, args):
    from lm_eval.models.huggingface import HFLM

    _, items = read_items(DATA / "mc" / "arc_easy.jsonl")
    items = items[:args.mc_items]
    lm = HFLM(pretrained=hf_dir, dtype="float32", batch_size=args.mc_batch, device="cpu")
    ref = {}

    def check(side, out):
        if side == "ours":
            out = [(r["acc"], r["acc_norm"]) for r in out["items"]]
        assert ref.setdefault(side, out) == out and (len(ref) < 2 or ref["ours"] == ref["theirs"]), ref

    interleaved("multiple choice (ARC-Easy, 4 choices)", "questions", len(items),
                lambda: multiple_choice(model, tok, items), lambda: lm_eval_mc(lm, items), args.rounds, check,
                "lm-evaluation-harness (hf)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="perplexity,lambada", help="perplexity, lambada, mc")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--lambada-examples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="duolm: windows per forward")
    ap.add_argument("--lambada-batch", type=int, default=16, help="duolm: passages per forward")
    ap.add_argument("--mc-items", type=int, default=64)
    ap.add_argument("--mc-batch", type=int, default=16, help="lm-evaluation-harness: requests per forward")
    args = ap.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"{DATA} is absent: the benchmark reads WikiText-2 and LAMBADA from it")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = duolm.ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    model = GPT2(GPT2Config()).eval()
    with tempfile.TemporaryDirectory() as d:
        duolm.save(model, d, tokenizer=tok, format="hf")
        hf = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
        hf_tok = transformers.GPT2TokenizerFast.from_pretrained(d)
        if "mc" in args.cases:
            mc_case(model, tok, d, args)
    print(f"GPT-2 124M (random weights), {args.threads} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")

    if "perplexity" in args.cases:
        lines = (DATA / "wikitext-2" / "test.txt").read_text(encoding="utf-8").split("\n")[:-1]
        text = "".join(detokenize(line, "wikitext") + "\n" for line in lines[:400])
        ids = ([tok.eot_id] + tok.encode_ordinary(text))[:args.ppl_tokens + 1]
        ref = {}

        def check(side, out):
            ref.setdefault(side, out)
            if len(ref) == 2:   # the guide's weighting differs slightly from the exact per-token sum
                assert abs(ref["ours"][0] / ref["ours"][1] - ref["theirs"][0] / ref["theirs"][1]) < 1e-2, ref

        interleaved("perplexity (window 1024, stride 512)", "tokens", len(ids) - 1,
                    lambda: score_stream(model, [ids], 512, args.batch),
                    lambda: hf_guide_perplexity(hf, torch.tensor([ids])), args.rounds, check)

    if "lambada" in args.cases:
        examples = lambada_examples(DATA / "lambada" / "lambada_development_plain_text.txt")[:args.lambada_examples]
        ref = {}

        def check(side, out):
            nll, hits = (sum(r[0] for r in out), sum(r[1] for r in out)) if side == "ours" else out
            ref.setdefault(side, (nll, hits))
            if len(ref) == 2:
                assert ref["ours"][1] == ref["theirs"][1] and math.isclose(ref["ours"][0], ref["theirs"][0], rel_tol=1e-5), ref

        interleaved("LAMBADA", "passages", len(examples),
                    lambda: lambada_scores(model, tok, examples, batch_size=args.lambada_batch),
                    lambda: hf_lambada_loop(hf, hf_tok, examples), args.rounds, check)


if __name__ == "__main__":
    main()
