"""`duolm serve` with its device emulated, for `benchmarks/serve.py --device-ms MS`: every forward of the served GPT-2's
blocks (prefills and decode steps alike) is a sleep of MS milliseconds, during which the GIL is free, as while a GPU
runs a step, giving hidden states of zeros (the output layer, the draws and all else run as they are). The host's own
work (HTTP, the scheduler, the two threads sharing the GIL) is then what limits the server, on any machine.

    python benchmarks/emulated_server.py MS <duolm serve's arguments>
"""
import sys
import time
from pathlib import Path

import torch

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the `tokenizers` package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from duolm.cli import main  # noqa: E402
from duolm.models import GPT2  # noqa: E402

device_s = float(sys.argv.pop(1)) / 1e3


def hidden(self, idx, attention_mask=None, cache=None):
    """The forward's hidden states, zeros, after device_s: the cache advances, its contents left as they are."""
    if cache is not None:
        cache.length += idx.shape[1]
    time.sleep(device_s)
    return torch.zeros(*idx.shape, self.config.n_embd)


GPT2.hidden = hidden
sys.argv[0] = "duolm"
main()
