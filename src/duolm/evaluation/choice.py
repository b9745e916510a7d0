"""Zero-shot multiple choice, scored as lm-evaluation-harness scores `output_type: multiple_choice`.

    items = read_items("piqa.jsonl")                   # llm-foundry's forms, or HellaSwag's raw form
    result = multiple_choice(model, tok, items)          # {"acc": 0.61, "acc_norm": 0.63, "n": 1838, ...}

Three file forms, one JSON object a line, told apart by their fields:
- multiple choice (llm-foundry; PIQA, ARC, COPA): {"query", "choices", "gold"}: context = query, each choice
  scored as the continuation " " + choice;
- schema (llm-foundry; WSC, WinoGrande), partial scoring: {"context_options", "continuation", "gold"}: the one
  continuation " " + continuation scored after each filled-in context;
- HellaSwag's raw form {"ctx_a", "ctx_b", "activity_label", "endings", "label"}, preprocessed as
  lm-evaluation-harness's lm_eval/tasks/hellaswag/utils.py does (`hellaswag_doc`).

Each (context, continuation) pair is tokenized as lm-eval's `_encode_pair` does and scored with the context
left-truncated to the window as its `_loglikelihood_tokens` does (`encode_pair`, `score_pairs`). The metrics
(`item_metrics`): `acc` (the choice of largest summed log-probability), `acc_norm` (that sum divided by the
length in characters of lm-eval's "choice": the choice text, or for the schema form the filled-in context),
and `acc_per_token`, llm.c's completion-style measure (its HellaSwag script calls it acc_norm): the choice of
smallest mean loss per token of the scored continuation.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from duolm.evaluation.perplexity import token_nll
from duolm.evaluation.tasks import EvalOptions, Progress
from duolm.models.gpt2 import KVCache

FORMS = {"multiple-choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
         "hellaswag": ("ctx_a", "ctx_b", "activity_label", "endings", "label")}


@dataclass(frozen=True)
class Item:
    """One question: the (context, continuation) pair scored for each choice, the lengths in characters
    acc_norm divides by, the gold index."""
    pairs: tuple[tuple[str, str], ...]
    chars: tuple[int, ...]
    gold: int


# --- reading -------------------------------------------------------------------------------------------

def hellaswag_preprocess(text: str) -> str:
    """lm-evaluation-harness's HellaSwag `preprocess`: strip, " [title]" -> ". ", drop [bracketed] WikiHow
    artifacts, one double space made single.

    >>> hellaswag_preprocess(" Roof shingle removal: A man is [header] sitting on a roof. [title] Then  ")
    'Roof shingle removal: A man is sitting on a roof.. Then'
    """
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag_doc(doc: dict) -> tuple[str, list[str], int]:
    """A raw HellaSwag record -> (query, choices, gold), lm-eval's `process_docs`: query = the activity label,
    ": ", ctx_a, " " and ctx_b capitalized (str.capitalize: its first letter upper, the rest lower)."""
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return (hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            [hellaswag_preprocess(e) for e in doc["endings"]], int(doc["label"]))


def form_of(doc) -> str:
    """Which of FORMS a record is in (by its fields), or a ValueError naming the forms."""
    keys = set(doc) if isinstance(doc, dict) else set()
    for name, need in FORMS.items():
        if keys >= set(need):
            return name
    raise ValueError("not a multiple-choice record: expected the fields "
                     + " or ".join("{" + ", ".join(f) + "}" for f in FORMS.values()))


def make_item(doc: dict) -> Item:
    """A record in any of FORMS -> an Item; a ValueError on an empty choice list or a gold index out of range."""
    form = form_of(doc)
    if form == "schema":
        contexts, cont, gold = doc["context_options"], doc["continuation"], doc["gold"]
        choices = contexts                           # lm-eval's doc_to_choice: the filled-in contexts
        pairs = [(c, " " + cont) for c in contexts]
    else:
        query, choices, gold = hellaswag_doc(doc) if form == "hellaswag" else (doc["query"], doc["choices"], doc["gold"])
        pairs = [(query, " " + c) for c in choices] if isinstance(choices, list) else []
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{form}: the choices must be a non-empty list of texts, got {choices!r}")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ValueError(f"{form}: gold {gold!r} is not an index into the {len(choices)} choices")
    return Item(tuple(pairs), tuple(len(c) for c in choices), gold)


def read_items(path, forms=tuple(FORMS)) -> tuple[str, list[Item]]:
    """(form, items) of a jsonl file, every line in one of `forms`; errors name the file and the line."""
    form, items = None, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                got = form_of(doc)
                if got not in forms or form not in (None, got):
                    raise ValueError(f"a {got} record, expected " + (" or ".join(forms) if form is None else form))
                form = got
                items.append(make_item(doc))
            except (ValueError, KeyError) as e:        # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{n}: {e}") from None
    if not items:
        raise ValueError(f"{path}: no items")
    return form, items


# --- scoring -------------------------------------------------------------------------------------------

def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair` for a causal model: the context's trailing whitespace moves to the
    continuation; the continuation's tokens are those of context + continuation past the context's own.
    An empty context is <|endoftext|>."""
    if not context:
        return [tokenizer.eot_id], tokenizer.encode_ordinary(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tokenizer.encode_ordinary(context)
    return ctx, tokenizer.encode_ordinary(context + continuation)[len(ctx):]


def score_pairs(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log P(continuation | context) of each (context ids, continuation ids). Each input is the last
    block + 1 tokens of context + continuation less the last (lm-eval's left truncation); the tokens all
    inputs begin with, up to the first scored position, run once and are shared through a KV cache (a
    question's context), the rest of each input runs as one right-padded batch on top, the output layer
    on the scored positions only."""
    block = model.config.block_size
    if any(not ctx or not cont or len(cont) > block for ctx, cont in pairs):
        raise ValueError(f"cannot score continuations of {[len(c) for _, c in pairs]} tokens after contexts of "
                         f"{[len(c) for c, _ in pairs]} in a {block}-token window")
    seqs = [(ctx + cont)[-(block + 1):][:-1] for ctx, cont in pairs]
    firsts = [len(s) - len(cont) for s, (_, cont) in zip(seqs, pairs)]      # each one's first scored position
    shared = 0
    while shared < min(firsts) and len({s[shared] for s in seqs}) == 1:
        shared += 1
    device = model.wte.weight.device
    rest = max(len(s) for s in seqs) - shared
    idx = torch.zeros(len(seqs), rest, dtype=torch.long)
    for j, s in enumerate(seqs):
        idx[j, :len(s) - shared] = torch.tensor(s[shared:])
    with torch.inference_mode():
        cache = None
        if shared:
            cache = KVCache(model.config, 1, shared + rest, device=device, dtype=model.wte.weight.dtype)
            model.hidden(torch.tensor([seqs[0][:shared]], device=device), cache=cache)
            cache.reorder(torch.zeros(len(seqs), dtype=torch.long))
        h = model.hidden(idx.to(device), cache=cache)
        rows = [(j, p - shared) for j, (s, f) in enumerate(zip(seqs, firsts)) for p in range(f, len(s))]
        targets = [t for _, cont in pairs for t in cont]
        nll = token_nll(model, h[[r for r, _ in rows], [p for _, p in rows]], torch.tensor(targets, device=device))
    sums, k = [], 0
    for _, cont in pairs:
        sums.append(-float(nll[k:k + len(cont)].sum()))
        k += len(cont)
    return sums


def score_item(model, tokenizer, item: Item) -> tuple[list[float], list[int]]:
    """(log-probability of each choice's continuation, its number of tokens) for one item."""
    pairs = [encode_pair(tokenizer, ctx, cont) for ctx, cont in item.pairs]
    return score_pairs(model, pairs), [len(cont) for _, cont in pairs]


# --- metrics -------------------------------------------------------------------------------------------

def argmax(values) -> int:
    """The index of the first largest value (numpy's argmax, which lm-eval uses)."""
    return max(range(len(values)), key=lambda k: (values[k], -k))


def item_metrics(lls: list[float], chars: list[int], tokens: list[int], gold: int) -> dict:
    """acc, acc_norm and acc_per_token of one item (1.0 or 0.0), with the three predictions.

    >>> item_metrics([-6.0, -8.0], chars=[4, 10], tokens=[2, 4], gold=1)
    {'pred': 0, 'pred_norm': 1, 'pred_per_token': 1, 'acc': 0.0, 'acc_norm': 1.0, 'acc_per_token': 1.0}

    acc: -6 > -8; acc_norm: -6/4 = -1.5 < -8/10 = -0.8; acc_per_token: mean loss 6/2 = 3 > 8/4 = 2."""
    preds = {"pred": argmax(lls), "pred_norm": argmax([ll / c for ll, c in zip(lls, chars)]),
             "pred_per_token": argmax([ll / t for ll, t in zip(lls, tokens)])}
    return {**preds, **{"acc" + k[4:]: float(p == gold) for k, p in preds.items()}}


def mean_metrics(records: list[dict]) -> dict:
    """acc, acc_norm, acc_per_token (fractions) and chance (the mean of 1 / choices) over items' records."""
    n = len(records)
    out = {k: sum(r[k] for r in records) / n for k in ("acc", "acc_norm", "acc_per_token")}
    return {**out, "chance": sum(1 / len(r["lls"]) for r in records) / n, "n": n}


PROTOCOL = ("lm-evaluation-harness's multiple_choice: log P(' ' + choice | context) summed over its tokens; "
            "acc: argmax of the sum; acc_norm: of the sum / the choice's length in characters{schema}; "
            "acc_per_token: of the mean per token (llm.c's completion-style acc_norm); contexts left-truncated "
            "to the {block}-token window; zero-shot; {n:,} items")


def multiple_choice(model, tokenizer, data, opts: EvalOptions | None = None, on_progress: Progress | None = None,
                    task: str = "multiple-choice") -> dict:
    """Score every item of `data` (a jsonl path, or Items) -> {"task", "acc", "acc_norm", "acc_per_token",
    "chance", "n", "protocol", "items": one record per item (gold, lls, chars, tokens, preds, metrics)}.
    task "multiple-choice" reads llm-foundry's two forms, "hellaswag" HellaSwag's raw form."""
    opts = opts or EvalOptions()
    forms = ("hellaswag",) if task == "hellaswag" else ("multiple-choice", "schema")
    form, items = read_items(data, forms) if not isinstance(data, list) else ("items", data)
    items = items[:opts.max_examples]
    model = getattr(model, "_orig_mod", model)
    records = []
    for item in items:
        lls, tokens = score_item(model, tokenizer, item)
        records.append({"gold": item.gold, "lls": lls, "chars": list(item.chars), "tokens": tokens,
                        **item_metrics(lls, list(item.chars), tokens, item.gold)})
        if on_progress is not None:
            on_progress(len(records), len(items), {"acc_norm": round(mean_metrics(records)["acc_norm"], 4)})
    schema = " (schema form: of the filled-in context, as lm-eval's doc_to_choice)" if form == "schema" else ""
    return {"task": task, **mean_metrics(records), "items": records,
            "protocol": PROTOCOL.format(schema=schema, block=model.config.block_size, n=len(records))}


# --- the zero-shot-mc suite ----------------------------------------------------------------------------

# row -> (task, where its file may be under the suite's folder; first match wins)
SUITE = {
    "hellaswag": ("hellaswag", ["hellaswag/hellaswag_val.jsonl", "hellaswag_val.jsonl"]),
    "piqa": ("multiple-choice", ["mc/piqa.jsonl", "piqa.jsonl"]),
    "arc-easy": ("multiple-choice", ["mc/arc_easy.jsonl", "arc_easy.jsonl"]),
    "copa": ("multiple-choice", ["mc/copa.jsonl", "copa.jsonl"]),
    "wsc273": ("multiple-choice", ["mc/winograd_wsc.jsonl", "winograd_wsc.jsonl"]),
}
# The released GPT-2 124M's published figures in this protocol (percent; docs/evaluation.md says where each
# comes from); a row without one stays empty.
PUBLISHED_124M = {"hellaswag": {"acc_norm": 31.14}}


def suite_markdown(suite: dict) -> str:
    """The suite as a table: task, items, acc, acc_norm, chance (percent), and GPT-2 124M's published figures."""
    lines = ["| task | items | acc | acc_norm | chance | GPT-2 124M acc (published) | GPT-2 124M acc_norm (published) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in suite["results"].items():
        pub = PUBLISHED_124M.get(name, {})
        lines.append(f"| {name} | {r['n']:,} | {100 * r['acc']:.2f} | {100 * r['acc_norm']:.2f} | "
                     f"{100 * r['chance']:.2f} | {pub.get('acc', '')} | {pub.get('acc_norm', '')} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """One task's result (fractions) or the suite's table, then the protocol."""
    if "results" in result:
        protocols = {r["protocol"].rsplit(";", 1)[0] for r in result["results"].values()}
        return suite_markdown(result) + "".join(f"\n\nprotocol: {p}" for p in sorted(protocols))
    rows = [f"| {k} | {result[k]:.4f} |" for k in ("acc", "acc_norm", "acc_per_token", "chance")]
    return "\n".join([f"| {result['task']} ({result['n']:,} items) | |", "|---|---|", *rows,
                      "", f"protocol: {result['protocol']}"])
