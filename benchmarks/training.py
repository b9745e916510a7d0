"""Training throughput: duolm's train() on duolm's GPT-2 vs a plain transformers GPT2LMHeadModel loop.

Same config (ours with the vocabulary padded to a multiple of 64, as `duolm pretrain` does; invisible
in outputs), same batches (random tokens), same AdamW (decay on matrices only), same clipping, CPU, fp32.
The two loops are alternated (ours, theirs, ours, theirs...) so machine load hits both alike; tokens/s is
the median over the timed steps (the first step of each round is a warm-up and not timed).

    .venv/bin/python benchmarks/training.py                       # 124M at 4x256, and tiny at 16x64
    .venv/bin/python benchmarks/training.py --configs tiny --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F

from duolm.models import GPT2, GPT2Config
from duolm.train import CAUSAL_LM, TrainConfig, lr_at, train

CONFIGS = {  # name: (model overrides, batch, block)
    "gpt2-124M": (dict(), 4, 256),
    "tiny": (dict(vocab_size=512, n_layer=2, n_head=2, n_embd=64), 16, 64),
}


class RandomTokens:
    def __init__(self, vocab, T):
        self.vocab, self.T = vocab, T

    def batch(self, step, batch_size, rank=0, world_size=1):
        g = torch.Generator().manual_seed(step)
        w = torch.randint(0, self.vocab, (batch_size, self.T + 1), generator=g)
        return {"x": w[:, :-1], "y": w[:, 1:]}


def ours(config, B, T, steps):
    torch.manual_seed(0)
    model = GPT2(config)
    rows = train(model, CAUSAL_LM, RandomTokens(config.vocab_size, T),
                 TrainConfig(max_steps=steps + 1, batch_size=B, lr=3e-4, warmup_steps=1))["rows"]
    return [r["tokens_per_s"] for r in rows[1:]]


def theirs(config, B, T, steps):
    import transformers
    from duolm.convert.hf import gpt2_config_to_hf

    torch.manual_seed(0)
    d = {k: v for k, v in gpt2_config_to_hf(config).items() if k not in ("architectures", "model_type")}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**d)).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=True)
    data, speeds = RandomTokens(config.vocab_size, T), []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, 3e-4, 1, steps + 1)
        b = data.batch(step, B)
        logits = model(input_ids=b["x"]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), b["y"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if step:
            speeds.append(B * T / (time.perf_counter() - t0))
    return speeds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 3 for 124M, 20 tiny)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU fp32")
    for name in args.configs:
        overrides, B, T = CONFIGS[name]
        config = GPT2Config(block_size=max(T, 64), **overrides)
        steps = args.steps or (3 if name == "gpt2-124M" else 20)
        a, b = [], []
        for _ in range(args.rounds):
            a += ours(config, B, T, steps)
            b += theirs(config, B, T, steps)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:10s} {B}x{T}: duolm {ma:10,.0f} tok/s   transformers {mb:10,.0f} tok/s   ratio {ma / mb:.2f}x")


if __name__ == "__main__":
    main()
