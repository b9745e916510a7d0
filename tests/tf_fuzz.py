"""Mutation fuzz of the TensorFlow checkpoint fixtures: every damaged release folder must give a clear
ValueError or FileNotFoundError naming a file of the folder, or load; nothing else, each case in < 1 s
of CPU time (CPU, not wall-clock, time: on a shared machine another process can stall any case).

    python tests/tf_fuzz.py --cases 10000        # the full run (tests/test_tf.py runs a few hundred)

Mutations: random byte flips, overwrites, insertions, deletions and truncations of the .index, .data
and .json files, and flips inside an index block whose checksum is then recomputed, so that the
table and protobuf parsers (not only the checksum) see the damage.
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

from duolm.convert import tf
from duolm.convert.crc32c import crc32c
from tf_bundle import mask

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tf"
ALLOWED = (ValueError, FileNotFoundError)


def _blocks(index: bytes) -> list[tuple[int, int]]:
    """(offset, size) of the index file's table blocks: the index block and the data blocks."""
    footer = index[-48:-8]
    _, pos = tf._varint(footer, 0, "")
    _, pos = tf._varint(footer, pos, "")
    off, p = tf._varint(footer, pos, "")
    size, _ = tf._varint(footer, p, "")
    out = [(off, size)]
    for _, handle in tf._entries(index[off:off + size], ""):
        o, p = tf._varint(handle, 0, "")
        out.append((o, tf._varint(handle, p, "")[0]))
    return out


def mutate(data: bytes, rng: random.Random, blocks=None) -> bytes:
    b = bytearray(data)
    kind = rng.choice(["flip", "overwrite", "insert", "delete", "truncate", "block"] if blocks else
                      ["flip", "overwrite", "insert", "delete", "truncate"])
    if not b or kind == "truncate":
        return bytes(b[:rng.randrange(len(b) + 1)])
    i = rng.randrange(len(b))
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "overwrite":
        fill = rng.choice([b"\x00", b"\xff", b"\x7f", bytes([rng.randrange(256)])])
        n = rng.randint(1, 16)
        b[i:i + n] = fill * len(b[i:i + n])
    elif kind == "insert":
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == "delete":
        del b[i:i + rng.randint(1, 16)]
    else:   # damage a block's contents, then make its checksum match again
        off, size = rng.choice(blocks)
        for _ in range(rng.randint(1, 3)):
            j = off + rng.randrange(size)
            b[j] = rng.choice([b[j] ^ (1 << rng.randrange(8)), 0, 0xFF, rng.randrange(256)])
        b[off + size + 1:off + size + 5] = mask(crc32c(bytes(b[off:off + size + 1]))).to_bytes(4, "little")
    return bytes(b)


def _load(d: Path):
    loader = tf.gpt2_from_tf if (d / "hparams.json").is_file() else tf.bert_from_tf
    loader(d)
    ckpt = tf.read_checkpoint(tf.find_prefix(d))
    for name in ckpt:          # every tensor, optimizer slots too: each checksum is verified
        ckpt[name]


def run(cases: int, seed: int, workdir: Path, time_budget: float | None = None) -> dict:
    """-> {"cases": n, "ok": loaded fine, "errors": clear errors, "failures": [(case, description)],
    "slowest": CPU seconds, "slowest_wall": seconds}."""
    rng = random.Random(seed)
    dirs = {}
    for name in ("gpt2", "bert"):
        dirs[name] = workdir / name
        shutil.copytree(FIXTURES / name, dirs[name])
    _load(dirs["gpt2"])   # first-call costs (torch's meta-device init imports) are not a case's
    stats = {"cases": 0, "ok": 0, "errors": 0, "failures": [], "slowest": 0.0, "slowest_wall": 0.0}
    start = time.perf_counter()
    for case in range(cases):
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
        d = dirs[rng.choice(list(dirs))]
        files = sorted(p for p in d.iterdir() if p.suffix != ".npz" and p.name not in ("vocab.txt", "encoder.json",
                                                                                           "vocab.bpe", "checkpoint"))
        weights = [4 if p.suffix == ".index" else 1 for p in files]
        file = rng.choices(files, weights)[0]
        original = file.read_bytes()
        blocks = _blocks(original) if file.suffix == ".index" else None
        file.write_bytes(mutate(original, rng, blocks))
        t, cpu = time.perf_counter(), time.process_time()
        try:
            _load(d)
            stats["ok"] += 1
        except ALLOWED as e:
            if str(d) not in str(e):
                stats["failures"].append((case, f"{file.name}: message names no file: {e}"))
            stats["errors"] += 1
        except Exception as e:   # anything else is a bug
            stats["failures"].append((case, f"{file.name}: {type(e).__name__}: {e}"))
        elapsed = time.process_time() - cpu
        stats["slowest"] = max(stats["slowest"], elapsed)
        stats["slowest_wall"] = max(stats["slowest_wall"], time.perf_counter() - t)
        if elapsed > 1.0:
            stats["failures"].append((case, f"{file.name}: took {elapsed:.2f} s of CPU time"))
        file.write_bytes(original)
        stats["cases"] += 1
    return stats


def main(argv=None):
    import tempfile
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        s = run(args.cases, args.seed, Path(tmp))
    print(f"{s['cases']} cases in {time.perf_counter() - t:.1f} s: {s['ok']} loaded, {s['errors']} clear errors, "
          f"{len(s['failures'])} failures; slowest case {s['slowest'] * 1000:.0f} ms CPU "
          f"({s['slowest_wall'] * 1000:.0f} ms wall-clock)")
    for case, what in s["failures"][:20]:
        print(f"  case {case}: {what}")
    return 1 if s["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
