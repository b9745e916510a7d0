"""The GPT-2 paper's zero-shot tasks that score text: corpus perplexities, LAMBADA, CBT.

Each task is `task(model, tokenizer, data, opts, on_progress)` -> {metric: value, ..., "protocol":
one line saying how it was computed}. `data` is a path (read with duolm.evaluation.readers) or the
task's examples. Accuracies are percentages, as in the paper's Table 3.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from duolm.evaluation import readers
from duolm.evaluation.detok import detokenize, detokenize_words
from duolm.evaluation.perplexity import (bits_per_unit, count_words, encode_stream, perplexity,
                                         score_stream, token_nll)
from duolm.evaluation.scoring import PLL
from duolm.models.gpt2 import KVCache

Progress = Callable[[int, "int | None", dict], None]   # (done, total or None, running metrics)


@dataclass
class EvalOptions:
    """How `duolm eval` runs a task; each task reads the options it uses."""
    stride: int | None = field(default=None, metadata={
        "help": "sliding-window stride in tokens (default: half the context window)"})
    batch_size: int = field(default=8, metadata={"help": "windows / examples per forward pass"})
    detokenize: bool = field(default=True, metadata={
        "help": "keep the dataset's tokenization (the paper undoes it with invertible de-tokenizers)"})
    stopword_filter: bool = field(default=False, metadata={
        "help": "LAMBADA: the predicted word may not be a stop word (the paper's filter)"})
    max_examples: int | None = field(default=None, metadata={
        "help": "score only the first N examples (LAMBADA, CBT, prompted tasks)"})
    seed: int = field(default=0, metadata={"help": "sampling seed (summarize)"})
    shots: int = field(default=4, metadata={"help": "translate: example pairs before each sentence"})
    direction: str = field(default="en-fr", metadata={"help": "translate: direction", "choices": ["en-fr", "fr-en"]})
    pll: str = field(default="original", metadata={
        "help": "blimp with a BERT model: the pseudo-log-likelihood (original: one token masked a copy; "
                "within-word-l2r: also the pieces of its word to its right)", "choices": list(PLL)})
    compile: bool = field(default=False, metadata={
        "help": "coqa, summarize, translate: decode through the static-shape step compiled with torch.compile (a "
                "CUDA graph on GPUs; no faster on the CPU); the scoring forwards stay eager"})


# --- corpus perplexity -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    detok: str | None     # de-tokenizer rules (detok.RULES), None: raw bytes
    framed: bool          # lines framed by spaces (WikiText, PTB)
    unit: str             # normaliser: "word", "byte" or "char"


CORPORA = {
    "wikitext2": Corpus("wikitext", True, "word"),
    "wikitext103": Corpus("wikitext", True, "word"),
    "ptb": Corpus("ptb", True, "word"),
    "1bw": Corpus("1bw", False, "word"),
    "enwik8": Corpus(None, False, "byte"),
    "text8": Corpus(None, False, "char"),
}


def corpus_perplexity(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None,
                      task: str = "wikitext2") -> dict:
    """Log-probability of a whole corpus, normalised per word of the dataset's own tokenization (its
    published word count: whitespace tokens + one end-of-line per line), per byte or per character.
    Lines are de-tokenized (if opts.detokenize) and joined with newlines; the text is scored after an
    <|endoftext|> token with sliding windows (perplexity.score_stream). Streamed end to end."""
    c = CORPORA[task]
    seen = {"words": 0, "bytes": 0, "chars": 0}
    total = Path(data).stat().st_size if readers.is_path(data) else None
    full = total == readers.FULL_CORPUS         # the whole enwik8 / text8: its test split is read
    if c.unit == "word":
        lines = readers.corpus_lines(data, task, c.framed) if readers.is_path(data) else data

        def texts():
            for line in lines:
                line = line[:-1] if line.endswith("\n") else line
                seen["words"] += count_words([line])
                seen["bytes"] += len(line.encode()) + 1
                yield (detokenize(line, c.detok) if opts.detokenize else line) + "\n"
    else:
        blocks = readers.byte_blocks(data, task, text8=c.unit == "char") if readers.is_path(data) else data
        total = readers.TEST_SPLIT if full else total

        def counted(blocks):
            for b in blocks:
                seen["bytes"] += len(b)
                yield b

        def texts():
            for t in readers.decode_blocks(counted(blocks)):
                seen["chars"] += len(t)
                yield t
    eot = tokenizer.eot_id
    chunks = encode_stream(tokenizer, texts())
    if eot is not None:
        chunks = itertools.chain([[eot]], chunks)

    def on_batch(nll, n):
        if on_progress is not None:
            on_progress(seen["bytes"], total, {"ppl_token": round(math.exp(nll / n), 3)})

    nll, n = score_stream(model, chunks, opts.stride, opts.batch_size, on_batch)
    if n == 0:
        raise ValueError(f"{task}: {data if readers.is_path(data) else 'the text'} holds no tokens to score")
    units = seen[{"word": "words", "byte": "bytes", "char": "chars"}[c.unit]]
    out = {"task": task}
    if c.unit == "word":
        out["ppl"] = perplexity(nll, units)
    else:
        out["bpb" if c.unit == "byte" else "bpc"] = bits_per_unit(nll, units)
    out.update(ppl_token=perplexity(nll, n), nll=nll, tokens=n, **{c.unit + "s": units})
    block = model.config.block_size
    stride = block // 2 if opts.stride is None else opts.stride
    norm = {"word": f"perplexity per word over {units:,} words (whitespace tokens + one end-of-line per line)",
            "byte": f"bits per byte over {units:,} bytes", "char": f"bits per character over {units:,} characters"}
    detok = (f"{c.detok} de-tokenizer {'on' if opts.detokenize else 'off'}" if c.detok
             else "raw text" + (" (the test split: last 5,000,000 bytes of 10^8)" if full else ""))
    out["protocol"] = (f"window {block} tokens, stride {stride}; {norm[c.unit]}; {detok}; "
                       f"{n:,} BPE tokens scored" + (" after <|endoftext|>" if eot is not None else ""))
    return out


# --- LAMBADA -------------------------------------------------------------------------------------------

# NLTK's English stop words (the list the paper's "stop-word filter" is usually read as).
STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between
both but by can did do does doing don down during each few for from further had has have having he her here
hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now
of off on once only or other our ours ourselves out over own s same she should so some such t than that the
their theirs them themselves then there these they this those through to too under until up very was we
were what when where which while who whom why will with you your yours yourself yourselves""".split())


def stopword_ids(tokenizer) -> torch.Tensor:
    """Ids of the tokens that are a stop word on their own (" the", "The", ...), for the filter."""
    ids = []
    for i in range(tokenizer.vocab_size):
        try:
            word = tokenizer.decode_bytes([i]).decode("utf-8", "replace").strip().lower()
        except ValueError:       # an unused id
            continue
        if word in STOPWORDS:
            ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


def lambada_scores(model, tokenizer, examples: list, batch_size: int = 8, stopword_filter: bool = False,
                   on_progress: Progress | None = None) -> list[tuple[float, bool, bool]]:
    """Per example -> (nll of the target's tokens, last token predicted, every target token predicted).

    The input is the context's tokens then the target's (" word"), the last one dropped; the states
    before the target's tokens give their predictions (argmax). Examples go `batch_size` to a forward,
    sorted by length and right-padded (padding after a sequence cannot change it: attention is causal);
    the output layer runs on the target positions only. A context longer than the window keeps its
    last tokens. With stopword_filter, the prediction of the word's first token skips stop words."""
    block = model.config.block_size
    device = next(model.parameters()).device
    stop = stopword_ids(tokenizer).to(device) if stopword_filter else None
    eot = tokenizer.eot_id
    seqs = []
    for ex in examples:
        ctx = tokenizer.encode_ordinary(ex.context) or ([eot] if eot is not None else [])
        tgt = tokenizer.encode_ordinary(ex.target)
        if not ctx or not tgt or len(tgt) > block:
            raise ValueError(f"lambada: cannot score context {ex.context[-40:]!r} / target {ex.target!r}")
        seqs.append(((ctx + tgt)[:-1][-block:], tgt))
    order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k][0]))
    out: list = [None] * len(seqs)
    done = hits = 0
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            part = order[s:s + batch_size]
            T = len(seqs[part[0]][0])
            idx = torch.zeros(len(part), T, dtype=torch.long)
            rows, tg = [], []
            for b, k in enumerate(part):
                inp, tgt = seqs[k]
                idx[b, :len(inp)] = torch.tensor(inp)
                rows += [(b, len(inp) - len(tgt) + j) for j in range(len(tgt))]
                tg += tgt
            h = model.hidden(idx.to(device))
            hs = h[[r[0] for r in rows], [r[1] for r in rows]]                 # (n targets, C)
            logits = model.head(hs).float()
            tg_t = torch.tensor(tg, device=device)
            nll = torch.nn.functional.cross_entropy(logits, tg_t, reduction="none").double().tolist()
            firsts = []
            pos = 0
            for k in part:
                firsts.append(pos)
                pos += len(seqs[k][1])
            if stop is not None:
                logits[firsts] = logits[firsts].index_fill(1, stop, float("-inf"))
            hit = (logits.argmax(-1) == tg_t).tolist()
            for k, f in zip(part, firsts):
                n = len(seqs[k][1])
                out[k] = (sum(nll[f:f + n]), hit[f + n - 1], all(hit[f:f + n]))
                hits += out[k][1]
            done += len(part)
            if on_progress is not None:
                on_progress(done, len(out), {"acc_last_token": round(100 * hits / done, 2)})
    return out


def lambada(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None) -> dict:
    """LAMBADA: predict the last word of each passage. acc_last_token counts a hit when the target's
    last BPE token is predicted given everything before it (OpenAI's measure: 45.99% for the 117M
    model); acc_last_word when every token of " word" is (lm-evaluation-harness: 32.6%); ppl is the
    perplexity of the target words."""
    examples = readers.lambada_examples(data, "lambada", opts.detokenize) if readers.is_path(data) else list(data)
    examples = examples[:opts.max_examples]
    if not examples:
        raise ValueError("lambada: no examples")
    recs = lambada_scores(model, tokenizer, examples, opts.batch_size, opts.stopword_filter, on_progress)
    n = len(recs)
    return {
        "task": "lambada",
        "acc_last_token": 100 * sum(r[1] for r in recs) / n,
        "acc_last_word": 100 * sum(r[2] for r in recs) / n,
        "ppl": math.exp(sum(r[0] for r in recs) / n),
        "examples": n,
        "protocol": (f"context = passage without its last word, target = ' ' + last word; accuracy: last "
                     f"BPE token (acc_last_token) / every token of the word (acc_last_word), greedy; "
                     f"ppl per target word; stop-word filter {'on' if opts.stopword_filter else 'off'}; "
                     f"plain-text passages de-tokenized: {'yes' if opts.detokenize else 'no'}; {n:,} passages"),
    }


# --- CBT -----------------------------------------------------------------------------------------------

def score_continuations(model, prefix: list[int], conts: list[list[int]]) -> list[float]:
    """log P(cont | prefix) for each continuation, the prefix run once: its keys/values are computed
    for one row, copied to one row per continuation, and the continuations (right-padded) run on top.
    A prefix too long for the window keeps its last tokens."""
    block = model.config.block_size
    longest = max(len(c) for c in conts)
    if not prefix or min(len(c) for c in conts) == 0 or longest > block:
        raise ValueError(f"cannot score continuations of {[len(c) for c in conts]} tokens after "
                         f"{len(prefix)} in a {block}-token window")
    prefix = prefix[-(block + 1 - longest):]
    w = model.wte.weight
    cache = KVCache(model.config, 1, max_len=len(prefix) + longest - 1, device=w.device,
                    dtype=w.dtype)
    J = len(conts)
    with torch.inference_mode():
        h = model.hidden(torch.tensor([prefix], device=w.device), cache=cache)
        nll = token_nll(model, h[0, -1:].expand(J, -1), torch.tensor([c[0] for c in conts], device=w.device))
        scores = (-nll).tolist()
        if longest > 1:
            cache.reorder(torch.zeros(J, dtype=torch.long))
            idx = torch.zeros(J, longest - 1, dtype=torch.long)
            for j, c in enumerate(conts):
                idx[j, :len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
            h = model.hidden(idx.to(w.device), cache=cache)
            rows = [(j, p) for j, c in enumerate(conts) for p in range(len(c) - 1)]
            tg = torch.tensor([c[p + 1] for j, c in enumerate(conts) for p in range(len(c) - 1)], device=w.device)
            rest = token_nll(model, h[[r[0] for r in rows], [r[1] for r in rows]], tg).tolist()
            for (j, _), v in zip(rows, rest):
                scores[j] -= v
    return scores


def cbt_texts(ex: readers.CBTExample, candidate: str, detok: bool) -> tuple[str, str]:
    """(conditioning text, scored text): the 20 sentences and the question up to the blank, then the
    question from the blank to its end with `candidate` filled in."""
    tokens = ex.context + [candidate if t == "XXXXX" else t for t in ex.question]
    blank = len(ex.context) + ex.question.index("XXXXX")
    if detok:
        text, starts = detokenize_words(tokens, "books")
    else:
        text = " ".join(tokens)
        starts = [0]
        for t in tokens[:-1]:
            starts.append(starts[-1] + len(t) + 1)
    cut = starts[blank] - (starts[blank] > 0 and text[starts[blank] - 1] == " ")
    return text[:cut], text[cut:]


def cbt_scores(model, tokenizer, ex: readers.CBTExample, detok: bool = True) -> list[float]:
    """log P(question from the blank on, candidate filled in | context sentences, question before the
    blank), for each candidate. Candidates that share their conditioning text share one prefix run."""
    groups: dict[str, list[tuple[int, list[int]]]] = {}
    for j, cand in enumerate(ex.candidates):
        prefix, scored = cbt_texts(ex, cand, detok)
        groups.setdefault(prefix, []).append((j, tokenizer.encode_ordinary(scored)))
    scores = [0.0] * len(ex.candidates)
    for prefix, items in groups.items():
        ids = tokenizer.encode_ordinary(prefix) or [tokenizer.eot_id]
        for (j, _), s in zip(items, score_continuations(model, ids, [c for _, c in items])):
            scores[j] = s
    return scores


def cbt(model, tokenizer, data, opts: EvalOptions, on_progress: Progress | None = None, task: str = "cbt") -> dict:
    """Children's Book Test (CN or NE file): the candidate whose filled-in question is most probable wins."""
    examples = (readers.cbt_examples(data, task) if readers.is_path(data) else list(data))[:opts.max_examples]
    if not examples:
        raise ValueError(f"{task}: no examples")
    hits = 0
    for k, ex in enumerate(examples):
        s = cbt_scores(model, tokenizer, ex, opts.detokenize)
        hits += ex.candidates[max(range(len(s)), key=s.__getitem__)] == ex.answer
        if on_progress is not None:
            on_progress(k + 1, len(examples), {"acc": round(100 * hits / (k + 1), 2)})
    n = len(examples)
    return {"task": task, "acc": 100 * hits / n, "examples": n,
            "protocol": (f"log P(question from the blank to its end, candidate filled in | 20 sentences + "
                         f"question before the blank), best of {len(examples[0].candidates)} candidates; "
                         f"de-tokenized: {'yes' if opts.detokenize else 'no'}; {n:,} questions")}
