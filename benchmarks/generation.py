"""Greedy decoding speed: duolm.generate against transformers' generate, GPT-2 124M random weights, CPU.

Same weights on both sides (copied with duolm.convert.hf), a 32-token prompt, 128 new tokens, greedy,
batch 1 and batch 8, torch.set_num_threads(2). Rows, each in its precision:
  duolm plain fp32        generate() on the model as it is: PyTorch's F.linear (MKL)
  duolm quantize(fp32)    on duolm.precision.quantize(model, "fp32"): the fp32 engines timed on this machine
                          (duolm.engines: duolm.kernels' fp32 kernel, oneDNN or F.linear; `duolm env` prints them)
                          (`duolm generate`'s CPU default); the same ids
  duolm quantize(fp32) compiled, duolm quantize(int8) compiled
                          the same models through generate(compile=True): duolm.generation.static's step, compiled
                          in the warm-up (the seconds printed)
  transformers fp32       GPT2LMHeadModel.generate
  duolm quantize(int8)    int8 / bf16 linears (`duolm generate --precision int8 / bf16`): narrow
  duolm quantize(bf16)    weights and matmul inputs; LayerNorms, softmax and the KV cache stay fp32
  duolm bf16 on F.linear  where the CPU computes bf16 natively, the bf16 rows' products through F.linear (which
                          reorders the weight every call) instead of oneDNN's weight packed once: the same ids
Every round runs every row once, the order rotated each round; each row reports the median of
--rounds rounds. Ratios: the fp32 rows over transformers fp32; the int8 / bf16 rows over duolm
quantize(fp32). Batch-1 decoding is memory-bound: every token reads all weights once, so the bound
is (read bandwidth measured here) / (bytes one token reads: matrices at the row's width, the rest
fp32, the mean KV cache).

Then what the int8 / bf16 swaps change in the numbers on these random weights: KL(fp32 || mode) and
top-1 agreement of next-token distributions on 1,024 WikiText-2 test tokens (perplexity of random
weights means nothing; benchmarks/precision_quality.py measures trained weights).

    python benchmarks/generation.py [--threads 2] [--new-tokens 128] [--rounds 3]
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import re
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the
# `tokenizers` package that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from duolm.convert.hf import gpt2_config_to_hf, gpt2_to_hf
from duolm.generation import generate
from duolm.generation.static import decoder_of
from duolm.models import GPT2, GPT2Config
from duolm.precision import BF16Linear, fp32_choice, machine, quantize

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WIDTH = {"fp32": 4, "bf16": 2, "int8": 1}           # bytes per matrix weight


def bandwidth_gbs(n_bytes=1 << 30, repeats=3):
    """Read bandwidth: sum over a 1 GiB fp32 tensor (a pure streaming read, like weight reads)."""
    a = torch.ones(n_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def bytes_per_token(model, ctx, width=4):
    """Bytes one batch-1 decoding step reads: the matrices (block weights and the tied output layer,
    which is the token embedding) at `width` bytes a weight, biases and LayerNorms in fp32 (of wpe
    one row), and the KV cache at context length ctx."""
    cfg = model.config
    matrices = model.wte.weight.numel() + sum(p.numel() for p in model.h.parameters() if p.dim() == 2)
    rest = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel() - matrices
    return width * matrices + 4 * (rest + 2 * cfg.n_layer * ctx * cfg.n_embd)


def ours_run(model, prompts, new, compile=False):
    with torch.inference_mode():
        out = [[] for _ in prompts]
        for step in generate(model, prompts, new, temperature=0, compile=compile):
            for i, x in enumerate(step):
                out[i].append(x)
        return out


def hf_run(hf, prompts, new):
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        o = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0, eos_token_id=None)
        return o[:, ids.shape[1]:].tolist()


def rounds(runs: dict, new: int, n: int) -> tuple[dict, dict]:
    """Every run once per round, `new` tokens, the order rotated each round -> ({name: median seconds},
    {name: ids})."""
    names = list(runs)
    times, ids = {k: [] for k in names}, {}
    for r in range(n):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            ids[k] = runs[k](new)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, ids


def kl_and_agreement(model, fast, ids, T=128):
    """Mean KL(model || fast) in nats per token and the share of positions with the same argmax."""
    x = torch.tensor(ids[: (len(ids) // T) * T]).view(-1, T)
    kls, agree = 0.0, 0
    with torch.inference_mode():
        for row in x.split(4):
            r, q = model(row).log_softmax(-1), fast(row).log_softmax(-1)
            kls += (r.exp() * (r - q)).sum().item()
            agree += (r.argmax(-1) == q.argmax(-1)).sum().item()
    return kls / x.numel(), agree / x.numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
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
    m = machine()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; CPU {m['cpu']}, native bf16 "
          f"{m['native_bf16']}, {m['threads']} threads; fp32 {fp32_choice()['few']} (few rows), {fp32_choice()['wide']} (more); "
          f"load average at start "
          f"{os.getloadavg()[0]:.2f}\nGPT-2 124M random weights ({ours.num_params():,} params), prompt {P} tokens, "
          f"{N} new, greedy, median of {args.rounds} rounds", flush=True)

    models = {"duolm plain fp32": ours, **{f"duolm quantize({p})": quantize(copy.deepcopy(ours), p)
                                           for p in ("fp32", "int8", "bf16")}}
    unpacked = quantize(copy.deepcopy(ours), "bf16")
    if any(m.packed is not None for m in unpacked.modules() if isinstance(m, BF16Linear)):
        for m in unpacked.modules():
            if isinstance(m, BF16Linear):
                m.packed = None                      # what BF16Linear runs on CPUs without native bf16
        models["duolm bf16 on F.linear"] = unpacked
    bw = bandwidth_gbs()
    results = {}
    for B in (1, 8):
        prompts = prompts8[:B]
        runs = {k: functools.partial(ours_run, model, prompts) for k, model in models.items()}
        for p in ("fp32", "int8"):
            runs[f"duolm quantize({p}) compiled"] = functools.partial(ours_run, models[f"duolm quantize({p})"],
                                                                      prompts, compile=True)
        runs["transformers fp32"] = functools.partial(hf_run, hf, prompts)
        for k, run in runs.items():                      # warm-up: packing, kernel choice, allocator, compilation
            run(N if "compiled" in k else 4)
        print(f"\nbatch {B}: the compiled steps' compilation (in the warm-up): " + ", ".join(
            f"{p} {decoder_of(models[f'duolm quantize({p})']).compile_s:.1f} s" for p in ("fp32", "int8")))
        times, ids = rounds(runs, N, args.rounds)
        results[B] = {k: B * N / t for k, t in times.items()}
        same = ids["duolm plain fp32"] == ids["duolm quantize(fp32)"] == ids["duolm quantize(fp32) compiled"] \
            == ids["transformers fp32"]
        print(f"\nbatch {B}: the fp32 rows give the same ids: {same}", flush=True)
        if "duolm bf16 on F.linear" in ids:
            print(f"batch {B}: the bf16 rows give the same ids: "
                  f"{ids['duolm quantize(bf16)'] == ids['duolm bf16 on F.linear']}", flush=True)
    bw = max(bw, bandwidth_gbs())            # measured before and after the runs; the better one
    print(f"\nread bandwidth (1 GiB sum) {bw:.1f} GB/s; batch-1 bound = bandwidth / bytes per token "
          f"(mean context {P + N // 2})")
    print(f"{'row':<30} {'precision':>9} {'b1 tok/s':>9} {'b1 ratio':>9} {'b1 % bound':>10} {'b8 tok/s':>9} "
          f"{'b8 ratio':>9}   ratio against")
    for k in results[1]:
        precision = re.search("fp32|bf16|int8", k).group()
        base = "duolm quantize(fp32)" if precision in ("int8", "bf16") else "transformers fp32"
        bound = bw * 1e9 / bytes_per_token(ours, P + N // 2, WIDTH[precision])
        r1, r8 = (results[B][k] / results[B][base] for B in (1, 8))
        print(f"{k:<30} {precision:>9} {results[1][k]:>9.1f} {r1:>8.2f}x {100 * results[1][k] / bound:>9.0f}% "
              f"{results[8][k]:>9.1f} {r8:>8.2f}x   {base if k != base else ''}")

    test_txt = DATA / "wikitext-2" / "test.txt"
    if not test_txt.is_file():
        print(f"\n{test_txt} is absent: skipping KL and top-1 agreement")
        return
    from duolm.tokenizers import ByteLevelBPE
    gpt2_tok = ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
    ids = gpt2_tok.encode_ordinary(test_txt.read_text(encoding="utf-8")[:6_000])[:1024]
    print("\nrandom 124M weights, next-token distributions on the first 1,024 tokens of WikiText-2 test, "
          "against plain fp32:")
    for name in ("duolm quantize(fp32)", "duolm quantize(int8)", "duolm quantize(bf16)"):
        kl, agree = kl_and_agreement(ours, models[name], ids)
        print(f"  {name:<22} KL {kl:.2e} nats/token, top-1 agreement {100 * agree:.2f}%")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
