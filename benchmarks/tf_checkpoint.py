"""Reading TensorFlow checkpoints without TensorFlow: speed and memory against the same weights in
safetensors (and against TensorFlow's own reader where TensorFlow is installed), plus the mutation fuzz.

    .venv/bin/python benchmarks/tf_checkpoint.py [--repeat N] [--fuzz-cases 10000]

1. CRC-32C (google-crc32c, the `tf` extra) against zlib's CRC-32 (C) on 64 MB: the checksum is most of a read.
2. A GPT-2 124M-shaped release folder (random weights, OpenAI's names, written by tests/tf_bundle.py)
   and the same weights as a Hugging Face safetensors folder: duolm.load of each, taking turns, and
   reading every tensor with our reader; if `import tensorflow` works (it is no dependency: run this
   script with a Python that has it to get that row), TensorFlow's reader on the same files.
3. Peak anonymous memory (RssAnon, sampled every 5 ms) of each load in a fresh process, as a
   multiple of the weights' size: the TF reader maps the shard and copies once into the model.
4. tests/tf_fuzz.py with --fuzz-cases mutations (0 skips it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def crc_ratio(repeat: int) -> None:
    from duolm.convert.crc32c import crc32c

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    ours, ref = [], []
    for _ in range(repeat):
        t = time.perf_counter(); crc32c(data); ours.append(time.perf_counter() - t)
        t = time.perf_counter(); zlib.crc32(data); ref.append(time.perf_counter() - t)
    mb = len(data) / 1e6
    print(f"crc32c (google-crc32c) {mb / min(ours):7.0f} MB/s   zlib.crc32 (C) {mb / min(ref):7.0f} MB/s   "
          f"ratio ours/zlib time {min(ours) / min(ref):.1f}x")


def make_folders(root: Path) -> tuple[Path, Path, int]:
    """A 124M GPT-2 as OpenAI's release folder and as an HF safetensors folder, same weights."""
    import torch

    import duolm
    from duolm.convert.hf import _expand
    from duolm.convert.tf import GPT2_TF_TABLE
    from duolm.models import GPT2, GPT2Config
    from tf_bundle import write_bundle

    cfg = GPT2Config()
    torch.manual_seed(0)
    model = GPT2(cfg)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    # OpenAI's names and layouts (the name table read backwards); conv1d weights are [1, nx, nf]
    t = {name: sd[ours].T[None] if name.endswith("/w") else sd[ours]
         for ours, name in _expand(GPT2_TF_TABLE, cfg.n_layer)}
    tf_dir, hf_dir = root / "124M", root / "hf"
    tf_dir.mkdir()
    write_bundle(tf_dir / "model.ckpt", t)
    (tf_dir / "hparams.json").write_text(json.dumps({"n_vocab": 50257, "n_ctx": 1024, "n_embd": 768, "n_head": 12,
                                                     "n_layer": 12}))
    duolm.save(model, hf_dir, format="hf")
    return tf_dir, hf_dir, sum(a.nbytes for a in t.values())


def timed(fn) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of fn(); CPU time counts all threads and is less distorted by a busy machine."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def read_ours(path: Path):
    from duolm.convert import tf

    ckpt = tf.read_checkpoint(path / "model.ckpt")
    for name in ckpt:   # each tensor's crc32c is verified as it is read
        np.asarray(ckpt[name]).sum()


def read_tf(path: Path):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(path / "model.ckpt"))
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name).sum()


def have_tensorflow() -> bool:
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


PEAK = """
import sys, threading, time
peak = [0]
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
def poll():
    while True:
        peak[0] = max(peak[0], anon()); time.sleep(0.005)
import duolm, torch
base = anon()
threading.Thread(target=poll, daemon=True).start()
duolm.load(sys.argv[1])
time.sleep(0.02)
print(peak[0] - base)
"""


def peak_memory(path: Path) -> int:
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fuzz-cases", type=int, default=10_000)
    args = ap.parse_args()
    crc_ratio(args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        tf_dir, hf_dir, size = make_folders(Path(tmp))
        import duolm

        ours, theirs, load_tf, load_hf = ("read every tensor: ours", "read every tensor: TensorFlow",
                                          "duolm.load(TF folder)", "duolm.load(HF safetensors)")
        rows = {ours: lambda: read_ours(tf_dir), theirs: lambda: read_tf(tf_dir),
                load_tf: lambda: duolm.load(tf_dir), load_hf: lambda: duolm.load(hf_dir)}
        if not have_tensorflow():
            del rows[theirs]
        best = {k: (float("inf"), float("inf")) for k in rows}
        for _ in range(args.repeat):   # taking turns: a burst of other load hits each alike
            for k, fn in rows.items():
                wall, cpu = timed(fn)
                best[k] = (min(best[k][0], wall), min(best[k][1], cpu))
        print(f"GPT-2 124M, {size / 1e6:.0f} MB of weights (best of {args.repeat}, wall-clock / CPU seconds):")
        for k, (wall, cpu) in best.items():
            print(f"  {k:32s} {wall:6.2f} s / {cpu:6.2f} s")
        for a, b in ((load_tf, load_hf), (ours, theirs)):
            if b in best:
                print(f"  ratio {a} / {b}: {best[a][0] / best[b][0]:.2f}x wall, {best[a][1] / best[b][1]:.2f}x CPU")
        if Path("/proc/self/status").exists():
            mt, mh = peak_memory(tf_dir), peak_memory(hf_dir)
            print(f"  peak anonymous memory during duolm.load: TF folder {mt / size:.2f}x the weights, "
                  f"HF safetensors {mh / size:.2f}x")
    if args.fuzz_cases:
        import tf_fuzz

        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            s = tf_fuzz.run(args.fuzz_cases, seed=0, workdir=Path(tmp))
        print(f"fuzz: {s['cases']} mutated release folders in {time.perf_counter() - t:.0f} s: {s['ok']} loaded, "
              f"{s['errors']} clear errors, {len(s['failures'])} other outcomes; slowest case "
              f"{s['slowest'] * 1000:.0f} ms CPU ({s['slowest_wall'] * 1000:.0f} ms wall-clock)")
        for case, what in s["failures"][:20]:
            print(f"  case {case}: {what}")


if __name__ == "__main__":
    main()
