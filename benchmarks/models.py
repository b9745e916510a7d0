"""duolm's GPT-2 and BERT against HF transformers: same config, same weights, same inputs, CPU.

    .venv/bin/python benchmarks/models.py                 # all four cases, 5 rounds each
    .venv/bin/python benchmarks/models.py --rounds 3 --cases gpt2-infer,bert-infer
    .venv/bin/python benchmarks/models.py --pad-vocab 64  # our GPT-2 with its vocabulary padded

This machine's speed drifts (shared cores, up to 2x over tens of minutes), so only interleaved
ratios mean anything: every round times one step of each side back to back, alternating which goes
first, plus a fp32 matmul probe; we report medians over rounds. Threads: 2 (torch.set_num_threads).

Cases (tokens/s = batch * seq / step time):
  gpt2-train  GPT-2 124M, 4x256: forward, cross-entropy over all positions, backward, AdamW step
  gpt2-infer  GPT-2 124M, 8x256: forward to logits at every position (torch.inference_mode)
  bert-train  BERT-base BertForPreTraining, 8x128, dropout 0.1: MLM logits at every position (the
              models' forward; the loss reads the 15% masked ones, labels -100 elsewhere) + NSP,
              backward, AdamW step. --mlm-masked-only computes the MLM head at the masked
              positions only, on both sides (same work), as a trainer would.
  bert-infer  BERT-base encoder (hidden states + pooled), 32x128, inference_mode
Both sides use torch.optim.AdamW(fused=True), HF Trainer's default on torch >= 2.8, and the same
loss code; HF models run with attn_implementation="sdpa" (their default and fastest here).

Roofline: the probe times fp32 matmuls of the models' own shapes; "fraction" is our achieved
FLOP/s over that, with FLOPs/token = 2 * (matmul weights) + attention (GPT-2: causal, 2*L*T*C;
BERT: 4*L*T*C); training counts 3x the forward.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

# benchmarks/ holds tokenizers.py, which would shadow the `tokenizers` package transformers needs.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.convert import hf as conv
from duolm.models import BertConfig, BertForPreTraining, GPT2, GPT2Config

try:
    import transformers
except ImportError as e:   # pragma: no cover
    raise SystemExit(f"this benchmark compares against transformers, which is not installed: {e}")

transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# Timing helpers

def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def matmul_probe(shapes, reps=2) -> float:
    """GFLOP/s of fp32 x @ w.T over the given (M, K, N) shapes (the models' own linears)."""
    mats = [(torch.randn(m, k), torch.randn(n, k)) for m, k, n in shapes]
    flops = sum(2 * m * k * n for m, k, n in shapes) * reps
    F.linear(*mats[0])
    t = timed(lambda: [F.linear(x, w) for _ in range(reps) for x, w in mats])
    return flops / t / 1e9


def aligned(n: int) -> int:
    """Probe shapes use the vocabulary rounded up to 64: the machine's speed, not an odd shape's."""
    return -(-n // 64) * 64


def run_case(name, ours_step, theirs_step, tokens, flops_per_token, probe_shapes, rounds):
    print(f"\n== {name}: {tokens} tokens/step, {flops_per_token / 1e6:.0f} MFLOP/token", flush=True)
    ours_step(), theirs_step()                        # warm-up (allocator, MKL, lazy init)
    rows = []
    for r in range(rounds):
        before = matmul_probe(probe_shapes)
        if r % 2 == 0:
            a, b = timed(ours_step), timed(theirs_step)
        else:
            b, a = timed(theirs_step), timed(ours_step)
        probe = (before + matmul_probe(probe_shapes)) / 2     # the machine's speed around this pair
        rows.append((tokens / a, tokens / b, b / a, probe))
        print(f"  round {r + 1}: ours {tokens / a:8.1f} tok/s  transformers {tokens / b:8.1f} tok/s  "
              f"ratio {b / a:.3f}  matmul {probe:.1f} GFLOP/s", flush=True)
    med = [statistics.median(col) for col in zip(*rows)]
    frac = [row[0] * flops_per_token / 1e9 / row[3] for row in rows]
    frac_hf = [row[1] * flops_per_token / 1e9 / row[3] for row in rows]
    best = max(r[0] for r in rows) / max(r[1] for r in rows)
    print(f"  median: ours {med[0]:.1f} tok/s, transformers {med[1]:.1f} tok/s, ratio {med[2]:.3f} "
          f"(ratio of best steps {best:.3f}; rounds {min(r[2] for r in rows):.2f}..{max(r[2] for r in rows):.2f}); "
          f"matmul {med[3]:.1f} GFLOP/s; ours at {statistics.median(frac):.0%} of it, "
          f"transformers at {statistics.median(frac_hf):.0%}", flush=True)
    return med[2], best


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


def lm_loss(logits, x):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def case_gpt2_train(rounds):
    cfg, ours, theirs = gpt2_pair()
    B, T = 4, 256
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-5, fused=True)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-5, fused=True)
    ours.train(), theirs.train()

    def step(model, opt, logits_of):
        loss = lm_loss(logits_of(model(x[:, :-1])), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, 4 * C), (B * T, 4 * C, C), (B * T, C, aligned(cfg.vocab_size))]
    return run_case(f"GPT-2 124M training step {B}x{T} (fwd+bwd+AdamW)",
                    lambda: step(ours, opt_o, lambda o: o), lambda: step(theirs, opt_t, lambda o: o.logits),
                    B * T, 3 * gpt2_flops(cfg, T), probe, rounds)


def case_gpt2_infer(rounds):
    cfg, ours, theirs = gpt2_pair()
    B, T = 8, 256
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    ours.eval(), theirs.eval()
    with torch.inference_mode():
        torch.testing.assert_close(ours(x[:1, :32]), theirs(x[:1, :32]).logits, atol=1e-4, rtol=0)

    def step(model):
        with torch.inference_mode():
            model(x)

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, 4 * C), (B * T, 4 * C, C), (B * T, C, aligned(cfg.vocab_size))]
    return run_case(f"GPT-2 124M inference forward {B}x{T}",
                    lambda: step(ours), lambda: step(theirs), B * T, gpt2_flops(cfg, T), probe, rounds)


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


def case_bert_train(rounds, masked_only):
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

    def ours_step():
        if masked_only:
            hidden, pooled = ours.bert(x, seg)
            loss = loss_of(ours.mlm(hidden[sel]), ours.nsp(pooled), x[sel])
        else:
            loss = loss_of(*ours(x, seg), labels)
        loss.backward()
        opt_o.step()
        opt_o.zero_grad(set_to_none=True)

    def theirs_step():
        if masked_only:
            out = theirs.bert(x, token_type_ids=seg)
            loss = loss_of(theirs.cls.predictions(out.last_hidden_state[sel]),
                           theirs.cls.seq_relationship(out.pooler_output), x[sel])
        else:
            out = theirs(x, token_type_ids=seg)
            loss = loss_of(out.prediction_logits, out.seq_relationship_logits, labels)
        loss.backward()
        opt_t.step()
        opt_t.zero_grad(set_to_none=True)

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, cfg.n_inner), (B * T, cfg.n_inner, C), (B * T, C, aligned(cfg.vocab_size))]
    mlm_tokens = chosen.float().mean().item() if masked_only else 1.0
    return run_case(f"BERT-base training step {B}x{T} (MLM {'at masked positions' if masked_only else 'at all positions'}"
                    f" + NSP, fwd+bwd+AdamW, dropout 0.1)", ours_step, theirs_step, B * T,
                    3 * bert_flops(cfg, T, mlm_tokens), probe, rounds)


def case_bert_infer(rounds):
    cfg, ours, theirs = bert_pair(dropout=0.1)
    ours, theirs = ours.bert.eval(), theirs.bert.eval()
    B, T = 32, 128
    x = torch.randint(1000, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x[:1])[0], theirs(x[:1]).last_hidden_state, atol=1e-4, rtol=0)

    def step(model):
        with torch.inference_mode():
            model(x)

    C = cfg.n_embd
    probe = [(B * T, C, 3 * C), (B * T, C, cfg.n_inner), (B * T, cfg.n_inner, C)]
    return run_case(f"BERT-base encoder inference {B}x{T}", lambda: step(ours), lambda: step(theirs),
                    B * T, bert_flops(cfg, T, 0), probe, rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="gpt2-train,gpt2-infer,bert-train,bert-infer")
    ap.add_argument("--mlm-masked-only", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    cases = {
        "gpt2-train": lambda: case_gpt2_train(args.rounds),
        "gpt2-infer": lambda: case_gpt2_infer(args.rounds),
        "bert-train": lambda: case_bert_train(args.rounds, args.mlm_masked_only),
        "bert-infer": lambda: case_bert_infer(args.rounds),
    }
    results = {}
    for name in args.cases.split(","):
        if name not in cases:
            raise SystemExit(f"unknown case {name!r}; choose from {', '.join(cases)}")
        results[name] = cases[name]()
        gc.collect()
    print("\nsummary: ours / transformers tokens/s (median of interleaved rounds; ratio of best steps)")
    for name, (ratio, best) in results.items():
        print(f"  {name:11s} {ratio:.3f}x  ({best:.3f}x)")


if __name__ == "__main__":
    main()
