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

import copy
import json
import re
from dataclasses import dataclass

import torch

from duolm.evaluation.perplexity import token_nll
from duolm.evaluation.tasks import EvalOptions, Progress
from duolm.models.gpt2 import KVCache

# each form's fields and what each must hold (KINDS)
FORMS = {"multiple-choice": {"query": "text", "choices": "texts", "gold": "index"},
         "schema": {"context_options": "texts", "continuation": "text", "gold": "index"},
         "hellaswag": {"ctx_a": "text", "ctx_b": "text", "activity_label": "text", "endings": "texts",
                       "label": "label"}}


def _is_index(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)      # JSON's true is not 1 here


# kind -> (what it is, in words; the test of a value)
KINDS = {"text": ("a string", lambda v: isinstance(v, str)),
         "texts": ("a non-empty list of strings", lambda v: isinstance(v, list) and bool(v)
                   and all(isinstance(c, str) for c in v)),
         "index": ("an integer", _is_index),
         # HellaSwag's label: an integer in the original files, a string of digits on the Hugging Face Hub
         "label": ("an integer or a string of digits", lambda v: _is_index(v)
                   or (isinstance(v, str) and v.isascii() and v.isdigit()))}


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


def check_fields(doc: dict, form: str) -> None:
    """A ValueError naming the first field of `form` whose value is not of its kind (FORMS, KINDS):
    {"query": 5, ...} -> 'multiple-choice: field "query" must be a string, got 5'."""
    for name, kind in FORMS[form].items():
        what, ok = KINDS[kind]
        if not ok(doc[name]):
            got = repr(doc[name])
            raise ValueError(f'{form}: field "{name}" must be {what}, got {got[:60] + "..." if len(got) > 60 else got}')


def make_item(doc: dict) -> Item:
    """A record in any of FORMS -> an Item; a ValueError on a field of the wrong type or a gold index out of range."""
    form = form_of(doc)
    check_fields(doc, form)
    if form == "schema":
        contexts, cont, gold = doc["context_options"], doc["continuation"], doc["gold"]
        choices = contexts                           # lm-eval's doc_to_choice: the filled-in contexts
        pairs = [(c, " " + cont) for c in contexts]
    else:
        query, choices, gold = hellaswag_doc(doc) if form == "hellaswag" else (doc["query"], doc["choices"], doc["gold"])
        pairs = [(query, " " + c) for c in choices]
    if not 0 <= gold < len(choices):
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


@dataclass(frozen=True)
class Inputs:
    """One item's model inputs: per choice the tokens fed (context + continuation, left-truncated to the window,
    less the last) and the continuation scored at their end; `shared`: how many leading tokens all inputs have
    in common before the first scored position (run once, as the question's context)."""
    seqs: tuple[tuple[int, ...], ...]
    conts: tuple[tuple[int, ...], ...]
    shared: int


def model_inputs(pairs: list[tuple[list[int], list[int]]], block: int) -> Inputs:
    """(context ids, continuation ids) pairs -> Inputs: each input the last block + 1 tokens of context +
    continuation less the last, as lm-eval's `_loglikelihood_tokens` cuts them."""
    if any(not ctx or not cont or len(cont) > block for ctx, cont in pairs):
        raise ValueError(f"cannot score continuations of {[len(c) for _, c in pairs]} tokens after contexts of "
                         f"{[len(c) for c, _ in pairs]} in a {block}-token window")
    seqs = [tuple((ctx + cont)[-(block + 1):][:-1]) for ctx, cont in pairs]
    first = min(len(s) - len(cont) for s, (_, cont) in zip(seqs, pairs))      # the first scored position
    shared = 0
    while shared < first and len({s[shared] for s in seqs}) == 1:
        shared += 1
    return Inputs(tuple(seqs), tuple(tuple(cont) for _, cont in pairs), shared)


def span(batch: list[Inputs]) -> int:
    """Positions a batch takes: its longest shared prefix (left-padded) + its longest rest (right-padded)."""
    return max(x.shared for x in batch) + max(len(s) - x.shared for x in batch for s in x.seqs)


def _prefix_cache(model, batch: list[Inputs], room: int) -> tuple[KVCache, torch.Tensor]:
    """The items' shared prefixes, left-padded, run once into a KV cache with `room` more positions ->
    (cache, real: (items, P) 1 where a prefix token is real)."""
    device = model.wte.weight.device
    P = max(x.shared for x in batch)
    pre = torch.zeros(len(batch), P, dtype=torch.long)
    real = torch.zeros(len(batch), P, dtype=torch.long)
    for k, x in enumerate(batch):
        if x.shared:
            pre[k, P - x.shared:] = torch.tensor(x.seqs[0][:x.shared])
            real[k, P - x.shared:] = 1
    cache = KVCache(model.config, len(batch), P + room, device=device, dtype=model.wte.weight.dtype)
    model.hidden(pre.to(device), attention_mask=real.to(device), cache=cache)
    return cache, real


def score_inputs(model, batch: list[Inputs]) -> list[list[float]]:
    """log P(continuation | context) for every choice of every item in `batch` (span(batch) <= block_size).
    The items' shared prefixes run once, left-padded into one forward that fills a KV cache (_prefix_cache);
    the rest of every input runs on top, the rows sorted by length and 2 x items at a time, right-padded, each
    with a copy of its item's cache rows (positions count real tokens only, so padding changes nothing); the
    output layer runs on the scored positions only."""
    device = model.wte.weight.device
    P = max(x.shared for x in batch)
    owner = [k for k, x in enumerate(batch) for _ in x.seqs]
    rest = [s[x.shared:] for x in batch for s in x.seqs]
    conts = [c for x in batch for c in x.conts]
    lls = [0.0] * len(rest)
    order = sorted(range(len(rest)), key=lambda r: len(rest[r]))
    with torch.inference_mode():
        cache, real = _prefix_cache(model, batch, span(batch) - P) if P else (None, None)
        for start in range(0, len(order), 2 * len(batch)):
            rows = order[start:start + 2 * len(batch)]
            R = max(len(rest[r]) for r in rows)
            idx = torch.zeros(len(rows), R, dtype=torch.long)
            for i, r in enumerate(rows):
                idx[i, :len(rest[r])] = torch.tensor(rest[r])
            sub = mask = None
            if P:
                sub = copy.copy(cache)
                sub.reorder(torch.tensor([owner[r] for r in rows]))
                mask = torch.cat([real[[owner[r] for r in rows]], torch.ones(len(rows), R, dtype=torch.long)], 1)
                mask = mask.to(device)
            h = model.hidden(idx.to(device), attention_mask=mask, cache=sub)
            at = [(i, p) for i, r in enumerate(rows) for p in range(len(rest[r]) - len(conts[r]), len(rest[r]))]
            targets = torch.tensor([t for r in rows for t in conts[r]], device=device)
            nll = token_nll(model, h[[i for i, _ in at], [p for _, p in at]], targets).tolist()
            k = 0
            for r in rows:
                lls[r] = -sum(nll[k:k + len(conts[r])])
                k += len(conts[r])
    out: list[list[float]] = [[] for _ in batch]
    for r, k in enumerate(owner):
        out[k].append(lls[r])
    return out


def score_pairs(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log P(continuation | context) of each (context ids, continuation ids) of one item."""
    return score_inputs(model, [model_inputs(pairs, model.config.block_size)])[0]


def score_items(model, tokenizer, items: list[Item], batch_size: int = 8,
                on_batch=None) -> list[tuple[list[float], list[int]]]:
    """Each item's (log-probabilities of its choices, their numbers of tokens); items go up to `batch_size` to a forward, in order of length,
    as many as the window takes side by side (span). on_batch(items done) follows each forward."""
    block = model.config.block_size
    inputs = [model_inputs([encode_pair(tokenizer, *p) for p in item.pairs], block) for item in items]
    order = sorted(range(len(inputs)), key=lambda k: max(len(s) for s in inputs[k].seqs))
    out: list = [None] * len(inputs)
    batch: list[int] = []
    for k in order + [None]:
        if batch and (k is None or len(batch) == batch_size or span([inputs[j] for j in batch + [k]]) > block):
            for j, lls in zip(batch, score_inputs(model, [inputs[j] for j in batch])):
                out[j] = (lls, [len(c) for c in inputs[j].conts])
            if on_batch is not None:
                on_batch(sum(x is not None for x in out))
            batch = []
        if k is not None:
            batch.append(k)
    return out


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
    scores = score_items(model, tokenizer, items, opts.batch_size,
                         None if on_progress is None else lambda done: on_progress(done, len(items), {}))
    records = [{"gold": item.gold, "lls": lls, "chars": list(item.chars), "tokens": tokens,
                **item_metrics(lls, list(item.chars), tokens, item.gold)} for item, (lls, tokens) in zip(items, scores)]
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
