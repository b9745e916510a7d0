"""Peak memory per process of training GPT-2 124M under DDP vs FSDP2 (torchrun, gloo, CPU, fp32), beside
duolm.train.memory's estimate: the estimate counts parameters, gradients, AdamW state and activations; the measured
figure is the peak resident memory (ru_maxrss) over what the process held before it built the model (PyTorch,
Python, the process group).

    .venv/bin/python benchmarks/memory.py                          # 2 processes, ddp and fsdp, 2 x 128 a process
    .venv/bin/python benchmarks/memory.py --preset tiny --kinds fsdp
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
import torch.distributed as dist

from duolm.models import GPT2, GPT2Config
from duolm.train import CAUSAL_LM, TrainConfig, setup_distributed, train
from duolm.train.memory import layout

GB = 10 ** 9


class RandomTokens:
    def __init__(self, vocab, T):
        self.vocab, self.T = vocab, T

    def batch(self, step, batch_size, rank=0, world_size=1):
        g = torch.Generator().manual_seed(step)
        w = torch.randint(0, self.vocab, (batch_size, self.T + 1), generator=g)[rank::world_size]
        return {"x": w[:, :-1], "y": w[:, 1:]}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024        # Linux: KiB


def worker(args):
    """One process under torchrun: train a few steps, report (peak RSS over the start, the estimate) to rank 0."""
    device, rank = setup_distributed("cpu")
    world = dist.get_world_size()
    start = _rss()
    torch.manual_seed(0)
    model = GPT2(GPT2Config.preset(args.preset, block_size=args.block, dropout=0.0))
    cfg = TrainConfig(max_steps=args.steps, batch_size=args.micro * world, lr=3e-4, warmup_steps=1,
                      parallel=args.parallel, precision="fp32", eval_every=0)
    estimate = layout(model, cfg, world).memory
    train(model, CAUSAL_LM, RandomTokens(model.config.vocab_size, args.block), cfg)
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "start": start, "peak": _rss(), "estimate": estimate.total,
                                  "parts": str(estimate)})
    if rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--kinds", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--micro", type=int, default=2, help="sequences a process takes a step")
    ap.add_argument("--block", type=int, default=128, help="tokens a sequence")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (the first makes AdamW's state)")
    ap.add_argument("--parallel", help=argparse.SUPPRESS)               # set for the worker processes
    args = ap.parse_args()
    if args.parallel:
        return worker(args)
    print(f"torch {torch.__version__}, GPT-2 {args.preset}, {args.processes} processes, {args.micro} x {args.block} "
          f"tokens a process a step, fp32, CPU (gloo); load average {os.getloadavg()[0]:.2f}")
    for kind in args.kinds:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.processes), __file__, "--parallel", kind, "--preset", args.preset, "--micro", str(args.micro),
               "--block", str(args.block), "--steps", str(args.steps)]
        # every allocation over 64 KiB its own mapping, returned when freed: resident memory follows the live tensors
        # (glibc's default raises that threshold as tensors are freed, and keeps what it then frees)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        rows = json.loads(out.strip().splitlines()[-1])
        for r in rows:
            measured = r["peak"] - r["start"]
            print(f"{kind:4s} rank {r['rank']}: peak {r['peak'] / GB:.2f} GB, {measured / GB:.2f} GB over the start "
                  f"({r['start'] / GB:.2f} GB); estimate {r['estimate'] / GB:.2f} GB ({r['parts']}); "
                  f"measured / estimate {measured / r['estimate']:.2f}")


if __name__ == "__main__":
    main()
