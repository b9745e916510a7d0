"""duolm's GPT-2 and BERT against HF transformers: same config, same weights, same inputs, CPU.

    python benchmarks/models.py                       # all four cases in fp32, 5 rounds each
    python benchmarks/models.py --precision bf16      # training under bf16 autocast, inference in bf16
    python benchmarks/models.py --rounds 3 --cases gpt2-infer,bert-infer
    python benchmarks/models.py --default-malloc      # glibc's malloc as it comes (see below)

This machine's speed drifts (shared cores, up to 2x over tens of minutes), so only interleaved
ratios mean anything: every round times one step of each side back to back, rotating which goes
first, plus a matmul probe; we report medians over rounds. Threads: 2 (torch.set_num_threads).
Prints the CPU, its bf16 support and the load average at the start. The process first calls
duolm.malloc.keep_freed_memory() and huge_pages(), as the `duolm` command does, and both sides run under them
(--default-malloc: glibc's and torch's defaults for both).

Sides, by --precision (each row names its precision):
  fp32  training: duolm fp32 (what `duolm pretrain` / `finetune` run: the models' CPU dropout, duolm.models.dropout),
        transformers fp32.
        inference: duolm on the model swapped by duolm.precision.quantize(model, "fp32") (oneDNN on packed weights
        where duolm.engines timed it the faster, the path of `duolm predict` / `generate` / `serve`), duolm plain (F.linear,
        MKL), transformers fp32.
  bf16  training: duolm under bf16 autocast vs transformers under the same torch.autocast("cpu", dtype=bfloat16),
        and vs transformers fp32.
        inference: duolm on quantize(model, "bf16") (bf16 weights, fp32 activations), duolm plain under bf16
        autocast (the public path it replaces), transformers under bf16 autocast, transformers fp32.
Ratios are duolm's tokens/s over each other side's, median of the rounds' ratios.

Cases (tokens/s = batch * seq / step time):
  gpt2-train  GPT-2 124M, 4x256: forward, cross-entropy over all positions, backward, AdamW step
  gpt2-infer  GPT-2 124M, 8x256: forward to logits at every position (torch.inference_mode)
  bert-train  BERT-base BertForPreTraining, 8x128, dropout 0.1, 15% of positions masked: MLM + NSP loss,
              backward, AdamW step. --mlm picks the MLM head's positions:
                own     (default) each library's own pretraining loss, as its users run it: duolm's
                        MLM_NSP objective (what `duolm pretrain` runs: the head at the masked positions
                        alone, as the original implementation) vs transformers' BertForPreTraining(
                        labels=..., next_sentence_label=...) (the head at every position);
                all     the head at every position on both sides, the same loss code (same work);
                masked  the head at the masked positions on both sides (same work).
  bert-infer  BERT-base encoder (hidden states + pooled), 32x128, inference_mode
Both sides use torch.optim.AdamW(fused=True), HF Trainer's default on torch >= 2.8, and (but for
bert-train's --mlm own) the same loss code; HF models run with attn_implementation="sdpa" (their default and
fastest here).

Roofline: the probe times matmuls of the models' own shapes in the run's precision; "at N%" is duolm's
achieved FLOP/s over that, with FLOPs/token = 2 * (matmul weights) + attention (GPT-2: causal,
2*L*T*C; BERT: 4*L*T*C); training counts 3x the forward.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import sys
import time
from pathlib import Path

# benchmarks/ holds tokenizers.py, which would shadow the `tokenizers` package transformers needs.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.convert import hf as conv
from duolm.malloc import huge_pages, keep_freed_memory
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config
from duolm.objectives import MLM_NSP, mlm_nsp_loss
from duolm.precision import fp32_choice, machine, quantize

try:
    import transformers
except ImportError as e:   # pragma: no cover
    raise SystemExit(f"this benchmark compares against transformers, which is not installed: {e}")

transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# Sides and timing

def sides(precision: str, train: bool, ours, theirs, model=None) -> dict:
    """{row name: step} for this precision; ours(ctx) (training) / ours(model, ctx) (inference) and theirs(ctx) make
    a step run inside ctx(). The first row is duolm's, the one the ratios are of; inference runs it on a copy of
    `model` swapped by duolm.precision.quantize, as `duolm predict` / `generate` / `serve` do."""
    plain = contextlib.nullcontext
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)    # noqa: E731
    if train:
        if precision == "fp32":
            return {"duolm fp32": ours(plain), "transformers fp32": theirs(plain)}
        return {"duolm bf16 autocast": ours(autocast), "transformers bf16 autocast": theirs(autocast),
                "transformers fp32": theirs(plain)}
    fast = quantize(copy.deepcopy(model), precision)
    if precision == "fp32":
        return {f"duolm quantize(fp32) [{fp32_choice()['wide']}]": ours(fast, plain), "duolm plain fp32 [mkl]": ours(model, plain),
                "transformers fp32": theirs(plain)}
    return {"duolm quantize(bf16)": ours(fast, plain), "duolm plain under bf16 autocast": ours(model, autocast),
            "transformers bf16 autocast": theirs(autocast), "transformers fp32": theirs(plain)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_probe(shapes, dtype, reps=2) -> float:
    """GFLOP/s of x @ w.T in `dtype` over the given (M, K, N) shapes (the models' own linears)."""
    mats = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for m, k, n in shapes]
    flops = sum(2 * m * k * n for m, k, n in shapes) * reps
    F.linear(*mats[0])
    t = timed(lambda: [F.linear(x, w) for _ in range(reps) for x, w in mats])
    return flops / t / 1e9


def aligned(n: int) -> int:
    """Probe shapes use the vocabulary rounded up to 64: the machine's speed, not an odd shape's."""
    return -(-n // 64) * 64


def run_case(name, steps: dict, tokens, flops_per_token, probe_shapes, precision, rounds):
    """Rounds of one step of every side, the order rotated each round; -> {other side: median ratio}."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    print(f"\n== {name}: {tokens} tokens/step, {flops_per_token / 1e6:.0f} MFLOP/token", flush=True)
    for step in steps.values():                                  # warm-up (allocator, packing, lazy init)
        step()
    names = list(steps)
    rates = {k: [] for k in names}
    probes = []
    for r in range(rounds):
        before = matmul_probe(probe_shapes, dtype)
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            rates[k].append(tokens / timed(steps[k]))
        probes.append((before + matmul_probe(probe_shapes, dtype)) / 2)   # the machine's speed around this round
        print(f"  round {r + 1}: " + "  ".join(f"{k} {rates[k][-1]:.1f}" for k in names)
              + f" tok/s; matmul {probes[-1]:.1f} GFLOP/s", flush=True)
    ours = names[0]
    ratios = {k: statistics.median(a / b for a, b in zip(rates[ours], rates[k])) for k in names[1:]}
    frac = statistics.median(a * flops_per_token / 1e9 / p for a, p in zip(rates[ours], probes))
    for k in names:
        print(f"  median {k:<32} {statistics.median(rates[k]):8.1f} tok/s", flush=True)
    print(f"  {precision} matmul probe {statistics.median(probes):.1f} GFLOP/s; {ours} at {frac:.0%} of it", flush=True)
    for k, v in ratios.items():
        spread = [a / b for a, b in zip(rates[ours], rates[k])]
        print(f"  ratio {ours} / {k}: {v:.3f}x (rounds {min(spread):.2f}..{max(spread):.2f})", flush=True)
    return {f"{ours} / {k}": v for k, v in ratios.items()}


# ---------------------------------------------------------------------------------------------
# GPT-2

def gpt2_pair():
    torch.manual_seed(0)
    cfg = GPT2Config.preset("gpt2")
    ours = GPT2(GPT2Config.preset("gpt2"))
    theirs = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg), attn_implementation="sdpa"))
    theirs.load_state_dict(conv.gpt2_to_hf(ours.state_dict()))
    return cfg, ours, theirs


def gpt2_flops(cfg: GPT2Config, T: int) -> int:
    C, L = cfg.n_embd, cfg.n_layer
    return 2 * (L * 12 * C * C + cfg.vocab_size * C) + 2 * L * T * C


def gpt2_probe(cfg: GPT2Config, M: int) -> list:
    C = cfg.n_embd
    return [(M, C, 3 * C), (M, C, 4 * C), (M, 4 * C, C), (M, C, aligned(cfg.vocab_size))]


def lm_loss(logits, x):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def case_gpt2_train(precision, rounds):
    cfg, ours, theirs = gpt2_pair()
    B, T = 4, 256
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-5, fused=True)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-5, fused=True)
    ours.train(), theirs.train()

    def step(model, opt, logits_of, ctx):
        def run():
            with ctx():
                loss = lm_loss(logits_of(model(x[:, :-1])), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    return run_case(f"GPT-2 124M training step {B}x{T} (fwd+bwd+AdamW)",
                    sides(precision, True, lambda ctx: step(ours, opt_o, lambda o: o, ctx),
                          lambda ctx: step(theirs, opt_t, lambda o: o.logits, ctx)),
                    B * T, 3 * gpt2_flops(cfg, T), gpt2_probe(cfg, B * T), precision, rounds)


def case_gpt2_infer(precision, rounds):
    cfg, ours, theirs = gpt2_pair()
    B, T = 8, 256
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    ours.eval(), theirs.eval()
    with torch.inference_mode():
        want = theirs(x[:1, :32]).logits
        torch.testing.assert_close(ours(x[:1, :32]), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(quantize(copy.deepcopy(ours), "fp32")(x[:1, :32]), want, atol=1e-4, rtol=0)

    def step(model, ctx):
        def run():
            with torch.inference_mode(), ctx():
                model(x)
        return run

    return run_case(f"GPT-2 124M inference forward {B}x{T}",
                    sides(precision, False, step, lambda ctx: step(theirs, ctx), ours),
                    B * T, gpt2_flops(cfg, T), gpt2_probe(cfg, B * T), precision, rounds)


# ---------------------------------------------------------------------------------------------
# BERT

def bert_pair(dropout: float):
    torch.manual_seed(0)
    cfg = BertConfig.preset("bert-base", dropout=dropout)
    ours = BertForPreTraining(cfg)
    theirs = transformers.BertForPreTraining(
        transformers.BertConfig(**conv.bert_config_to_hf(cfg, heads=True), attn_implementation="sdpa"))
    theirs.load_state_dict(conv.bert_to_hf(ours.state_dict()))
    return cfg, ours, theirs


def bert_flops(cfg: BertConfig, T: int, mlm_tokens: float) -> int:
    C, L = cfg.n_embd, cfg.n_layer
    body = 2 * L * (4 * C * C + 2 * C * cfg.n_inner) + 4 * L * T * C
    return body + mlm_tokens * 2 * (C * C + cfg.vocab_size * C)


def case_bert_train(precision, rounds, mlm):
    cfg, ours, theirs = bert_pair(dropout=0.1)
    B, T = 8, 128
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1000, cfg.vocab_size, (B, T), generator=g)
    seg = torch.zeros_like(x)
    seg[:, T // 2:] = 1
    chosen = torch.rand(B, T, generator=g) < 0.15
    chosen[:, 0] = False
    labels = torch.where(chosen, x, torch.full_like(x, -100))
    nsp_labels = torch.randint(0, 2, (B,), generator=g)
    sel = chosen.nonzero(as_tuple=True)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-5, fused=True)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-5, fused=True)
    ours.train(), theirs.train()

    def loss_of(mlm, nsp, y):
        return F.cross_entropy(mlm.reshape(-1, mlm.size(-1)), y.reshape(-1)) + F.cross_entropy(nsp, nsp_labels)

    batch = {"idx": x, "segment_ids": seg, "mlm_labels": labels, "nsp_labels": nsp_labels}

    def ours_loss():
        if mlm == "own":
            return mlm_nsp_loss(MLM_NSP.forward(ours, batch), batch)[0]
        if mlm == "masked":
            hidden, pooled = ours.bert(x, seg)
            return loss_of(ours.mlm(hidden[sel]), ours.nsp(pooled), x[sel])
        return loss_of(*ours(x, seg), labels)

    def theirs_loss():
        if mlm == "own":
            return theirs(x, token_type_ids=seg, labels=labels, next_sentence_label=nsp_labels).loss
        if mlm == "masked":
            out = theirs.bert(x, token_type_ids=seg)
            return loss_of(theirs.cls.predictions(out.last_hidden_state[sel]),
                           theirs.cls.seq_relationship(out.pooler_output), x[sel])
        out = theirs(x, token_type_ids=seg)
        return loss_of(out.prediction_logits, out.seq_relationship_logits, labels)

    def step(loss_fn, opt, ctx):
        def run():
            with ctx():
                loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, cfg.n_inner), (B * T, cfg.n_inner, C), (B * T, C, aligned(cfg.vocab_size))]
    mlm_tokens = 1.0 if mlm == "all" else chosen.float().mean().item()          # duolm's
    where = {"own": "each library's own loss", "all": "at all positions", "masked": "at masked positions"}[mlm]
    return run_case(f"BERT-base training step {B}x{T} (MLM {where} + NSP, fwd+bwd+AdamW, dropout 0.1)",
                    sides(precision, True, lambda ctx: step(ours_loss, opt_o, ctx), lambda ctx: step(theirs_loss, opt_t, ctx)),
                    B * T, 3 * bert_flops(cfg, T, mlm_tokens), probe, precision, rounds)


def case_bert_infer(precision, rounds):
    cfg, ours, theirs = bert_pair(dropout=0.1)
    ours, theirs = ours.bert.eval(), theirs.bert.eval()
    B, T = 32, 128
    x = torch.randint(1000, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = theirs(x[:1]).last_hidden_state
        torch.testing.assert_close(ours(x[:1])[0], want, atol=1e-4, rtol=0)
        torch.testing.assert_close(quantize(copy.deepcopy(ours), "fp32")(x[:1])[0], want, atol=1e-4, rtol=0)

    def step(model, ctx):
        def run():
            with torch.inference_mode(), ctx():
                model(x)
        return run

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, cfg.n_inner), (B * T, cfg.n_inner, C)]
    return run_case(f"BERT-base encoder inference {B}x{T}",
                    sides(precision, False, step, lambda ctx: step(theirs, ctx), ours),
                    B * T, bert_flops(cfg, T, 0), probe, precision, rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="gpt2-train,gpt2-infer,bert-train,bert-infer")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--mlm", choices=("own", "all", "masked"), default="own", help="bert-train's MLM positions")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc and torch's pages at their defaults")
    args = ap.parse_args()
    kept = not args.default_malloc and keep_freed_memory()
    huge = not args.default_malloc and huge_pages()
    torch.set_num_threads(args.threads)
    m = machine()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; CPU {m['cpu']}, native bf16 "
          f"{m['native_bf16']}, {m['threads']} threads; fp32 engine {fp32_choice()['wide']} (wide products); precision {args.precision}; "
          f"freed memory kept, huge pages (duolm.malloc) {kept}, {huge}; load average at start "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    p, r = args.precision, args.rounds
    cases = {
        "gpt2-train": lambda: case_gpt2_train(p, r),
        "gpt2-infer": lambda: case_gpt2_infer(p, r),
        "bert-train": lambda: case_bert_train(p, r, args.mlm),
        "bert-infer": lambda: case_bert_infer(p, r),
    }
    results = {}
    for name in args.cases.split(","):
        if name not in cases:
            raise SystemExit(f"unknown case {name!r}; choose from {', '.join(cases)}")
        results[name] = cases[name]()
        gc.collect()
    print(f"\nsummary ({args.precision}): duolm's tokens/s over the other side's (median of interleaved rounds)")
    for name, ratios in results.items():
        for k, v in ratios.items():
            print(f"  {name:11s} {k:<62} {v:.3f}x")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
