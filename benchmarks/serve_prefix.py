"""The serving features of issue 59, timed on this CPU, GPT-2 124M-shaped (random weights, GPT-2's vocabulary):

1. Prefix caching: multiple-choice items sent as lm-evaluation-harness's local-completions sends them (one scoring
   request a choice: echo, logprobs 1, max_tokens 1; ordered by length, longest first, as its Collator orders them;
   4 at a time, its num_concurrent=4), through duolm serve's scheduler in this process, with the prefix cache and
   without, and beside them lm-evaluation-harness's own HFLM (`lm_eval --model hf`, in process, at its default batch
   size 1 and at 4, on the same weights saved in HF format) on the same (context, continuation) texts; ARC-Easy items
   (../shared/data/mc, four short answers) and HellaSwag-form items (four long endings: ARC questions cut in two, their
   answers lengthened). The sides alternate within each of --rounds rounds (medians). Printed: the speed-up, the
   token-reuse bound (every context + continuation computed, over each context once plus every continuation) and the
   share of it, that the log-probabilities agree within 1e-5, and HFLM's time against duolm serve's with the cache.
2. Structured output: what a constrained draw costs (duolm.generation.grammar: Constraint.mask, the penalty added to
   the logits; Constraint.advance, the token consumed and llguidance's walk for the new text written into the
   sequence's buffer, its penalty), per token and row, around decoding steps of GPT-2 124M in int8 at batch 1, over
   sampled completions under a JSON schema, a regex and a choice, all of them valid; llguidance's walk alone beside it.

    python benchmarks/serve_prefix.py [--items 60] [--rounds 3] [--completions 1000] [--only prefix|mask] [--no-hf]

The process first calls duolm.malloc.keep_freed_memory() and huge_pages(), as `duolm serve` does. Writes
results/serve-prefix-cpu.json: its "prefix" and "mask" parts, each with the date, load and command of the run
that measured it (--only keeps the other part as it was).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ holds tokenizers.py, which would shadow the `tokenizers` package transformers needs.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import duolm  # noqa: E402
from duolm.generation.grammar import Grammar, Vocabulary  # noqa: E402
from duolm.malloc import huge_pages, keep_freed_memory  # noqa: E402
from duolm.models import GPT2, GPT2Config, KVCache  # noqa: E402
from duolm.serve.scheduler import Row, Scheduler, Sink  # noqa: E402
from test_structured import CHOICES, REGEX, SCHEMA, valid_json  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


class Keep(Sink):
    def prompt(self, logprobs):
        self.lp = [None if x is None else x[0] for x in logprobs]


def items(tok, n: int, form: str) -> list:
    """[(context, [continuations])] of the first n ARC-Easy items, or HellaSwag-form ones, as texts."""
    out = []
    for line in (DATA / "mc" / "arc_easy.jsonl").read_text(encoding="utf-8").splitlines()[:n]:
        d = json.loads(line)
        ctx, choices = d["query"], d["choices"]
        if form == "hellaswag":               # a longer context, four long endings
            ctx = "Science: " + ctx.removeprefix("Question: ").removesuffix("\nAnswer:")
            choices = [c + ", and then the result is written down in the notebook as the teacher asked" for c in choices]
        out.append((ctx, [" " + c for c in choices]))
    return out


def score(sched: Scheduler, requests: list) -> tuple[float, list]:
    """lm-eval's order (longest first), 4 at a time; -> seconds, each request's prompt log-probabilities."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i]), tuple(requests[i])))
    lps = [None] * len(requests)
    t0 = time.perf_counter()
    for k in range(0, len(order), 4):
        rows = [Row(prompt=requests[i], max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=True, sink=Keep())
                for i in order[k:k + 4]]
        sched.submit(rows)
        while sched.step():
            pass
        for i, r in zip(order[k:k + 4], rows):
            lps[i] = r.sink.lp
    return time.perf_counter() - t0, lps


def hflm(hf_dir, texts, batch: int):
    """lm-evaluation-harness's HFLM (`lm_eval --model hf`: its own ordering and batching, `batch` requests a forward)
    on the items' (context, continuation) loglikelihood requests, warmed up -> a call that runs them: seconds."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=hf_dir, dtype="float32", batch_size=batch, device="cpu")
    reqs = [Instance("loglikelihood", None, (ctx, cont), k) for ctx, conts in texts for k, cont in enumerate(conts)]
    lm.loglikelihood(reqs[:8], disable_tqdm=True)

    def run() -> float:
        t0 = time.perf_counter()
        lm.loglikelihood(reqs, disable_tqdm=True)
        return time.perf_counter() - t0
    return run


def prefix_case(model, tok, n: int, form: str, hf_dir, rounds: int) -> dict:
    """Each round: the requests without the cache, with it (a fresh one), then HFLM at batch sizes 1 and 4; the
    medians of the rounds."""
    texts = items(tok, n, form)
    its = [(tok.encode(ctx), [tok.encode(c) for c in conts]) for ctx, conts in texts]
    requests = [ctx + cont for ctx, conts in its for cont in conts]
    everything = sum(map(len, requests))
    once = sum(len(ctx) + sum(map(len, conts)) for ctx, conts in its)
    score(Scheduler(model, max_batch=4), requests[:8])                     # warm up
    hf = {} if hf_dir is None else {b: hflm(hf_dir, texts, b) for b in (1, 4)}
    times: dict = {k: [] for k in ("plain", "cached", *hf)}
    for _ in range(rounds):
        t, plain = score(Scheduler(model, max_batch=4), requests)
        times["plain"].append(t)
        sched = Scheduler(model, max_batch=4, prefix_cache_mb=1024)
        t, cached = score(sched, requests)
        times["cached"].append(t)
        for b, run_hf in hf.items():
            times[b].append(run_hf())
    plain_s, cached_s, *hf_s = (statistics.median(v) for v in times.values())
    worst = max(abs(a - b) for x, y in zip(plain, cached) for a, b in zip(x[1:], y[1:]))
    speedup, bound = plain_s / cached_s, everything / once
    return {"form": form, "items": n, "requests": len(requests), "tokens": everything, "rounds": rounds,
            "plain_s": plain_s, "cached_s": cached_s, "speedup": speedup, "bound": bound,
            "share_of_bound": speedup / bound, "max_logprob_diff": worst, "hits": sched.stats()["prefix_cache_hits"],
            "lm_eval_hf_s": dict(zip(hf, hf_s)), "vs_lm_eval_hf": {b: t / cached_s for b, t in zip(hf, hf_s)}}


def mask_case(model, vocab, tok, grammar: Grammar, completions: int, ok) -> dict:
    """Sampled completions (temperature 1 on the model's logits) under `grammar`, each draw after a decoding step of
    the model (batch 1, one position through a KV cache, the head), as generate() draws them: what a draw costs is
    Constraint.mask (the penalty added) and Constraint.advance (the token consumed; llguidance's walk for the new text
    and its penalty); llguidance's walk for the same text once more, alone (LLMatcher.compute_bitmask), beside it."""
    source = vocab.compile(grammar)
    g = torch.Generator().manual_seed(0)
    masks = tokens = valid = stopped = 0
    seconds = {"step": 0.0, "mask": 0.0, "advance": 0.0, "engine": 0.0}

    def timed(key, f):
        t0 = time.perf_counter()
        out = f()
        seconds[key] += time.perf_counter() - t0
        return out

    with torch.inference_mode():
        for k in range(completions):
            c, cache = vocab.constraint(source), KVCache(model.config, 1, max_len=96)
            ids, out = [tok.eot_id] * 8, []          # a prompt of 8 tokens
            for _ in range(64):
                logits = timed("step", lambda: model.head(model.hidden(torch.tensor([ids]), None, cache)[:, -1]).float())
                masked = timed("mask", lambda: c.mask(logits))
                timed("engine", c.matcher.compute_bitmask)
                masks += 1
                t = int(torch.multinomial(masked.softmax(-1), 1, generator=g))
                if t == tok.eot_id or timed("advance", lambda: c.advance(t)):
                    stopped += 1
                    out += [] if t == tok.eot_id else [t]
                    break
                out.append(t)
                ids = [t]
            tokens += len(out)
            valid += ok(tok.decode(out))
    us = {key: 1e6 * v / masks for key, v in seconds.items()}
    return {"grammar": grammar.kind, "completions": completions, "valid": valid, "stopped": stopped,
            "draw_us_per_token": us["mask"] + us["advance"], "mask_us_per_token": us["mask"],
            "advance_us_per_token": us["advance"], "engine_us_per_token": us["engine"], "step_ms": us["step"] / 1e3,
            "share_of_step": (us["mask"] + us["advance"]) / us["step"], "tokens_mean": tokens / completions}


def run() -> dict:
    """This run's date, load average, machine and command."""
    return {"date": datetime.date.today().isoformat(), "load": os.getloadavg()[0],
            "machine": {**duolm.precision.machine(), "cores": os.cpu_count()},
            "command": "python benchmarks/serve_prefix.py " + " ".join(sys.argv[1:])}


def prefix_part(args, tok) -> dict:
    model = GPT2(GPT2Config.preset("gpt2")).eval()
    precision = duolm.precision.resolve("auto", "cpu", training=False)
    rec = {**run(), "precision": precision, "cases": []}
    with tempfile.TemporaryDirectory() as hf_dir:
        duolm.save(model, hf_dir, tokenizer=tok, format="hf")           # lm-eval's HFLM reads the same weights
        duolm.precision.quantize(model, precision)
        for form in ("arc", "hellaswag"):
            r = prefix_case(model, tok, args.items, form, None if args.no_hf else hf_dir, args.rounds)
            rec["cases"].append(r)
            print(f"prefix cache, {form}: {r['items']} items, {r['requests']} requests, {r['tokens']} tokens: "
                  f"{r['plain_s']:.2f} s without, {r['cached_s']:.2f} s with: {r['speedup']:.2f}x; token-reuse bound "
                  f"{r['bound']:.2f}x ({r['share_of_bound']:.0%} of it); log-probabilities differ by "
                  f"{r['max_logprob_diff']:.2g} at most" + "".join(
                      f"; lm_eval --model hf at batch size {b} {t:.2f} s: duolm serve with the cache "
                      f"{r['vs_lm_eval_hf'][b]:.2f}x" for b, t in r["lm_eval_hf_s"].items()))
    return rec


def mask_part(args, tok) -> dict:
    model = duolm.precision.quantize(GPT2(GPT2Config.preset("gpt2")).eval(), "int8")
    rec = {**run(), "step_precision": "int8", "cases": []}
    vocab = Vocabulary.of(tok, model.config.vocab_size)
    for grammar, ok in ((Grammar("json", SCHEMA), valid_json), (Grammar("regex", REGEX), re.compile(REGEX).fullmatch),
                        (Grammar("choice", CHOICES), CHOICES.__contains__)):
        r = mask_case(model, vocab, tok, grammar, args.completions, lambda t, ok=ok: bool(ok(t)))
        rec["cases"].append(r)
        print(f"mask, {r['grammar']}: a draw {r['draw_us_per_token']:.1f} us a token and row (mask "
              f"{r['mask_us_per_token']:.1f}, advance {r['advance_us_per_token']:.1f}; llguidance's walk alone "
              f"{r['engine_us_per_token']:.1f}), {r['share_of_step']:.1%} of its int8 batch-1 step ({r['step_ms']:.2f} "
              f"ms); {r['valid']}/{r['completions']} valid, {r['stopped']} stopped, {r['tokens_mean']:.1f} tokens each")
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--completions", type=int, default=1000, help="per grammar")
    ap.add_argument("--only", choices=("prefix", "mask"), help="run one part (the file keeps the other's figures)")
    ap.add_argument("--no-hf", action="store_true", help="leave out lm-evaluation-harness's HFLM")
    ap.add_argument("--rounds", type=int, default=3, help="prefix part: rounds of every side, medians")
    args = ap.parse_args()
    keep_freed_memory()                 # as the `duolm` command does before its first tensor
    huge_pages()
    torch.manual_seed(0)
    tok = duolm.ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    print(f"GPT-2 124M shape, random weights, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    out = ROOT / "results" / "serve-prefix-cpu.json"
    rec = json.loads(out.read_text()) if args.only and out.exists() else {}
    for part, measure in (("prefix", prefix_part), ("mask", mask_part)):
        if args.only in (None, part):
            rec[part] = measure(args, tok)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
