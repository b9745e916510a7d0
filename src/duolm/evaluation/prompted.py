"""The GPT-2 paper's prompted tasks, as generation recipes on duolm.generation.generate.

    summarize  article + "\\nTL;DR:", 100 tokens of top-k sampling (k = 2), the first 3 generated
               sentences; ROUGE-1/2/L F1 (rouge-score, Porter stemming) against reference summaries
    translate  "english sentence = french sentence" example pairs, then "english sentence =", greedy,
               the first generated sentence; corpus BLEU (sacrebleu, its default 13a tokenization)
    coqa       the story, the conversation so far ("Q: ...\\nA: ...") and "Q: question\\nA:", greedy
               to the end of the line; CoQA's F1 (see coqa_f1)

ROUGE and BLEU come from the optional extra `eval` (pip install 'duolm[eval]'), imported when used.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from duolm.evaluation import readers
from duolm.metrics import normalize_answer, token_f1
from duolm.evaluation.tasks import EvalOptions, Progress
from duolm.generation import generate


def first_sentences(text: str, n: int) -> str:
    """The first n sentences of text (a sentence ends at . ! or ? followed by white space or the end),
    with white space runs collapsed; cut at the first blank line.

    >>> first_sentences(" He won. She lost! Then? They left.\\n\\nMore", 3)
    'He won. She lost! Then?'
    """
    text = " ".join(text.split("\n\n")[0].split())
    parts = re.split(r"(?<=[.!?])\s+", text)
    return " ".join(parts[:n])


# --- CoQA's F1 ---------------------------------------------------------------------------------------

def _f1(gold: str, pred: str) -> float:
    """SQuAD's token F1, except that two empty answers agree (CoQA's rule for unanswerable turns)."""
    if not normalize_answer(gold) or not normalize_answer(pred):
        return float(normalize_answer(gold) == normalize_answer(pred))
    return token_f1(pred, gold)


def coqa_f1(pred: str, golds: list[str]) -> float:
    """F1 of one answer as CoQA's official script scores a turn: with several gold answers, the mean
    over golds of the best F1 against the *other* golds (each human is left out once); with one, F1
    against it. Worked example:

    >>> coqa_f1("a white cat", ["white cat", "the white cat", "a cat"])   # (1 + 1 + 1) / 3
    1.0
    >>> round(coqa_f1("white", ["white cat", "cat"]), 4)   # leave out each: max(0) = 0, max(2/3)
    0.3333
    """
    if len(golds) == 1:
        return _f1(golds[0], pred)
    return sum(max(_f1(g, pred) for g in golds[:i] + golds[i + 1:]) for i in range(len(golds))) / len(golds)


# --- generation --------------------------------------------------------------------------------------

def _newline_ids(tokenizer) -> list[list[int]]:
    out = []
    for i in range(tokenizer.vocab_size):
        try:
            if b"\n" in tokenizer.decode_bytes([i]):
                out.append([i])
        except ValueError:
            continue
    return out


def _continue(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, opts: EvalOptions,
              on_progress: Progress | None, stop_at_newline: bool, top_k: int | None = None,
              generator=None) -> list[str]:
    """Text generated after each prompt (greedy unless top_k), `opts.batch_size` prompts at a time in
    order of length; a prompt keeps its last block - max_new_tokens tokens. Stops at <|endoftext|>
    (and at a newline token when stop_at_newline), which are not part of the text."""
    room = model.config.block_size - max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room in a {model.config.block_size}-token window")
    prompts = [p[-room:] for p in prompts]
    eot = tokenizer.eot_id
    stop = ([[eot]] if eot is not None else []) + (_newline_ids(tokenizer) if stop_at_newline else [])
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
    out = [""] * len(prompts)
    for s in range(0, len(order), opts.batch_size):
        part = order[s:s + opts.batch_size]
        gen = generate(model, [prompts[k] for k in part], max_new_tokens, temperature=0.0 if top_k is None else 1.0,
                       top_k=top_k, stop=stop, generator=generator, compile=opts.compile)
        for _ in gen:
            pass
        for k, ids in zip(part, gen.tokens):
            if ids and ids[-1] == eot:
                ids = ids[:-1]
            text = tokenizer.decode(ids)
            out[k] = text.split("\n")[0] if stop_at_newline else text
        if on_progress is not None:
            on_progress(min(s + opts.batch_size, len(order)), len(order), {})
    return out


# --- the three tasks ---------------------------------------------------------------------------------

def summarize(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None) -> dict:
    """data: a file of articles, one per line (references read from the sibling .target file when there
    is one), or a list of (article, reference or None)."""
    if readers.is_path(data):
        articles = readers.plain_lines(data, "summarize")
        target = Path(data).with_suffix(".target")
        refs = readers.plain_lines(target, "summarize") if target.is_file() else [None] * len(articles)
        if len(refs) != len(articles):
            raise ValueError(f"summarize: {data} has {len(articles)} articles but {target} {len(refs)} summaries")
        pairs = list(zip(articles, refs))
    else:
        pairs = list(data)
    pairs = pairs[:opts.max_examples]
    if not pairs:
        raise ValueError("summarize: no articles")
    tldr = tokenizer.encode_ordinary("\nTL;DR:")
    room = model.config.block_size - 100 - len(tldr)
    prompts = [tokenizer.encode_ordinary(a)[:room] + tldr for a, _ in pairs]
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(opts.seed)
    texts = _continue(model, tokenizer, prompts, 100, opts, on_progress, False, top_k=2, generator=g)
    summaries = [first_sentences(t, 3) for t in texts]
    out = {"task": "summarize", "examples": len(pairs), "predictions": summaries}
    scored = [(s, r) for s, (_, r) in zip(summaries, pairs) if r is not None]
    if scored:
        from rouge_score import rouge_scorer
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        scores = [scorer.score(r, s) for s, r in scored]
        for name in ("rouge1", "rouge2", "rougeL"):
            out[name] = 100 * sum(sc[name].fmeasure for sc in scores) / len(scores)
    out["protocol"] = (f"article (first {room} tokens) + '\\nTL;DR:', 100 tokens of top-k sampling (k=2, seed "
                       f"{opts.seed}), first 3 sentences; " + (f"ROUGE-1/2/L F1 (rouge-score, stemmed) on "
                       f"{len(scored):,} articles" if scored else "no reference summaries: ROUGE not computed"))
    return out


def _wmt_pair(path) -> tuple[Path, Path]:
    """newstest2014-fren.en.txt <-> newstest2014-fren.fr.txt -> (English file, French file)."""
    path = Path(path)
    m = re.search(r"\.(en|fr)(?=\.\w+$|$)", path.name)
    if m is None:
        raise ValueError(f"translate: {path}: cannot tell the language; expected a name such as "
                         f"newstest2014-fren.en.txt with its French twin .fr.txt beside it")
    other = path.with_name(path.name[:m.start()] + (".fr" if m.group(1) == "en" else ".en") + path.name[m.end():])
    return (path, other) if m.group(1) == "en" else (other, path)


def translate(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None) -> dict:
    """data: one file of an aligned WMT pair (the other found by its language suffix), or a list of
    (english, french) pairs. The first opts.shots pairs are the examples in every prompt (not scored)."""
    if opts.direction not in ("en-fr", "fr-en"):
        raise ValueError(f"translate: direction={opts.direction!r} must be 'en-fr' or 'fr-en'")
    if readers.is_path(data):
        en, fr = _wmt_pair(data)
        en_lines, fr_lines = readers.plain_lines(en, "translate"), readers.plain_lines(fr, "translate")
        if len(en_lines) != len(fr_lines):
            raise ValueError(f"translate: {en} has {len(en_lines)} lines but {fr} has {len(fr_lines)}; "
                             f"the files must be aligned line by line")
        pairs = list(zip(en_lines, fr_lines))
    else:
        pairs = list(data)
    if opts.direction == "fr-en":
        pairs = [(f, e) for e, f in pairs]
    demos, pairs = pairs[:opts.shots], pairs[opts.shots:][:opts.max_examples]
    if not pairs:
        raise ValueError(f"translate: no sentence pairs after the {opts.shots} example pairs")
    head = "".join(f"{s} = {t}\n" for s, t in demos)
    prompts = [tokenizer.encode_ordinary(f"{head}{s} =") for s, _ in pairs]
    texts = _continue(model, tokenizer, prompts, 128, opts, on_progress, True)
    hyps = [first_sentences(t, 1) for t in texts]
    import sacrebleu
    bleu = sacrebleu.corpus_bleu(hyps, [[t for _, t in pairs]])
    return {"task": "translate", "bleu": bleu.score, "examples": len(pairs), "predictions": hyps,
            "protocol": (f"{opts.direction}: {len(demos)} example pairs 'source = target' then 'source =', greedy "
                         f"(at most 128 tokens, to the end of the line), first sentence; corpus BLEU "
                         f"(sacrebleu {sacrebleu.__version__}, 13a tokenization) on "
                         f"{len(pairs):,} sentences")}


def coqa(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None) -> dict:
    """data: CoQA's json, or a list of {"story": str, "turns": [(question, [gold answers])]}. Every turn
    is asked with the gold answers of the turns before it as the conversation."""
    stories = (readers.coqa_stories(data) if readers.is_path(data) else list(data))[:opts.max_examples]
    prompts, golds = [], []
    for st in stories:
        history = ""
        for q, answers in st["turns"]:
            prompts.append(tokenizer.encode_ordinary(f"{st['story']}\n\n{history}Q: {q}\nA:"))
            golds.append(answers)
            history += f"Q: {q}\nA: {answers[0]}\n\n"
    if not prompts:
        raise ValueError("coqa: no questions")
    preds = [p.strip() for p in _continue(model, tokenizer, prompts, 32, opts, on_progress, True)]
    f1 = 100 * sum(coqa_f1(p, g) for p, g in zip(preds, golds)) / len(preds)
    return {"task": "coqa", "f1": f1, "examples": len(preds), "predictions": preds,
            "protocol": (f"story + 'Q: ...\\nA: ...' history (gold answers) + 'Q: question\\nA:', greedy to the "
                         f"end of the line (at most 32 tokens), prompt keeps its last tokens; CoQA F1 "
                         f"(leave-one-out over gold answers) on {len(preds):,} questions of {len(stories)} stories")}
