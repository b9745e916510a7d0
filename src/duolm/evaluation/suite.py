"""One entry point per task, the suite of the GPT-2 paper's Table 3, and the paper's numbers.

    result = evaluate_lm(model, tokenizer, "wikitext2", "wiki.test.tokens", stride=512)
    suite = run_suite(model, tokenizer, "data/")      # every Table 3 task whose file is in data/
    print(table3_markdown(suite))
"""
from __future__ import annotations

from dataclasses import fields
from functools import partial
from pathlib import Path

from duolm.evaluation import choice, prompted, scoring, tasks
from duolm.evaluation.tasks import EvalOptions, Progress
from duolm.models import GPT2
from duolm.tokenizers import ByteLevelBPE

TASKS = {
    **{name: partial(tasks.corpus_perplexity, task=name) for name in tasks.CORPORA},
    "lambada": tasks.lambada,
    "cbt-cn": partial(tasks.cbt, task="cbt-cn"),
    "cbt-ne": partial(tasks.cbt, task="cbt-ne"),
    "summarize": prompted.summarize,
    "translate": prompted.translate,
    "coqa": prompted.coqa,
    "multiple-choice": choice.multiple_choice,
    "hellaswag": partial(choice.multiple_choice, task="hellaswag"),
    "blimp": lambda model, tok, data, opts, progress: scoring.blimp(model, tok, data, opts.pll, on_progress=progress),
}
BOTH_FAMILIES = {"blimp"}           # tasks that score with BERT too (duolm.evaluation.scoring)

# Table 3 of "Language Models are Unsupervised Multitask Learners": (column, task, our metric key).
TABLE3_COLUMNS = [
    ("LAMBADA (PPL)", "lambada", "ppl"), ("LAMBADA (ACC)", "lambada", "acc_last_token"),
    ("CBT-CN (ACC)", "cbt-cn", "acc"), ("CBT-NE (ACC)", "cbt-ne", "acc"),
    ("WikiText2 (PPL)", "wikitext2", "ppl"), ("PTB (PPL)", "ptb", "ppl"), ("enwik8 (BPB)", "enwik8", "bpb"),
    ("text8 (BPC)", "text8", "bpc"), ("WikiText103 (PPL)", "wikitext103", "ppl"), ("1BW (PPL)", "1bw", "ppl"),
]
PAPER_TABLE3 = {
    "SOTA": (99.8, 59.23, 85.7, 82.3, 39.14, 46.54, 0.99, 1.08, 18.3, 21.8),
    "117M": (35.13, 45.99, 87.65, 83.4, 29.41, 65.85, 1.16, 1.17, 37.50, 75.20),
    "345M": (15.60, 55.48, 92.35, 87.1, 22.76, 47.33, 1.01, 1.06, 26.37, 55.72),
    "762M": (10.87, 60.12, 93.45, 88.0, 19.93, 40.31, 0.97, 1.02, 22.05, 44.575),
    "1542M": (8.63, 63.24, 93.30, 89.05, 18.34, 35.76, 0.93, 0.98, 17.48, 42.16),
}
# The prompted tasks (sections 3.6-3.8), reported for the 1542M model only.
PAPER_PROMPTED = {"coqa": ("f1", 55.0), "summarize": ("rouge1", 29.34), "translate": ("bleu", 5.0)}
# The released sizes by (n_layer, n_embd) of a 50,257-token model with a 1,024-token window.
SIZES = {(12, 768): "117M", (24, 1024): "345M", (36, 1280): "762M", (48, 1600): "1542M"}

# Where the suite looks for each task's file under its data folder (first match wins).
SUITE_FILES = {
    "lambada": ["lambada/lambada_test.jsonl", "lambada_test.jsonl", "lambada/lambada_test_plain_text.txt",
                "lambada/lambada_development_plain_text.txt"],
    "cbt-cn": ["CBTest/data/cbtest_CN_test_2500ex.txt", "cbt/cbtest_CN_test_2500ex.txt", "cbtest_CN_test_2500ex.txt"],
    "cbt-ne": ["CBTest/data/cbtest_NE_test_2500ex.txt", "cbt/cbtest_NE_test_2500ex.txt", "cbtest_NE_test_2500ex.txt"],
    "wikitext2": ["wikitext-2/wiki.test.tokens", "wikitext-2/test.txt"],
    "ptb": ["ptb/ptb.test.txt", "ptb.test.txt"],
    "enwik8": ["enwik8/enwik8", "enwik8"],
    "text8": ["text8/text8", "text8"],
    "wikitext103": ["wikitext-103/wiki.test.tokens"],
    "1bw": ["1bw/news.en.heldout-00000-of-00050", "news.en.heldout-00000-of-00050"],
}


def model_size(model) -> str | None:
    """"117M" ... "1542M" for a model of a released GPT-2 shape, else None."""
    c = model.config
    if c.vocab_size != 50257 or c.block_size != 1024:
        return None
    return SIZES.get((c.n_layer, c.n_embd))


def paper_number(task: str, size: str | None) -> tuple[str, float] | None:
    """(metric key, the paper's number) for this task and model size, or None."""
    if task in PAPER_PROMPTED:
        return PAPER_PROMPTED[task] if size == "1542M" else None
    cols = [k for k, (_, t, _) in enumerate(TABLE3_COLUMNS) if t == task]
    if size is None or not cols:
        return None
    k = cols[-1]            # LAMBADA: its accuracy column, the paper's headline
    return TABLE3_COLUMNS[k][2], PAPER_TABLE3[size][k]


def check_model(model, tokenizer, task: str) -> None:
    """A causal LM (GPT-2: hidden states and an output layer) with a byte-level BPE tokenizer that
    fits its vocabulary, or a ValueError saying what is wrong."""
    if not isinstance(model, GPT2):
        raise ValueError(f"{task} needs a causal language model (GPT-2); got {type(model).__name__}"
                         + (", a masked language model that cannot score text left to right"
                            if model.config.family == "bert" else ""))
    if not isinstance(tokenizer, ByteLevelBPE):
        raise ValueError(f"{task} needs the model's byte-level BPE tokenizer (vocab.json + merges.txt), "
                         f"got {type(tokenizer).__name__}")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}: they do not belong together")


def evaluate_lm(model, tokenizer, task: str, data, on_progress: Progress | None = None, **options) -> dict:
    """Run one task -> its metrics, "protocol" (one line) and, for the released GPT-2 shapes, "paper":
    {"metric": key, "value": the paper's number}. options: the fields of EvalOptions."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    names = {f.name for f in fields(EvalOptions)}
    if set(options) - names:
        raise ValueError(f"unknown option(s) {sorted(set(options) - names)}; options are {sorted(names)}")
    if task in BOTH_FAMILIES:
        scoring.check_scorer(model, tokenizer)
    else:
        check_model(model, tokenizer, task)
    out = TASKS[task](model, tokenizer, data, EvalOptions(**options), on_progress)
    size = model_size(model)
    paper = paper_number(task, size)
    if paper is not None:
        out["paper"] = {"model": size, "metric": paper[0], "value": paper[1]}
        if (task, size) == ("lambada", "1542M"):     # section 3.3: 52.66 without the filter
            out["paper"]["note"] = "with the stop-word filter (52.66 without)"
    return out


# suite -> {row: (task, the file names it may have under --data-dir)}
SUITES = {"gpt2-paper": {task: (task, names) for task, names in SUITE_FILES.items()}, "zero-shot-mc": choice.SUITE}


def find_suite_files(data_dir, suite: str = "gpt2-paper") -> dict[str, Path]:
    """row -> file, for the suite's rows whose file is in data_dir (see SUITES)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: no such folder")
    found = {}
    for row, (_, names) in SUITES[suite].items():
        hit = next((data_dir / n for n in names if (data_dir / n).is_file()), None)
        if hit is not None:
            found[row] = hit
    return found


def run_suite(model, tokenizer, data_dir, on_progress=None, suite: str = "gpt2-paper", **options) -> dict:
    """Every row of `suite` (gpt2-paper: Table 3; zero-shot-mc) whose data is in data_dir -> {"suite",
    "results": {row: result}, "files": {row: path}, "model": size or None}. on_progress(row, done, total,
    metrics) follows each row."""
    files = find_suite_files(data_dir, suite)
    if not files:
        raise ValueError(f"{data_dir}: none of the suite's files is there (looked for "
                         f"{', '.join(n for _, names in SUITES[suite].values() for n in names)})")
    results = {}
    for row, path in files.items():
        cb = None if on_progress is None else partial(on_progress, row)
        results[row] = evaluate_lm(model, tokenizer, SUITES[suite][row][0], path, cb, **options)
    return {"suite": suite, "model": model_size(model), "files": {t: str(p) for t, p in files.items()},
            "results": results}


def table3_markdown(suite: dict) -> str:
    """The suite's results in Table 3's layout, the paper's rows above ours ("-": not run)."""
    head = "| | " + " | ".join(c for c, _, _ in TABLE3_COLUMNS) + " |"
    lines = [head, "|---" * (len(TABLE3_COLUMNS) + 1) + "|"]
    for row, values in PAPER_TABLE3.items():
        mark = " (paper)" if row != "SOTA" else ""
        lines.append(f"| {row}{mark} | " + " | ".join(f"{v:g}" for v in values) + " |")
    ours = []
    for _, task, key in TABLE3_COLUMNS:
        r = suite["results"].get(task)
        ours.append("-" if r is None else f"{r[key]:.2f}")
    lines.append(f"| ours{' (' + suite['model'] + ')' if suite.get('model') else ''} | " + " | ".join(ours) + " |")
    return "\n".join(lines)


METRICS = ("ppl", "ppl_token", "bpb", "bpc", "acc_last_token", "acc_last_word", "acc", "rouge1", "rouge2",
           "rougeL", "bleu", "f1")


def markdown(result: dict) -> str:
    """A result as markdown: a suite's in Table 3's layout, one task's as a table of its metrics with
    the paper's number beside the one it reports; then the protocol line(s)."""
    if result.get("suite") == "zero-shot-mc" or "acc_norm" in result:
        return choice.markdown(result)
    if "paradigms" in result:                        # BLiMP
        rows = [("overall", result["acc"])] + [(f"field: {f}", a) for f, a in result["fields"].items()] + \
            list(result["paradigms"].items())
        return "\n".join(["| blimp | acc |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in rows]) + \
            f"\n\nprotocol: {result['protocol']}"
    if "results" in result:
        return table3_markdown(result) + "".join(f"\n\n{t}: {r['protocol']}" for t, r in result["results"].items())
    paper = result.get("paper") or {}
    lines = [f"| {result['task']} | ours | paper{' (' + paper['model'] + ')' if paper else ''} |", "|---|---|---|"]
    for key in METRICS:
        if key in result:
            lines.append(f"| {key} | {result[key]:.2f} | {paper['value'] if paper.get('metric') == key else ''} |")
    return "\n".join(lines) + f"\n\nprotocol: {result['protocol']}"
