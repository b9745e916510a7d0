"""duolm on one NVIDIA GPU against transformers: the same model, settings and inputs, timed in one run.

    python benchmarks/gpu.py                                   # every case
    python benchmarks/gpu.py --cases gpt2-train --rounds 3 --json out.json

Cases (tokens/s; every round times each side once, the order rotated each round; medians of the rounds):
  gpt2-train  GPT-2 124M, --batch x 1024 tokens, nanoGPT's / llm.c's settings: bf16 autocast, torch.compile, fused
              SDPA attention, fused AdamW (lr 6e-4, betas 0.9 / 0.95, weight decay 0.1 on the matrices), gradient
              clipping at 1.0, TF32 for what stays fp32. transformers' GPT2LMHeadModel (attn_implementation="sdpa")
              the same, with the same loss code (duolm's GPT-2 pads its vocabulary to 50,304 rows inside the model, as
              nanoGPT does; transformers' keeps 50,257). MFU = FLOPs/token x tokens/s over the bf16 matmul peak measured
              at the start (8192^3), FLOPs/token = 6 N (N: the matrix weights, the tied output layer included) +
              12 L T C (attention's scores and mixing, forward and backward, as PaLM's appendix counts them).
              Then 3 steps of each side profiled: the kernels' time by kind (products, attention, optimizer,
              compiled elementwise, other) and the costliest kernels, where MFU's shortfall goes.
  bert-train  BERT-base pretraining step (MLM + NSP, 15% masked, dropout 0.1) at 128 and 512 tokens per sequence,
              bf16 autocast, torch.compile, fused AdamW: each library's own pretraining loss (duolm's MLM_NSP
              objective; transformers' BertForPreTraining(labels=, next_sentence_label=)); profiled as gpt2-train.
  decode      GPT-2 124M (--decode-model: another size) greedy decoding, 32-token prompt, 128 new tokens, batch 1 and 64
              (--decode-batches), bf16 and fp32 weights (TF32 off): duolm eager, duolm compiled (generate(compile=True):
              the static step replayed as a CUDA graph) and transformers.generate; the ids compared; at batch 1 the
              share of the bandwidth bound (all weights read once a token at the device-to-device copy bandwidth
              measured in the run) and a profile of one compiled step (its kernels, their count and time).
Ratios are duolm's tokens/s over transformers'. Prints the GPU, torch and transformers versions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.convert import hf as conv
from duolm.generation import generate
from duolm.generation.static import decoder_of
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config
from duolm.objectives import MLM_NSP, mlm_nsp_loss
from duolm.precision import autocast
from duolm.train.optim import make_optimizer

import transformers  # noqa: E402  (test/benchmark-only dependency)

transformers.logging.set_verbosity_error()
CUDA = torch.device("cuda")


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def peak_tflops(n=8192, reps=10) -> float:
    a, b = (torch.randn(n, n, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    return 2 * n ** 3 * reps / sync_time(lambda: [a @ b for _ in range(reps)]) / 1e12


def interleaved(sides: dict, tokens: int, steps: int, rounds: int) -> dict:
    """{name: step fn} -> {name: median tokens/s}; each round runs `steps` steps of every side, order rotated."""
    names = list(sides)
    rates = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            rates[k].append(tokens * steps / sync_time(lambda: [sides[k]() for _ in range(steps)]))
        print(f"  round {r + 1}: " + "  ".join(f"{k} {rates[k][-1]:,.0f}" for k in names) + " tok/s", flush=True)
    return {k: statistics.median(v) for k, v in rates.items()}


def train_step(model, loss_of, opt):
    """One optimizer step: loss_of() under bf16 autocast (compiled), backward, clip 1.0, fused AdamW."""
    def run():
        with autocast("bf16", CUDA):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def hf_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=6e-4, betas=(0.9, 0.95), fused=True)


def report(name, rates, flops_per_token, peak, compile_s) -> dict:
    (ours, a), (theirs, b) = rates.items()
    out = {"case": name, "duolm_tokens_per_s": a, "transformers_tokens_per_s": b, "ratio": a / b,
           "compile_s": compile_s}
    line = f"  {ours} {a:,.0f} tok/s, {theirs} {b:,.0f} tok/s: {a / b:.2f}x"
    if flops_per_token:
        out.update(duolm_mfu=a * flops_per_token / peak / 1e12, transformers_mfu=b * flops_per_token / peak / 1e12)
        line += f"; MFU {out['duolm_mfu']:.1%} vs {out['transformers_mfu']:.1%} of {peak:.0f} TFLOP/s"
    if compile_s:
        line += f" (compile+warm-up {compile_s['duolm']:.0f} s / {compile_s['transformers']:.0f} s)"
    print(line, flush=True)
    return out


def with_profiles(row: dict, sides: dict, steps: int = 3) -> dict:
    """row with a profile of `steps` steps of each side (profiled(): kernel time by kind), printed: where a step's
    time goes, and where the two sides' steps differ."""
    for name, fn in sides.items():
        row[f"{name}_profile"] = prof = profiled(fn, steps)
        print_profile(f"{name}'s step", prof)
    return row


def warm(sides: dict, n=3) -> dict:
    secs = {}
    for k, fn in sides.items():
        secs[k] = sync_time(lambda: [fn() for _ in range(n)])
    return secs


def case_gpt2_train(args, peak):
    torch.manual_seed(0)
    cfg = GPT2Config.preset("gpt2")
    ours = GPT2(cfg)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg),
                                                                  attn_implementation="sdpa"))
    theirs.load_state_dict(conv.gpt2_to_hf(ours.state_dict()))
    ours.to(CUDA).train(), theirs.to(CUDA).train()
    B, T = args.batch, cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), device=CUDA, generator=torch.Generator(CUDA).manual_seed(1))

    def lm_loss(logits):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))

    f_ours = torch.compile(lambda: lm_loss(ours(x[:, :-1])))
    f_theirs = torch.compile(lambda: lm_loss(theirs(x[:, :-1]).logits))
    sides = {"duolm": train_step(ours, f_ours, make_optimizer(ours, 6e-4, 0.1, (0.9, 0.95))),
             "transformers": train_step(theirs, f_theirs, hf_optimizer(theirs))}
    print(f"\n== GPT-2 124M training step {B}x{T}, bf16 autocast, compiled", flush=True)
    compile_s = warm(sides)
    N = sum(p.numel() for n, p in ours.named_parameters() if p.dim() == 2 and "wpe" not in n)
    flops = 6 * N + 12 * cfg.n_layer * T * cfg.n_embd
    return with_profiles(report("gpt2-train", interleaved(sides, B * T, args.steps, args.rounds), flops, peak,
                                compile_s), sides)


def case_bert_train(args, peak, T):
    torch.manual_seed(0)
    cfg = BertConfig.preset("bert-base", dropout=0.1)
    ours = BertForPreTraining(cfg)
    theirs = transformers.BertForPreTraining(transformers.BertConfig(
        **conv.bert_config_to_hf(cfg, heads=True), attn_implementation="sdpa"))
    theirs.load_state_dict(conv.bert_to_hf(ours.state_dict()))
    ours.to(CUDA).train(), theirs.to(CUDA).train()
    B = args.batch * 1024 // T
    g = torch.Generator(CUDA).manual_seed(3)
    x = torch.randint(1000, cfg.vocab_size, (B, T), device=CUDA, generator=g)
    seg = torch.zeros_like(x)
    seg[:, T // 2:] = 1
    chosen = torch.rand(B, T, device=CUDA, generator=g) < 0.15
    chosen[:, 0] = False
    labels = torch.where(chosen, x, torch.full_like(x, -100))
    nsp = torch.randint(0, 2, (B,), device=CUDA, generator=g)
    batch = {"idx": x, "segment_ids": seg, "mlm_labels": labels, "nsp_labels": nsp}
    f_ours = torch.compile(lambda: mlm_nsp_loss(MLM_NSP.forward(ours, batch), batch)[0])
    f_theirs = torch.compile(lambda: theirs(x, token_type_ids=seg, labels=labels, next_sentence_label=nsp).loss)
    sides = {"duolm": train_step(ours, f_ours, make_optimizer(ours, 1e-4, 0.01, (0.9, 0.999))),
             "transformers": train_step(theirs, f_theirs, hf_optimizer(theirs))}
    print(f"\n== BERT-base pretraining step {B}x{T} (MLM + NSP, each library's own loss), bf16 autocast, compiled",
          flush=True)
    compile_s = warm(sides)
    return with_profiles(report(f"bert-train-{T}", interleaved(sides, B * T, args.steps, args.rounds), 0, peak,
                                compile_s), sides)


def bandwidth_gbs(n_bytes=1 << 30, reps=20) -> float:
    """The GPU's memory bandwidth as a device-to-device copy moves it (bytes read + written per second, GB/s)."""
    a = torch.empty(n_bytes // 4, device=CUDA)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    return 2 * n_bytes * reps / sync_time(lambda: [b.copy_(a) for _ in range(reps)]) / 1e9


KINDS = (("products", ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitk")),     # a kernel's kind: the first whose
         ("attention", ("flash", "fmha", "sdpa", "attention")),                  # words its name holds
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("compiled (triton)", ("triton_",)))


def kernels(prof, steps: int, top: int = 12) -> dict:
    """A torch.profiler run's CUDA kernels per step: their count, summed time, the time by kind (KINDS: a kernel's
    name holding one of the words; the rest "other") and the costliest `top`."""
    ks = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: -e.device_time_total)
    by_kind: dict = {}
    for e in ks:
        kind = next((k for k, words in KINDS if any(w in e.key.lower() for w in words)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time_total / steps
    return {"kernels_per_step": sum(e.count for e in ks) / steps,
            "kernel_us_per_step": sum(e.device_time_total for e in ks) / steps, "us_by_kind": by_kind,
            "top": [{"kernel": e.key[:100], "us_per_step": e.device_time_total / steps, "per_step": e.count / steps}
                    for e in ks[:top]]}


def profiled(fn, steps: int) -> dict:
    """torch.profiler over `steps` calls of fn -> the wall time a call (us) and kernels()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = sync_time(lambda: [fn() for _ in range(steps)]) / steps
    return {"wall_us_per_step": 1e6 * wall, **kernels(prof, steps)}


def print_profile(what: str, prof: dict) -> None:
    kinds = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(prof["us_by_kind"].items(), key=lambda kv: -kv[1]))
    top = "\n".join(f"    {k['us_per_step']:9,.1f} {k['per_step']:5.0f}  {k['kernel']}" for k in prof["top"])
    print(f"  {what}, profiled: {prof['wall_us_per_step']:,.0f} us; {prof['kernels_per_step']:.0f} kernels, "
          f"{prof['kernel_us_per_step']:,.0f} us of them ({kinds}); the costliest (us a step, launches):\n{top}",
          flush=True)


def step_profile(model, needed: int, steps: int = 20) -> dict:
    """Where a batch-1 compiled decode step's time goes: torch.profiler over `steps` replays of the static step's CUDA
    graph (the bucket holding `needed` columns, built by the timed runs) -> the step's wall time and kernels(). Kernel
    time near the wall time: the kernels themselves decide; far below it: the gaps between them."""
    st = decoder_of(model).get(1, needed)
    nxt = torch.zeros(1, dtype=torch.long, device=CUDA)
    with torch.inference_mode():             # as generate runs it (the step's buffers are inference tensors)
        st.prefill(torch.zeros(1, 32, dtype=torch.long, device=CUDA), None)
        st.step(nxt)
        return profiled(lambda: st.step(nxt), steps)


def case_decode(args, emit) -> None:
    """Greedy decoding of a GPT-2 (random weights; 124M unless --decode-model) at batch 1 and 64 (--decode-batches),
    fp32 (TF32 off) and bf16 (the weights cast): duolm eager,
    duolm compiled (generate(compile=True): the static step, a CUDA graph) and transformers.generate, interleaved.
    The bound printed beside batch 1: every weight read once a token, at the copy bandwidth measured here."""
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = bandwidth_gbs()
    print(f"\n== memory bandwidth (device-to-device copy, read + written): {bw:,.0f} GB/s", flush=True)
    new = args.new_tokens
    for dtype in args.decode_dtypes.split(","):
        torch.manual_seed(0)
        cfg = GPT2Config.preset(args.decode_model)
        ours = GPT2(cfg).eval()
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**conv.gpt2_config_to_hf(cfg),
                                                                      attn_implementation="sdpa")).eval()
        theirs.load_state_dict(conv.gpt2_to_hf(ours.state_dict()))
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        ours.to(CUDA, dt), theirs.to(CUDA, dt)
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        bound = bw * 1e9 / weight_bytes
        for B in map(int, args.decode_batches.split(",")):
            prompts = torch.randint(0, cfg.vocab_size, (B, 32), generator=torch.Generator().manual_seed(B)).tolist()

            def run_ours(compile=False):
                gen = generate(ours, prompts, new, temperature=0, compile=compile)
                for _ in gen:
                    pass
                return gen.tokens

            def run_theirs():
                ids = torch.tensor(prompts, device=CUDA)
                with torch.inference_mode():
                    o = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                        min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
                return o[:, 32:].tolist()

            run_ours(True)                                         # the first call compiles and captures
            compile_s = decoder_of(ours).compile_s
            eager, compiled, hf = run_ours(), run_ours(True), run_theirs()
            same = {"compiled_vs_eager": compiled == eager, "eager_vs_transformers": eager == hf}
            print(f"\n== {args.decode_model} greedy decoding, batch {B}, 32 + {new} tokens, {dtype}; same ids: {same}; "
                  f"compile + capture {compile_s:.1f} s; batch-1 bound {bound:,.0f} tok/s "
                  f"({weight_bytes / 1e6:.0f} MB of weights)", flush=True)
            rates = interleaved({"duolm compiled": lambda: run_ours(True), "duolm eager": run_ours,
                                 "transformers": run_theirs}, B * new, 1, args.rounds)
            size = "" if args.decode_model == "gpt2" else f"{args.decode_model}-"
            row = {"case": f"decode-{size}{dtype}-b{B}",
                   **{f"{k.replace(' ', '_')}_tokens_per_s": v for k, v in rates.items()},
                   "ratio": rates["duolm compiled"] / rates["transformers"],
                   "eager_ratio": rates["duolm eager"] / rates["transformers"],
                   "compile_s": compile_s, "same_ids": same, "bandwidth_gbs": bw, "weight_bytes": weight_bytes}
            if B == 1:
                row["bound_tokens_per_s"] = bound
                row["share_of_bound"] = rates["duolm compiled"] / bound
                row["profile"] = prof = step_profile(ours, 32 + new - 1)
            print(f"  compiled {row['ratio']:.2f}x transformers (eager {row['eager_ratio']:.2f}x)"
                  + (f"; {row['share_of_bound']:.0%} of the bandwidth bound" if B == 1 else ""), flush=True)
            if B == 1:
                print_profile("one compiled step", prof)
            emit(row)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gpt2-train,bert-train,decode")
    ap.add_argument("--batch", type=int, default=16, help="GPT-2 sequences of 1024 per step (BERT: the same tokens)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode: tokens generated after the 32-token prompt")
    ap.add_argument("--decode-dtypes", default="bf16,fp32", help="decode: the weights' dtypes, comma-separated")
    ap.add_argument("--decode-model", default="gpt2", help="decode: the GPT-2 preset (gpt2-xl: 1.5B, where a token's "
                                                           "kernels are larger than their launches)")
    ap.add_argument("--decode-batches", default="1,64", help="decode: the batch sizes, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True                  # nanoGPT's setting for what stays fp32
    peak = peak_tflops()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
               "peak_tflops": peak, "cases": []}
    def emit(row):          # each row written as it comes: a run stopped by its time limit keeps what it measured
        results["cases"].append(row)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")

    for case in args.cases.split(","):
        if case == "gpt2-train":
            emit(case_gpt2_train(args, peak))
        elif case == "bert-train":
            for T in (128, 512):
                emit(case_bert_train(args, peak, T))
        elif case == "decode":
            case_decode(args, emit)
        else:
            raise SystemExit(f"unknown case {case!r}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
