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
2. Structured output: what a constrained draw costs a token and row (duolm.generation.grammar: the mask on the
   logits, constrain; Constraint.advance, the token consumed and llguidance's walk for the new text written into the
   sequence's buffer), around decoding steps of GPT-2 124M in int8, at batch 1 and at batch 8, over sampled
   completions under a JSON schema, a regex and a choice, all of them valid. At batch 1 the ways to put the mask on
   the logits take turns, each right after a forward (duolm.kernels.masked_logits, the plain path's penalty added,
   llguidance's own apply_token_bitmask_inplace), beside one trivial torch call there: what any call pays then.

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
from duolm.generation.grammar import Grammar, Vocabulary, constrain  # noqa: E402
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


APPLIES = ("duolm", "penalty", "llguidance", "one torch call")
BATCH = 8                   # the batch of the second run of each grammar


def mask_case(model, vocab, tok, grammar: Grammar, completions: int, ok, batch: int = 1) -> dict:
    """Sampled completions (temperature 1 on the model's logits) under `grammar`, `batch` at a time, each draw after a
    decoding step of the model (one position a row through a KV cache, the head), as generate() draws them: what a
    draw costs a token and row is its mask on the logits (constrain: duolm.kernels.masked_logits, every row of the
    batch in one call) and Constraint.advance (the token consumed, llguidance's walk for the new text into the
    sequence's buffer). At batch 1 the mask's ways take turns, step by step, each timed right after the forward as
    a draw meets it: duolm's kernel; the plain path (penalty_rows' 0 or -inf added); llguidance's own
    apply_token_bitmask_inplace (torch.compile'd torch ops); and, for scale, one trivial torch call (torch.zeros(1))
    before duolm's kernel, what any call pays for the caches the forward emptied."""
    import llguidance.torch

    source = vocab.compile(grammar)
    g = torch.Generator().manual_seed(0)
    draws = tokens = valid = stopped = steps = 0
    seconds = {"step": 0.0, "advance": 0.0, **{a: 0.0 for a in APPLIES}}
    rows_by_way = dict.fromkeys(APPLIES, 0)                 # the rows each way has masked (timed)
    probe = torch.zeros(1, model.config.vocab_size)
    llguidance.torch.apply_token_bitmask_inplace(probe, vocab.constraint(source).bitmask())      # compiled here

    def timed(key, f):
        t0 = time.perf_counter()
        out = f()
        seconds[key] += time.perf_counter() - t0
        return out

    def apply(way, logits, cs):
        if way == "penalty":
            return logits + torch.cat([c.penalty() for c in cs])
        if way == "llguidance":
            llguidance.torch.apply_token_bitmask_inplace(logits, torch.cat([c.bitmask() for c in cs]))
            return logits
        return constrain(logits, cs)

    with torch.inference_mode():
        for _ in range(0, completions, batch):
            cs = [vocab.constraint(source) for _ in range(batch)]
            cache, outs = KVCache(model.config, batch, max_len=96), [[] for _ in cs]
            ids, live = [[tok.eot_id] * 8] * batch, list(range(batch))          # prompts of 8 tokens
            while live:
                logits = timed("step", lambda: model.head(model.hidden(torch.tensor(ids), None, cache)[:, -1]).float())
                steps += 1
                way = APPLIES[sum(rows_by_way.values()) % len(APPLIES)] if batch == 1 else "duolm"
                rows_by_way[way] += len(live)
                rows = logits[live] if len(live) < batch else logits
                if way == "one torch call":         # then duolm's kernel, untimed
                    timed(way, lambda: torch.zeros(1))
                    masked = apply("duolm", rows, [cs[j] for j in live])
                else:
                    masked = timed(way, lambda: apply(way, rows, [cs[j] for j in live]))
                picks = dict(zip(live, torch.multinomial(masked.softmax(-1), 1, generator=g)[:, 0].tolist()))
                draws += len(live)
                for j, t in picks.items():
                    outs[j] += [] if t == tok.eot_id else [t]
                    if t == tok.eot_id or timed("advance", lambda: cs[j].advance(t)) or len(outs[j]) == 64:
                        live.remove(j)
                        stopped += t == tok.eot_id or cs[j].matcher.is_stopped()
                ids = [[picks.get(j, 0)] for j in range(batch)]
            tokens += sum(map(len, outs))
            valid += sum(ok(tok.decode(o)) for o in outs)
    advance = 1e6 * seconds["advance"] / draws
    ways = {a: 1e6 * seconds[a] / n for a, n in rows_by_way.items() if n}      # a row's mask (batch 1: every way)
    draw = ways["duolm"] + advance
    return {"grammar": grammar.kind, "batch": batch, "completions": completions, "valid": valid, "stopped": stopped,
            "draw_us_per_token": draw, "mask_us_per_token": ways["duolm"], "advance_us_per_token": advance,
            "mask_us_by_way": ways, "step_ms": 1e3 * seconds["step"] / steps,
            "share_of_step": draw * draws / (1e6 * seconds["step"]), "tokens_mean": tokens / completions}


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
        for batch in (1, BATCH):
            r = mask_case(model, vocab, tok, grammar, args.completions, lambda t, ok=ok: bool(ok(t)), batch)
            rec["cases"].append(r)
            ways = r["mask_us_by_way"]
            line = (f"mask, {r['grammar']}, batch {batch}: a draw {r['draw_us_per_token']:.1f} us a token and row "
                    f"(the mask {r['mask_us_per_token']:.1f}, the token consumed and the next mask "
                    f"{r['advance_us_per_token']:.1f}), {r['share_of_step']:.1%} of its int8 steps "
                    f"({r['step_ms']:.2f} ms each); {r['valid']}/{r['completions']} valid, {r['stopped']} stopped, "
                    f"{r['tokens_mean']:.1f} tokens each")
            if batch == 1:
                line += ("; the mask's ways right after the forward: " + ", ".join(f"{w} {us:.1f}" for w, us in
                         ways.items()) + f" us: duolm's kernel {ways['penalty'] / ways['duolm']:.2f}x the penalty, "
                         f"{ways['llguidance'] / ways['duolm']:.2f}x llguidance's own")
            print(line)
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
