"""Greedy decoding speed: duolm.generate vs transformers' generate, on GPT-2 124M random weights.

Same weights on both sides (copied with duolm.convert.hf), a 32-token prompt, 128 new tokens,
greedy, batch 1 and batch 8, CPU with torch.set_num_threads(2). The two sides alternate, and each
case keeps the best of --repeats runs (on a shared 2-core machine one run can be 2x off). Batch-1
decoding is memory-bound: every token reads all weights once, so the bound is (memory bandwidth
measured here) / (bytes read per token). Next to it, the matvec bound: one pass of F.linear over
all weights with a single row, i.e. what the CPU's BLAS gemv reaches on this layout.

A third row, "duolm, decode layout", is the same fp32 model through duolm.decoding.decode_layout
(what `duolm generate` uses for fp32): one-row matmuls read contiguous (in, out) copies of c_attn,
attn.c_proj, c_fc and the tied output layer, which MKL's gemv streams faster than nn.Linear's
(out, in). Same numbers up to fp32 rounding (the ids must equal); the cost is memory, the copies sit
beside the shared originals (for 124M: +226 MB of block matrices, +154 MB for the output layer,
whose (out, in) matrix is the token embedding wte).

Then the opt-in weight-only modes (duolm.decoding.quantize: int8 and bf16 matmul weights) at batch 1: their
speed against fp32 in the same run and what they change in the numbers:
  * on the 124M random weights, KL(fp32 || quantized) and top-1 agreement of next-token
    distributions on a WikiText-2 test slice (perplexity of random weights means nothing);
  * on a small GPT-2 trained here for a few hundred steps on WikiText-2 *valid*, the perplexity
    on a WikiText-2 *test* slice, fp32 vs int8 vs bf16 on the same weights.

    python benchmarks/generation.py [--threads 2] [--new-tokens 128] [--repeats 3] [--skip-ppl]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the
# `tokenizers` package that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.convert.hf import gpt2_config_to_hf, gpt2_to_hf
from duolm.generation import generate
from duolm.models import GPT2, GPT2Config
from duolm.decoding import decode_layout, quantize

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def bandwidth_gbs(n_bytes=1 << 30, repeats=3):
    """Read bandwidth: sum over a 1 GiB fp32 tensor (a pure streaming read, like weight reads)."""
    a = torch.ones(n_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    del a
    return n_bytes / best / 1e9


def matvec_pass_s(model, repeats=3):
    """Seconds for one batch-1 F.linear over every block weight and the output layer (best of
    `repeats`): the weight-reading part of a decoding step with nothing else around it."""
    ws = [model.wte.weight] + [p for p in model.h.parameters() if p.dim() == 2]
    xs = [torch.randn(1, w.shape[1]) for w in ws]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for w, x in zip(ws, xs):
                F.linear(x, w)
            best = min(best, time.perf_counter() - t)
    return best


def ours_run(model, prompts, new):
    with torch.inference_mode():
        t = time.perf_counter()
        out = [[] for _ in prompts]
        for step in generate(model, prompts, new, temperature=0):
            for i, x in enumerate(step):
                out[i].append(x)
        return time.perf_counter() - t, out


def hf_run(hf, prompts, new):
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t = time.perf_counter()
        o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0, eos_token_id=None)
        return time.perf_counter() - t, o[:, ids.shape[1]:].tolist()


def weight_bytes_per_token(model, ctx):
    """Bytes one batch-1 decoding step reads: every block weight and the tied output layer (the
    token embedding, which doubles as the output layer) plus LayerNorms and biases; of wpe only one
    row. Plus the KV cache at context length ctx."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    kv = 2 * cfg.n_layer * ctx * cfg.n_embd
    return 4 * (n + kv)


def wikitext_ids(path, tok, max_chars):
    text = path.read_text(encoding="utf-8")[:max_chars]
    return tok.encode_ordinary(text)


def kl_and_agreement(ref_model, q_model, ids, T=128):
    x = torch.tensor(ids[: (len(ids) // T) * T]).view(-1, T)
    with torch.inference_mode():
        kls, agree, n = 0.0, 0, 0
        for row in x.split(4):
            r = ref_model(row).log_softmax(-1)
            q = q_model(row).log_softmax(-1)
            kls += (r.exp() * (r - q)).sum(-1).sum().item()
            agree += (r.argmax(-1) == q.argmax(-1)).sum().item()
            n += row.numel()
    return kls / n, agree / n


def perplexity(model, ids, T=128):
    x = torch.tensor(ids[: (len(ids) // (T + 1)) * (T + 1)]).view(-1, T + 1)
    nll, n = 0.0, 0
    with torch.inference_mode():
        for row in x.split(8):
            logits = model(row[:, :-1])
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), row[:, 1:].reshape(-1), reduction="sum").item()
            n += row[:, 1:].numel()
    return math.exp(nll / n)


def train_small(train_ids, vocab_size, steps, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=256)
    model = GPT2(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.tensor(train_ids)
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 128
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        i = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        x = torch.stack([data[j:j + T] for j in i])
        y = torch.stack([data[j + 1:j + T + 1] for j in i])
        loss = F.cross_entropy(model(x).reshape(-1, vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval(), loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (best is kept)")
    ap.add_argument("--skip-ppl", action="store_true", help="skip training the small model for the perplexity check")
    ap.add_argument("--train-steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    cfg = GPT2Config.preset("gpt2")
    ours = GPT2(cfg).eval()
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in gpt2_config_to_hf(cfg).items()
                                        if k not in ("model_type", "architectures")})
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.load_state_dict(gpt2_to_hf(ours.state_dict()))
    P, N = args.prompt_tokens, args.new_tokens
    g = torch.Generator().manual_seed(1)
    prompts8 = torch.randint(0, cfg.vocab_size, (8, P), generator=g).tolist()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}; "
          f"GPT-2 124M random weights ({ours.num_params():,} params), prompt {P} tokens, {N} new, greedy")

    bw = bandwidth_gbs()
    dec = decode_layout(ours)
    extra = sum(b.numel() * b.element_size() for b in dec.buffers())
    ours_run(ours, prompts8[:1], 4), ours_run(dec, prompts8[:1], 4), hf_run(hf, prompts8[:1], 4)  # warm-up
    results = {}
    for B in (1, 8):
        prompts = prompts8[:B]
        t_ours = t_dec = t_hf = float("inf")
        for _ in range(args.repeats):
            t, ids_ours = ours_run(ours, prompts, N)
            t_ours = min(t_ours, t)
            t, ids_dec = ours_run(dec, prompts, N)
            t_dec = min(t_dec, t)
            t, ids_hf = hf_run(hf, prompts, N)
            t_hf = min(t_hf, t)
        results[B] = (B * N / t_ours, B * N / t_dec, B * N / t_hf, ids_ours == ids_hf, ids_dec == ids_ours)
    bw = max(bw, bandwidth_gbs())            # measured before and after the runs; the better one
    per_tok = weight_bytes_per_token(ours, P + N // 2)
    bound = bw * 1e9 / per_tok
    mv = matvec_pass_s(ours)
    print(f"memory read bandwidth (1 GiB sum): {bw:.1f} GB/s; batch-1 bytes per token "
          f"{per_tok / 1e6:.0f} MB (fp32 weights + mean KV cache) -> bound {bound:.1f} tok/s")
    print(f"matvec bound: one batch-1 F.linear pass over all weights takes {1e3 * mv:.1f} ms "
          f"({weight_bytes_per_token(ours, 0) / mv / 1e9:.1f} GB/s) -> {1 / mv:.1f} tok/s")
    print(f"{'batch':>5} {'duolm tok/s':>12} {'decode layout':>13} {'HF tok/s':>9} {'ratio':>6} {'decode/HF':>9} "
          f"{'same ids':>8}")
    for B, (a, d, b, same, same_dec) in results.items():
        print(f"{B:>5} {a:>12.1f} {d:>13.1f} {b:>9.1f} {a / b:>5.2f}x {d / b:>8.2f}x {str(same and same_dec):>8}")
    a1, d1, b1, _, _ = results[1]
    print(f"batch 1: duolm at {100 * a1 / bound:.0f}% of the memory bound ({100 * a1 * mv:.0f}% of the matvec "
          f"bound), duolm decode layout at {100 * d1 / bound:.0f}% ({100 * d1 * mv:.0f}%), "
          f"transformers at {100 * b1 / bound:.0f}% ({100 * b1 * mv:.0f}%)")
    print(f"decode layout (duolm generate's fp32 default): {d1 / a1:.2f}x plain fp32 at batch 1; costs "
          f"{extra / 1e6:.0f} MB of (in, out) copies ({dec.head_t.numel() * 4 / 1e6:.0f} MB of them the output "
          f"layer, tied to wte) beside the {4 * ours.num_params() / 1e6:.0f} MB of weights")
    del dec

    # weight-only int8 / bf16 at batch 1, against fp32 in the same run
    print("\nweight-only modes, batch 1 (duolm.decoding; fp32 activations, LayerNorm and KV cache):")
    # Interleaved, best of 3 short runs each: on a shared machine the fastest run is the one least
    # disturbed by other processes.
    qs = {"fp32": ours, "int8": quantize(ours, "int8"), "bf16": quantize(ours, "bf16")}
    n_short = min(N, 48)
    best = {m: float("inf") for m in qs}
    for m, q in qs.items():
        ours_run(q, prompts8[:1], 4)
    for _ in range(3):
        for m, q in qs.items():
            best[m] = min(best[m], ours_run(q, prompts8[:1], n_short)[0])
    print(f"{'mode':>5} {'tok/s':>7} {'vs fp32':>8} {'MB/token':>9} {'bound tok/s':>11}   (best of 3 runs of {n_short} tokens)")
    for m, q in qs.items():
        if m == "fp32":
            nbytes = per_tok
        else:   # narrow weights + fp32 biases/LayerNorms (wte/wpe: one row each) + mean KV cache
            kv_bytes = per_tok - weight_bytes_per_token(ours, 0)
            nbytes = sum(b.numel() * b.element_size() for b in q.buffers()) + sum(
                p.numel() * p.element_size() for p in q.parameters()) \
                - 4 * (q.wte.weight.numel() + q.inner.wpe.weight.numel()) + kv_bytes
        rate = n_short / best[m]
        print(f"{m:>5} {rate:>7.1f} {best['fp32'] / best[m]:>7.2f}x {nbytes / 1e6:>9.0f} {bw * 1e9 / nbytes:>11.1f}")
    del qs

    test_txt = DATA / "wikitext-2" / "test.txt"
    if not test_txt.is_file():
        print(f"\n{test_txt} is absent: skipping the accuracy checks")
        return
    from duolm.tokenizers import ByteLevelBPE
    gpt2_tok = ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    ids = wikitext_ids(test_txt, gpt2_tok, 6_000)[:1024]
    print(f"\nrandom 124M weights, next-token distributions on the first 1,024 tokens of WikiText-2 test "
          f"(perplexity of random weights is meaningless, so KL and top-1 agreement):")
    for mode in ("int8", "bf16"):
        q = quantize(ours, mode)
        kl, agree = kl_and_agreement(ours, q, ids)
        print(f"  {mode}: KL(fp32 || {mode}) = {kl:.2e} nats/token, top-1 agreement {100 * agree:.2f}%")
        del q

    if args.skip_ppl:
        return
    t0 = time.perf_counter()
    tok = ByteLevelBPE.train([(DATA / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")[:300_000]], vocab_size=1024)
    train_ids = tok.encode_ordinary((DATA / "wikitext-2" / "valid.txt").read_text(encoding="utf-8"))
    test_ids = tok.encode_ordinary(test_txt.read_text(encoding="utf-8")[:100_000])
    small, loss = train_small(train_ids, tok.vocab_size, args.train_steps)
    print(f"\nsmall GPT-2 (4 layers, 256 wide, BPE vocab {tok.vocab_size} trained on WikiText-2 valid) trained "
          f"{args.train_steps} steps on valid ({time.perf_counter() - t0:.0f} s, last loss {loss:.2f}); "
          f"perplexity on the first 100,000 chars of WikiText-2 test ({len(test_ids):,} tokens, windows of 128):")
    p32 = perplexity(small, test_ids)
    print(f"  fp32 {p32:.3f}")
    for mode in ("int8", "bf16"):
        p = perplexity(quantize(small, mode), test_ids)
        print(f"  {mode} {p:.3f} ({100 * (p / p32 - 1):+.2f}%)")


if __name__ == "__main__":
    main()
