"""What one process of a training run holds in memory, estimated before it starts: so a user sees whether GPT-2 XL
fits before launching it. Bytes per process, by what holds them (fp32 weights, AdamW):

                     one process, DDP                 FSDP over W processes
    parameters       4N                               4N/W + the gathered root and 2 blocks (computing, prefetched)
    gradients        4N (+ 4N DDP's buckets)          4N/W + the root's and one block's whole gradients
    optimizer        8N (AdamW's two moments)         8N/W
    activations      the micro-batch's n = B*T tokens: each block keeps ~17C values a token (its norms' and
                     linears' inputs, q k v and the attention output, the MLP's 4C twice), plus H*T attention
                     weights a token where dropout runs SDPA's math; the head its logits, their softmax and their
                     gradient (3 x 4V bytes a token). bf16: the kept values in 2 bytes. Activation checkpointing
                     keeps each block's input (C) and one block's whole activations.

A block is 12C^2 parameters, the root (embeddings, final norm, heads) the rest of N. The figures leave out
PyTorch's own (~0.3 GB on the CPU) and the allocator's slack; benchmarks/memory.py checks them against measured
peak memory. BERT's MLM head runs at the ~15% predicted positions only: its estimate is an upper bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from duolm.train.loop import micro_batch_size

GB = 10 ** 9


@dataclass(frozen=True)
class Memory:
    """Bytes per process."""
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def __str__(self) -> str:
        parts = ("parameters", "gradients", "optimizer", "activations")
        return ", ".join(f"{p} {_size(getattr(self, p))}" for p in parts) + f"; {_size(self.total)} in all"


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"


def estimate_memory(n_params: int, n_layer: int, n_embd: int, n_head: int, vocab: int, block_size: int,
                    micro_batch: int, parallel: str = "ddp", world: int = 1, precision: str = "fp32",
                    dropout: bool = False, activation_checkpointing: bool = False) -> Memory:
    """The memory of one process training a transformer of `n_params` parameters (vocab: the width of its output
    layer) on micro-batches of `micro_batch` sequences of `block_size` tokens, under `parallel` ("ddp" | "fsdp")
    over `world` processes, in `precision` ("fp32" | "bf16", resolved): see the module's table."""
    N, C, L = n_params, n_embd, n_layer
    block = 12 * C * C
    root = max(N - L * block, 0)
    if parallel == "fsdp" and world > 1:
        gathered = 2 if precision == "bf16" else 4
        parameters = 4 * N // world + gathered * (root + 2 * block)
        gradients = 4 * N // world + 4 * (root + block)
        optimizer = 8 * N // world
    else:
        parameters, gradients, optimizer = 4 * N, 4 * N * (2 if world > 1 else 1), 8 * N
    tokens = micro_batch * block_size
    kept = 2 if precision == "bf16" else 4
    per_block = 17 * C + (n_head * block_size if dropout else 0)          # values a token
    blocks = L * C + per_block if activation_checkpointing else L * per_block
    activations = tokens * (blocks * kept + 3 * 4 * vocab)
    return Memory(parameters, gradients, optimizer, activations)


@dataclass(frozen=True)
class Layout:
    """How a run lays a step out over its processes, and what each process holds."""
    world: int
    parallel: str
    rows: int                # sequences a process takes a step
    micro_batch: int         # sequences a forward
    memory: Memory

    def __str__(self) -> str:
        kind = f" ({self.parallel})" if self.world > 1 else ""
        return (f"{self.world} process(es){kind}: {self.rows} sequences each a step in {self.rows // self.micro_batch} "
                f"micro-batch(es) of {self.micro_batch}; memory a process (estimate): {self.memory}")


def layout(model, cfg, world: int) -> Layout:
    """The Layout of training `model` as TrainConfig `cfg` says (its precision resolved) over `world` processes; a
    batch that does not divide over them is a ValueError."""
    micro = micro_batch_size(cfg, world)
    c = model.config
    memory = estimate_memory(sum(p.numel() for p in model.parameters()), c.n_layer, c.n_embd, c.n_head,
                             getattr(c, "padded_vocab_size", c.vocab_size), c.block_size, micro, cfg.parallel, world,
                             cfg.precision, c.dropout > 0, cfg.activation_checkpointing)
    return Layout(world, cfg.parallel, cfg.batch_size // world, micro, memory)
