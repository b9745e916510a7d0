"""Reading TensorFlow checkpoints without TensorFlow: speed and memory against the same weights in
safetensors (and against TensorFlow's own reader where TensorFlow is installed), plus the mutation fuzz.

    .venv/bin/python benchmarks/tf_checkpoint.py [--repeat N] [--fuzz-cases 10000]

1. CRC-32C (our numpy lanes) against zlib's CRC-32 (C) on 64 MB: the checksum is most of a read.
2. A GPT-2 124M-shaped release folder (random weights, OpenAI's names, written by tests/tf_bundle.py)
   and the same weights as a Hugging Face safetensors folder: duolm.load of each, taking turns.
   If `import tensorflow` works, also tf.train.load_checkpoint + get_tensor of every tensor.
3. Peak anonymous memory (RssAnon, sampled every 5 ms) of each load in a fresh process, as a
   multiple of the weights' size: the TF reader maps the shard and copies once into the model.
4. tests/tf_fuzz.py with --fuzz-cases mutations (0 skips it).
"""
from __future__ import annotations

import argparse
import json
import os
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
    from duolm.convert.tf import crc32c

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    ours, ref = [], []
    for _ in range(repeat):
        t = time.perf_counter(); crc32c(data); ours.append(time.perf_counter() - t)
        t = time.perf_counter(); zlib.crc32(data); ref.append(time.perf_counter() - t)
    mb = len(data) / 1e6
    print(f"crc32c (numpy lanes) {mb / min(ours):7.0f} MB/s   zlib.crc32 (C) {mb / min(ref):7.0f} MB/s   "
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


def load_time(path: Path) -> float:
    import duolm

    t = time.perf_counter()
    duolm.load(path)
    return time.perf_counter() - t


def tf_time(path: Path) -> float | None:
    try:
        import tensorflow as tf
    except ImportError:
        return None
    t = time.perf_counter()
    reader = tf.train.load_checkpoint(str(path / "model.ckpt"))
    for name in reader.get_variable_to_shape_map():
        reader.get_tensor(name)
    return time.perf_counter() - t


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
        ours, ref, tfs = [], [], []
        for _ in range(args.repeat):   # taking turns: a burst of other load hits both alike
            ours.append(load_time(tf_dir))
            ref.append(load_time(hf_dir))
            tfs.append(tf_time(tf_dir))
        print(f"GPT-2 124M ({size / 1e6:.0f} MB): duolm.load(TF folder) {min(ours):.2f} s   duolm.load(HF safetensors) "
              f"{min(ref):.2f} s   ratio {min(ours) / min(ref):.2f}x")
        if tfs[0] is not None:
            print(f"  TensorFlow's reader (get_tensor of every variable) {min(tfs):.2f} s   ratio ours/TF "
                  f"{min(ours) / min(tfs):.2f}x")
        if Path("/proc/self/status").exists():
            mt, mh = peak_memory(tf_dir), peak_memory(hf_dir)
            print(f"  peak anonymous memory during load: TF folder {mt / size:.2f}x the weights, "
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
