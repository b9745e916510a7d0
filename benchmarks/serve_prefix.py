"""The serving features of issue 59, timed on this CPU, GPT-2 124M-shaped (random weights, GPT-2's vocabulary):

1. Prefix caching: multiple-choice items sent as lm-evaluation-harness's local-completions sends them (one scoring
   request a choice: echo, logprobs 1, max_tokens 1; ordered by length, longest first, as its Collator orders them;
   4 at a time, its num_concurrent=4), through duolm serve's scheduler in this process, with the prefix cache and
   without; ARC-Easy items (../shared/data/mc, four short answers) and HellaSwag-form items (four long endings: ARC
   questions cut in two, their answers lengthened). Printed: the speed-up, the token-reuse bound (every context +
   continuation computed, over each context once plus every continuation) and the share of it, and that the
   log-probabilities agree within 1e-5.
2. Structured output: llguidance's mask (duolm.generation.grammar.Constraint.mask: the engine's bitmask, unpacked,
   applied to the logits) per token and row, over sampled completions (temperature 1 on random logits) under a JSON
   schema, a regex and a choice; all of them valid. Against a decoding step of the model, batch 1.

    python benchmarks/serve_prefix.py [--items 60] [--completions 1000]

Writes results/serve-prefix-cpu.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import duolm  # noqa: E402
from duolm.generation.grammar import Grammar, Vocabulary  # noqa: E402
from duolm.models import GPT2, GPT2Config, KVCache  # noqa: E402
from duolm.serve.scheduler import Row, Scheduler, Sink  # noqa: E402
from test_structured import CHOICES, REGEX, SCHEMA, valid_json  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


class Keep(Sink):
    def prompt(self, logprobs):
        self.lp = [None if x is None else x[0] for x in logprobs]


def items(tok, n: int, form: str) -> list:
    """[(context ids, [continuation ids])] of the first n ARC-Easy items, or HellaSwag-form ones."""
    out = []
    for line in (DATA / "mc" / "arc_easy.jsonl").read_text(encoding="utf-8").splitlines()[:n]:
        d = json.loads(line)
        ctx, choices = d["query"], d["choices"]
        if form == "hellaswag":               # a longer context, four long endings
            ctx = "Science: " + ctx.removeprefix("Question: ").removesuffix("\nAnswer:")
            choices = [c + ", and then the result is written down in the notebook as the teacher asked" for c in choices]
        out.append((tok.encode(ctx), [tok.encode(" " + c) for c in choices]))
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


def prefix_case(model, tok, n: int, form: str) -> dict:
    its = items(tok, n, form)
    requests = [ctx + cont for ctx, conts in its for cont in conts]
    everything = sum(map(len, requests))
    once = sum(len(ctx) + sum(map(len, conts)) for ctx, conts in its)
    score(Scheduler(model, max_batch=4), requests[:8])                     # warm up
    plain_s, plain = score(Scheduler(model, max_batch=4), requests)
    sched = Scheduler(model, max_batch=4, prefix_cache_mb=1024)
    cached_s, cached = score(sched, requests)
    worst = max(abs(a - b) for x, y in zip(plain, cached) for a, b in zip(x[1:], y[1:]))
    speedup, bound = plain_s / cached_s, everything / once
    return {"form": form, "items": n, "requests": len(requests), "tokens": everything, "plain_s": plain_s,
            "cached_s": cached_s, "speedup": speedup, "bound": bound, "share_of_bound": speedup / bound,
            "max_logprob_diff": worst, "hits": sched.stats()["prefix_cache_hits"]}


def mask_case(model, tok, grammar: Grammar, completions: int, ok) -> dict:
    vocab = Vocabulary.of(tok, model.config.vocab_size)
    source = vocab.compile(grammar)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, model.config.vocab_size, generator=g)
    masks = tokens = valid = stopped = 0
    seconds = 0.0
    for k in range(completions):
        c, out = vocab.constraint(source), []
        for step in range(64):
            t0 = time.perf_counter()
            masked = c.mask(logits[step:step + 1])
            seconds += time.perf_counter() - t0
            masks += 1
            t = int(torch.multinomial(masked.softmax(-1), 1, generator=g))
            if t == tok.eot_id or c.advance(t):
                stopped += 1
                out += [] if t == tok.eot_id else [t]
                break
            out.append(t)
        tokens += len(out)
        valid += ok(tok.decode(out))
    return {"grammar": grammar.kind, "completions": completions, "valid": valid, "stopped": stopped,
            "mask_us_per_token": 1e6 * seconds / masks, "tokens_mean": tokens / completions}


def step_ms(model) -> float:
    cache = KVCache(model.config, 1, max_len=128)
    with torch.inference_mode():
        model.hidden(torch.zeros(1, 64, dtype=torch.long), None, cache)
        t0, n = time.perf_counter(), 30
        for _ in range(n):
            model.head(model.hidden(torch.zeros(1, 1, dtype=torch.long), None, cache)).float()
    return 1e3 * (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--completions", type=int, default=1000, help="per grammar")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = duolm.ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    model = GPT2(GPT2Config.preset("gpt2")).eval()
    duolm.precision.quantize(model, duolm.precision.resolve("auto", "cpu", training=False))
    load = os.getloadavg()[0]
    print(f"GPT-2 124M shape, random weights, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, load {load:.2f}")
    rec = {"date": datetime.date.today().isoformat(), "load": load, "threads": torch.get_num_threads(),
           "command": "python benchmarks/serve_prefix.py " + " ".join(sys.argv[1:]), "prefix": [], "mask": []}
    for form in ("arc", "hellaswag"):
        r = prefix_case(model, tok, args.items, form)
        rec["prefix"].append(r)
        print(f"prefix cache, {form}: {r['items']} items, {r['requests']} requests, {r['tokens']} tokens: "
              f"{r['plain_s']:.2f} s without, {r['cached_s']:.2f} s with: {r['speedup']:.2f}x; token-reuse bound "
              f"{r['bound']:.2f}x ({r['share_of_bound']:.0%} of it); log-probabilities differ by "
              f"{r['max_logprob_diff']:.2g} at most")
    step = step_ms(model)
    rec["step_ms"] = step
    for grammar, ok in ((Grammar("json", SCHEMA), valid_json), (Grammar("regex", REGEX), re.compile(REGEX).fullmatch),
                        (Grammar("choice", CHOICES), CHOICES.__contains__)):
        r = mask_case(model, tok, grammar, args.completions, lambda t, ok=ok: bool(ok(t)))
        rec["mask"].append(r)
        print(f"mask, {r['grammar']}: {r['mask_us_per_token']:.1f} us a token and row ({100e-3 * r['mask_us_per_token'] / step:.1f}% "
              f"of a {step:.1f} ms batch-1 step); {r['valid']}/{r['completions']} valid, {r['stopped']} stopped, "
              f"{r['tokens_mean']:.1f} tokens each")
    out = ROOT / "results" / "serve-prefix-cpu.json"
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
