"""`prepare` throughput (MB/s of input text) with 1 and 2 worker processes.

    .venv/bin/python benchmarks/prepare.py [--repeat N]

Byte-level BPE (GPT-2's vocabulary) on tiny Shakespeare + WikiText-2 valid/test + PTB train (~8.6 MB);
WordPiece (bert-base-uncased) on PTB train (~5.1 MB). A fresh tokenizer per run (cold caches).
Also prints MB per CPU-second (all processes), which a busy machine does not distort.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def bpe_tokenizer():
    from duolm.tokenizers import ByteLevelBPE

    return ByteLevelBPE.from_files(DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")


def wordpiece_tokenizer():
    from duolm.tokenizers import WordPiece

    return WordPiece.from_vocab(DATA / "bert-vocab" / "bert-base-uncased-vocab.txt")


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def prepare_throughput(files, make_tokenizer, workers=(1, 2), repeat=1) -> dict[int, tuple[float, float]]:
    """For each worker count: (best wall-clock MB/s, MB per CPU-second of all processes) of `prepare`
    (input UTF-8 bytes). The worker counts take turns, so a burst of other load hits them alike; the
    CPU-second number depends less on what else the machine is running."""
    from duolm.data import prepare

    out = {w: (0.0, 0.0) for w in workers}
    for _ in range(repeat):
        for w in workers:
            tok = make_tokenizer()
            with tempfile.TemporaryDirectory() as d:
                t, c = time.perf_counter(), _cpu_s()
                meta = prepare(files, tok, d, workers=w, val_fraction=0.005)
                dt, dc = time.perf_counter() - t, _cpu_s() - c
            out[w] = max(out[w], (meta["bytes"] / dt / 1e6, meta["bytes"] / dc / 1e6))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"reference data {DATA} is absent")
    cases = [
        ("bpe (gpt2)", bpe_tokenizer, [DATA / "tinyshakespeare" / "input.txt", DATA / "wikitext-2" / "valid.txt",
                                       DATA / "wikitext-2" / "test.txt", DATA / "ptb" / "ptb.train.txt"]),
        ("wordpiece (bert-base-uncased)", wordpiece_tokenizer, [DATA / "ptb" / "ptb.train.txt"]),
    ]
    for name, make, files in cases:
        mb = sum(f.stat().st_size for f in files) / 1e6
        r = prepare_throughput(files, make, repeat=args.repeat)
        print(f"prepare {name:30s} {mb:5.1f} MB: 1 worker {r[1][0]:6.2f} MB/s, 2 workers {r[2][0]:6.2f} MB/s "
              f"(x{r[2][0] / r[1][0]:.2f}); per CPU-second {r[1][1]:.2f} / {r[2][1]:.2f} MB")


if __name__ == "__main__":
    main()
