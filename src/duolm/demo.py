"""`duolm demo` / `make demo`: both models from scratch on text every Python installation carries.

No download: the corpus is the docstrings of the standard library's .py sources (read with `ast`, nothing
is imported), or `--text FILE`. Trains a byte-level BPE and a small GPT-2 (prints validation loss,
perplexity and samples), then a WordPiece and a small BERT with MLM + NSP (prints [MASK] predictions).
Leaves runs/demo/ with tokenizers, prepared data, checkpoints, metrics.jsonl, tb/ and loss.png per model.
L4: this file prints; it only wires library calls together.
"""
from __future__ import annotations

import ast
import inspect
import math
import re
import sysconfig
import time
from pathlib import Path

from tqdm import tqdm

# BERT's recipe for a few minutes on 2 cores (bf16 where the CPU has it): a small post-LN BERT stays on the unigram
# plateau (every [MASK] "the") for hundreds of steps; 2 layers on 64-token sequences, a high rate and no dropout
# leave it within ~3,000 steps and predict from the context
BERT_RECIPE = dict(batch_size=32, lr=2e-3, warmup=100, n_layer=2, block_size=64, dropout=0.0, masking="dynamic")
MASKED = ("Return the [MASK] of the list.", "This module provides [MASK] for working with files.",
          "Raise a [MASK] if the value is not valid.", "If the [MASK] does not exist, an exception is raised.",
          "The file is closed when the [MASK] manager exits.")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def stdlib_docstrings(max_chars: int = 3_000_000) -> list[str]:
    """Docstrings (module, class, function) of the standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    doc = inspect.cleandoc(doc)
                    docs.append(doc)
                    total += len(doc)
                    if total >= max_chars:
                        return docs
    return docs


def _sentences(doc: str) -> list[str]:
    """Prose sentences of a docstring: paragraphs joined, split after . ! ? before a capital."""
    text = " ".join(doc.split())
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if len(s.split()) >= 3]


def _configs(steps, batch_size, lr, warmup=30, n_layer=4, n_embd=128, block_size=128, **model):
    """A small model (4 layers, 128 wide, 128-token sequences by default): 5 evaluations, 2 checkpoints."""
    from duolm.train import ModelConfig, TrainConfig

    mc = ModelConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size, **model)
    tc = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup, eval_every=max(steps // 4, 1),
                     eval_batches=8, checkpoint_every=max(steps // 2, 1))
    return mc, tc


def _pretrain(family, data, run, mc, tc):
    from duolm.train import pretrain

    with tqdm(total=tc.max_steps, unit="step", desc=family, dynamic_ncols=True) as bar:
        pretrain(family, data, run, mc, tc, on_log=lambda row: bar.update(row["step"] - bar.n))


def guess_baselines(val_data, batch_size: int, max_batches: int) -> tuple[float, float]:
    """(MLM, NSP) accuracy of always guessing the most frequent answer (piece; class) on the validation batches a
    run evaluates. NSP's is not 50%: BERT's builder draws a random next segment for every chunk of one sentence, so
    short documents make most pairs "random next" (the demo's: ~65%)."""
    from duolm.objectives import constant_guess_accuracy

    batches = list(val_data.eval_batches(batch_size, max_batches=max_batches))
    return (constant_guess_accuracy(b["mlm_labels"] for b in batches),
            constant_guess_accuracy(b["nsp_labels"] for b in batches))


def nsp_summary(first: float, last: float, guess: float) -> str:
    """NSP's accuracy at the first and last validation against the majority guess, saying so when it is no better.

    >>> nsp_summary(0.648, 0.612, 0.648)
    'NSP accuracy 64.8% -> 61.2% (always guessing the majority class: 64.8%; NSP learned nothing)'
    """
    verdict = "" if last > guess else "; NSP learned nothing"
    return f"NSP accuracy {first:.1%} -> {last:.1%} (always guessing the majority class: {guess:.1%}{verdict})"


def run(out: str = "runs/demo", text: str | None = None, gpt2_steps: int = 400, bert_steps: int = 3000):
    from duolm.checkpoint import load
    from duolm.data import prepare
    from duolm.textgen import fill_mask_text, generate_text
    from duolm.tokenizers import ByteLevelBPE, WordPiece
    from duolm.runs import read_metrics
    from duolm.train.pretrain import build

    t_start = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if text:
        raw = Path(text).read_text(encoding="utf-8")
        docs = [d.strip() for d in re.split(r"\n\s*\n", raw) if d.strip()]
        source = text
    else:
        docs = stdlib_docstrings()
        source = f"docstrings of the Python standard library ({sysconfig.get_paths()['stdlib']})"
    corpus = "\n\n".join(docs)
    print(f"== corpus: {len(docs):,} documents, {len(corpus) / 1e6:.1f} MB from {source}")
    (out / "corpus.txt").write_text(corpus)

    # --- GPT-2 ---------------------------------------------------------------------------------
    t = time.time()
    bpe = ByteLevelBPE.train([corpus[:1_500_000]], vocab_size=2048)
    bpe.save(out / "bpe")
    print(f"== byte-level BPE: {bpe.vocab_size} tokens in {time.time() - t:.0f}s")
    # chunks small enough that a short --text still has some for the validation split
    chunk_chars = max(2048, min(1 << 16, len(corpus) // 100))
    prepare([out / "corpus.txt"], bpe, out / "data-gpt2", workers=2, val_fraction=0.02, chunk_chars=chunk_chars)
    gpt2_run = out / "gpt2"
    _pretrain("gpt2", out / "data-gpt2", gpt2_run, *_configs(gpt2_steps, batch_size=16, lr=2e-3, dropout=0.0))
    val = [r["val_loss"] for r in read_metrics(gpt2_run) if "val_loss" in r]
    gpt2_line = (f"GPT-2: validation loss {val[0]:.2f} -> {val[-1]:.2f}, perplexity {math.exp(val[0]):.0f} -> "
                 f"{math.exp(val[-1]):.1f} (guessing uniformly among its {bpe.vocab_size:,} tokens: {bpe.vocab_size:,})")
    print("== " + gpt2_line)
    model, tok = load(gpt2_run)
    for i, prompt in enumerate(("Return the", "This module provides", "If the file")):
        text = "".join(generate_text(model, tok, prompt, 40, temperature=0.8, top_k=40, seed=i))
        print(f"   {prompt!r} -> {prompt + text!r}")

    # --- BERT ----------------------------------------------------------------------------------
    t = time.time()
    sent_docs = [s for s in (_sentences(d) for d in docs) if len(s) >= 2]
    (out / "corpus-bert.txt").write_text("\n\n".join("\n".join(s) for s in sent_docs))
    wp = WordPiece.train([s for d in sent_docs for s in d][:40_000], vocab_size=4000)
    wp.save(out / "wordpiece")
    print(f"== WordPiece: {wp.vocab_size} pieces in {time.time() - t:.0f}s; {len(sent_docs):,} documents of sentences")
    prepare([out / "corpus-bert.txt"], wp, out / "data-bert", workers=2, val_fraction=0.02, chunk_chars=chunk_chars)
    bert_run = out / "bert"
    mc, tc = _configs(bert_steps, **BERT_RECIPE)
    _pretrain("bert", out / "data-bert", bert_run, mc, tc)
    rows = [r for r in read_metrics(bert_run) if "val_mlm_acc" in r]
    first, last = rows[0], rows[-1]
    guess, nsp_guess = guess_baselines(build("bert", out / "data-bert", mc, tc.seed)[3], tc.batch_size, tc.eval_batches)
    bert_line = (f"BERT: validation MLM accuracy {first['val_mlm_acc']:.1%} -> {last['val_mlm_acc']:.1%} (always "
                 f"guessing the most frequent piece: {guess:.1%}), "
                 + nsp_summary(first["val_nsp_acc"], last["val_nsp_acc"], nsp_guess))
    print("== " + bert_line)
    bert, wtok = load(bert_run)
    for sentence in MASKED:
        preds, _ = fill_mask_text(bert, wtok, sentence, top_k=5)
        print(f"   {sentence!r}: " + ", ".join(f"{piece} {p:.2f}" for piece, p in preds[0]))
    print(f"== done in {(time.time() - t_start) / 60:.1f} min: {out}/gpt2 and {out}/bert hold checkpoints, "
          f"metrics.jsonl, tb/ and loss.png (BERT's: MLM and NSP apart)\n   {gpt2_line}\n   {bert_line}")
