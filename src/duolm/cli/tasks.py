"""Subcommands for downstream tasks: finetune, predict, evaluate (fine-tuned models), eval (zero-shot, GPT-2 paper)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from duolm.cli.options import Bars, add_options, add_precision, for_inference, options, report_compile


def add_task_data(p):
    p.add_argument("--data", default=None, help="GLUE task folder (train.tsv, dev.tsv, test.tsv)")
    p.add_argument("--train", default=None, help="your training file (.csv, .tsv or .jsonl with named columns)")
    p.add_argument("--dev", default=None, help="your dev file (same columns)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", default=None, help="second text of sentence-pair tasks")
    p.add_argument("--label-column", default="label")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _finetune_banner(info, out) -> list[str]:
    labels = f", labels {' '.join(info['labels'])}" if info["labels"] else ""
    dev = ", ".join(f"{n:,} {k}" for k, n in info["dev"].items())
    cut = [f"{n:,} {k} input(s) longer than {info['max_length']} tokens were cut" for k, n in info["truncated"].items() if n]
    return [f"{info['family']} on {info['device']} in {info['precision']}: {info['task']} ({info['kind']}{labels}), "
            f"{info['train']:,} train, {dev}; {info['runs']} run(s) of {info['steps']} steps -> {out}"] + [f"note: {n}" for n in info["notes"] + cut]


def _files(args):
    from duolm.tasks import Files

    return Files(args.data, args.train, args.dev, args.text_column, args.text_pair_column, args.label_column)


def cmd_finetune(args):
    from duolm.train.finetune import FinetuneConfig, finetune, finetune_glue

    bar, shown = None, {}
    with Bars(args.quiet or args.json) as bars:
        def on_start(info):                        # once per task (--suite: each task in turn)
            nonlocal bar
            print("\n".join([] if args.json else _finetune_banner(info, args.out)))
            bar = bars(info["task"], info["runs"] * info["steps"], unit="step")

        def on_log(row):                           # the bar shows the loss and the latest dev metrics
            bar.update("loss" in row)
            shown.update({k.removeprefix("val_"): f"{v:.4f}" for k, v in row.items()
                          if k == "loss" or k.startswith("val_") and not k.endswith("loss")})
            bar.set_postfix(shown, refresh=False)

        kw = dict(device=args.device, resume=args.resume, on_start=on_start, on_log=on_log)
        if args.suite:
            finetune_glue(args.model, args.data, args.out, options(FinetuneConfig, args), **kw)
        else:
            res = finetune(args.model, args.task, args.out, options(FinetuneConfig, args), _files(args), **kw)
    if bar is None:                                # under torchrun, a process other than rank 0: rank 0 reports
        return
    if args.suite:
        return print((Path(args.out) / "glue.md").read_text(encoding="utf-8"))
    print(json.dumps({k: res[k] for k in ("task", "metric", "runs", "mean", "std", "best", "result")})
          if args.json else (Path(args.out) / "results.md").read_text(encoding="utf-8"))


def add_finetune(sub):
    from duolm.train.finetune import FinetuneConfig

    p = sub.add_parser("finetune", help="fine-tune GPT-2 or BERT on a GLUE task or your own labelled texts",
                       description="The paper's recipe by default (BERT: AdamW 2e-5, batch 32, 3 epochs, 10% warmup; "
                                   "GPT-1: 6.25e-5, 0.2% warmup, LM loss 0.5). Dev metrics after every epoch; the best "
                                   "model is kept in OUT/best.")
    p.add_argument("model", help="duolm or Hugging Face GPT-2 / BERT directory, or a pretraining run")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", help="cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli (--data: its folder); "
                                     "classify / regress with --train / --dev; conll2003 (--data: its folder) or ner; "
                                     "squad; multiple-choice (--train / --dev: context, ending0..N, label)")
    what.add_argument("--suite", choices=["glue"], help="every GLUE task found in --data (the folder of task folders), "
                                                        "then the BERT paper's Table 1 layout")
    p.add_argument("-o", "--out", required=True, help="run folder (several seeds: one sub-folder each)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoints in -o")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_task_data(p)
    add_options(p.add_argument_group("recipe"), FinetuneConfig)
    p.set_defaults(func=cmd_finetune)


def cmd_predict(args):
    from duolm.fileio import write_text
    from duolm.tasks import PredictInputs, head_task, load_finetuned, predict
    from duolm.tasks.sentence import pair_scores, write_glue_predictions

    model, tok = load_finetuned(args.model, args.device or "cpu")
    for_inference(model, args, args.device or "cpu")
    task = head_task(model.head)
    if args.data:
        files = write_glue_predictions(model, tok, args.data, args.out)
        return print("wrote " + ", ".join(map(str, files)))
    inputs = task.parse(PredictInputs(args.texts, args.file, args.pairs, args.question or [], args.context))
    results = (pair_scores if args.score else predict)(model, tok, inputs)
    if args.json:
        return print(json.dumps([{"input": i, "prediction": r} for i, r in zip(inputs, results)]))
    lines = [task.line(i, r) for i, r in zip(inputs, results)]
    if args.out:
        write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines) if not args.out else f"wrote {len(lines)} predictions to {args.out}")
    cut = sum(bool(r.get("truncated")) for r in results)
    if cut:
        print(f"duolm: {cut} input(s) longer than {model.head.max_length} tokens were cut", file=sys.stderr)


def add_predict(sub):
    p = sub.add_parser("predict", help="label texts (or pairs), tag entities or answer questions with a fine-tuned model")
    p.add_argument("model", help="fine-tuned run folder or model directory")
    p.add_argument("texts", nargs="*", help="texts to label or tag (multiple choice: a context, then its endings)")
    p.add_argument("--pairs", action="store_true", help="the texts are sentence pairs, two at a time")
    p.add_argument("--score", action="store_true", help="each pair's relevance score, as /v1/score and /v1/rerank "
                                                        "give it: a regressor's value, a 2-label classifier's "
                                                        "probability of its second label")
    p.add_argument("--file", default=None, help="one input per line; a tab separates the two texts of a pair")
    p.add_argument("--question", action="append", help="question answering: a question (repeatable)")
    p.add_argument("--context", default=None, help="question answering: the text file to find the answer in")
    p.add_argument("--data", default=None, help="GLUE task folder: write the submission files of its test files")
    p.add_argument("-o", "--out", default=None, help="output file (--file) or folder (--data)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    add_precision(p)
    p.set_defaults(func=cmd_predict)


def cmd_evaluate(args):
    from duolm.tasks import TaskOptions, evaluate, load_finetuned

    model, tok = load_finetuned(args.model, args.device or "cpu")
    for_inference(model, args, args.device or "cpu")
    metrics, notes = evaluate(model, tok, _files(args), args.split, options(TaskOptions, args))
    if args.json:
        return print(json.dumps({"task": model.head.task, "split": args.split, **metrics}))
    print("\n".join([f"note: {n}" for n in notes] + [f"{k:<16} {v:.4f}" for k, v in metrics.items() if k != "per_type"]
                    + [f"  {t:<14} {s['f1']:.4f} ({s['support']})" for t, s in metrics.get("per_type", {}).items()]))


def add_evaluate(sub):
    from duolm.tasks import TaskOptions

    p = sub.add_parser("evaluate", help="the task's official metrics of a fine-tuned model")
    p.add_argument("model", help="fine-tuned run folder or model directory")
    p.add_argument("--split", choices=["dev", "train"], default="dev")
    add_options(p, TaskOptions, {"context": None, "stride": None,
                                 "dev_fraction": "as given to finetune: the held-out end of train"})
    add_task_data(p)
    add_precision(p)
    p.set_defaults(func=cmd_evaluate)


def cmd_eval(args):
    from duolm.checkpoint import load
    from duolm.evaluation import EvalOptions, evaluate_lm, markdown, run_suite
    from duolm.fileio import write_json, write_text

    if not ((args.task and args.data) or (args.suite and args.data_dir)):
        raise ValueError("give --task TASK --data PATH, or --suite SUITE --data-dir DIR")
    model, tok = load(args.model)
    for_inference(model, args)
    opts = dataclasses.asdict(options(EvalOptions, args))
    with Bars(args.json) as bars:
        def progress(task, done, total, metrics):
            bar = bars(task, total, desc=task, leave=False)
            bar.update(done - bar.n)
            bar.set_postfix(metrics)

        result = (run_suite(model, tok, args.data_dir, progress, args.suite, **opts) if args.suite else
                  evaluate_lm(model, tok, args.task, args.data, lambda *a: progress(args.task, *a), **opts))
    if args.compile:
        report_compile(model)
    items = [{"task": t, **x} for t, r in result.get("results", {args.task: result}).items() for x in r.pop("items", [])]
    if args.scores:                                # multiple choice: one line of scores per item
        write_text(args.scores, "".join(json.dumps(x) + "\n" for x in items))
    table = markdown(result)
    if args.out:
        write_json(args.out, result)
        write_text(Path(args.out).with_suffix(".md"), table + "\n")
    print(json.dumps(result) if args.json else table)


def add_eval(sub):
    from duolm.evaluation import TASKS, EvalOptions

    p = sub.add_parser("eval", help="zero-shot evaluation with the GPT-2 paper's protocols (GPT-2), BLiMP (either "
                                    "family)",
                       description="Perplexity per word / bits per byte with sliding windows and invertible "
                                   "de-tokenizers, LAMBADA, CBT, and the prompted tasks; prints each metric with "
                                   "its protocol and, for the released GPT-2 sizes, the paper's number. BLiMP "
                                   "(--task blimp --data FOLDER) scores GPT-2 or BERT (pseudo-log-likelihood).")
    p.add_argument("model", help="model directory (duolm, Hugging Face, or a training run)")
    p.add_argument("--task", choices=list(TASKS), help="one task, with --data")
    p.add_argument("--data", help="the task's file (for translate: either file of the aligned pair)")
    p.add_argument("--suite", choices=["gpt2-paper", "zero-shot-mc"],
                   help="every Table 3 task (gpt2-paper) or multiple-choice set (zero-shot-mc) whose file is in --data-dir")
    p.add_argument("--scores", help="multiple choice: write each item's log-probabilities and predictions here (jsonl)")
    p.add_argument("--data-dir", help="folder of the suite's files")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("-o", "--out", help="write the result as JSON here and the markdown table beside it (.md)")
    add_options(p.add_argument_group("protocol"), EvalOptions)
    add_precision(p)
    p.set_defaults(func=cmd_eval)


def cmd_score(args):
    from duolm.checkpoint import load
    from duolm.evaluation.scoring import score_sentences

    if (args.text is None) == (args.file is None):
        raise ValueError("give the sentences with --text (repeatable) or --file (one a line)")
    sentences = args.text or [line for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    model, tok = load(args.model)
    for_inference(model, args)
    scores = score_sentences(model, tok, sentences, args.pll)
    if args.json:
        for s, r in zip(sentences, scores):
            print(json.dumps({"sentence": s, "score": r["score"], **({k: r[k] for k in ("tokens", "token_scores")}
                                                                     if args.tokens else {})}))
        return
    for s, r in zip(sentences, scores):
        print(f"{r['score']:.4f}\t{s}")
        if args.tokens:
            print("".join(f"  {t!r} {v:.4f}\n" for t, v in zip(r["tokens"], r["token_scores"])), end="")


def add_score(sub):
    from duolm.evaluation.scoring import PLL

    p = sub.add_parser("score", help="each sentence's log-likelihood (GPT-2) or pseudo-log-likelihood (BERT), in nats")
    p.add_argument("model", help="model directory (duolm, Hugging Face, or a training run); BERT with its MLM head")
    p.add_argument("--text", action="append", help="a sentence (repeatable)")
    p.add_argument("--file", help="a text file, one sentence a line")
    p.add_argument("--pll", choices=PLL, default="original",
                   help="BERT: mask one token a copy, or also the pieces of its word to its right")
    p.add_argument("--tokens", action="store_true", help="also each token's log-probability")
    p.add_argument("--json", action="store_true", help="one JSON object a sentence")
    add_precision(p)
    p.set_defaults(func=cmd_score)
