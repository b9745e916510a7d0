"""`duolm serve` with its device emulated, for `benchmarks/serve.py --device-ms MS`: every forward of the served GPT-2
(prefills and decode steps alike) is followed by a sleep of MS milliseconds, during which the GIL is free, as while a
GPU runs a step. With a tiny model the host's own work (HTTP, the scheduler, the two threads sharing the GIL) is then
what limits the server, on any machine.

    python benchmarks/emulated_server.py MS <duolm serve's arguments>
"""
import sys
import time
from pathlib import Path

# Run as a script, this folder is sys.path[0], and benchmarks/tokenizers.py would shadow the `tokenizers` package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from duolm.cli import main  # noqa: E402
from duolm.models import GPT2  # noqa: E402

device_s = float(sys.argv.pop(1)) / 1e3
forward = GPT2.hidden


def hidden(self, *args, **kwargs):
    h = forward(self, *args, **kwargs)
    time.sleep(device_s)
    return h


GPT2.hidden = hidden
sys.argv[0] = "duolm"
main()
