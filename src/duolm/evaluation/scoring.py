"""Scoring sentences with either family: GPT-2's log-likelihood and BERT's pseudo-log-likelihood, and BLiMP.

    score_sentences(gpt2, bpe, ["The cat sat."])          # [{"score": -9.3, "tokens": [...], "token_scores": [...]}]
    score_sentences(bert, wordpiece, ["The cat sat."], pll="within-word-l2r")
    blimp(model, tokenizer, "blimp/")                       # {"acc": ..., "paradigms": {...}, "fields": {...}}

GPT-2: log p(sentence) = sum_i log p(t_i | <|endoftext|> t_1 .. t_{i-1}): every token scored, the first conditioned on
<|endoftext|> (as lm-evaluation-harness's BLiMP task and minicons with bos_token=True). A worked example: three tokens
with next-token probabilities 1/2, 1/4 and 1/8 score ln(1/2) + ln(1/4) + ln(1/8) = -6 ln 2 = -4.159 nats.

BERT (Salazar et al., "Masked Language Model Scoring", ACL 2020): PLL(sentence) = sum_i log p(t_i | the sentence with
t_i masked), one copy of [CLS] sentence [SEP] a token, each with its token replaced by [MASK]. "within-word-l2r"
(Kauf & Ivanova 2023) also masks the pieces of t_i's word to its right ("##" pieces), so that a word's later pieces
do not give its earlier ones away. A worked example: "un ##believ ##able" (one word of three pieces) is scored from
three copies; "original" masks [un], [##believ], [##able] one at a time; "within-word-l2r" masks [un ##believ ##able],
then [##believ ##able], then [##able], each copy scoring its first masked piece. The copies of a batch of sentences
go through the encoder as one batch (sorted by length, padded), and the masked-LM head runs on the masked rows only.

BLiMP (Warstadt et al. 2020): minimal pairs, an acceptable and an unacceptable sentence; a pair is right when the
acceptable one scores higher. Accuracy per paradigm (the file's UID), per linguistic field (the mean of its
paradigms'), and overall (the mean of the paradigms', as the BLiMP authors report it).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from duolm.models import GPT2
from duolm.models.bert import BertForPreTraining
from duolm.tokenizers import ByteLevelBPE, WordPiece

PLL = ("original", "within-word-l2r")


def check_scorer(model, tokenizer) -> None:
    """GPT-2 with its byte-level BPE, or BERT with its masked-LM head and WordPiece, or a ValueError saying why."""
    if isinstance(model, GPT2) and isinstance(tokenizer, ByteLevelBPE):
        if tokenizer.eot_id is None:
            raise ValueError("scoring with GPT-2 conditions the first token on <|endoftext|>, which this tokenizer "
                             "lacks")
        return
    if isinstance(model, BertForPreTraining) and isinstance(tokenizer, WordPiece):
        return
    if getattr(model.config, "family", None) == "bert" and not isinstance(model, BertForPreTraining):
        raise ValueError(f"pseudo-log-likelihood needs BERT's masked-LM head; this model ({type(model).__name__}) "
                         "has none (load the pretrained model, not a fine-tuned one)")
    raise ValueError(f"scoring needs GPT-2 with its byte-level BPE or BERT with its WordPiece tokenizer; got "
                     f"{type(model).__name__} with {type(tokenizer).__name__}")


def _ids(tokenizer, sentences: list[str], window: int) -> list[list[int]]:
    """Each sentence's token ids (GPT-2: <|endoftext|> first; BERT: [CLS] ... [SEP]), checked: not empty, within
    the window."""
    out = []
    for i, s in enumerate(sentences):
        if not isinstance(s, str) or not s.strip():
            raise ValueError(f"sentence {i} is empty: there is nothing to score")
        ids = [tokenizer.eot_id, *tokenizer.encode(s)] if isinstance(tokenizer, ByteLevelBPE) else tokenizer.encode(s)
        if len(ids) > window:
            raise ValueError(f"sentence {i} is {len(ids)} tokens with its special tokens; the model's window is "
                             f"{window}")
        out.append(ids)
    return out


def _batches(rows: list, tokens: int):
    """Indices of `rows` (sequences) in batches of about `tokens` padded tokens, longest first."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * len(rows[batch[0]]) > tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return idx.to(device), mask.to(device)


def _target_logp(head, h: torch.Tensor, targets: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """log softmax(head(h))[targets] for hidden states h (N, C), the output layer run on `rows` rows at a time: a
    vocabulary's logits for every position at once would not stay in the CPU's cache (50,257 x 4 bytes a row)."""
    out = []
    for i in range(0, len(h), rows):
        logp = head(h[i:i + rows]).float().log_softmax(-1)          # faster than logsumexp on the CPU
        out.append(logp.gather(-1, targets[i:i + rows, None])[:, 0])
    return torch.cat(out) if out else h.new_empty(0)


def causal_token_scores(model, rows: list[list[int]], tokens: int = 8192) -> list[list[float]]:
    """Each row (<|endoftext|> t_1 .. t_n) -> [log p(t_i | what precedes it)] for i = 1..n (natural logs)."""
    device = next(model.parameters()).device
    out: list = [None] * len(rows)
    with torch.inference_mode():
        for batch in _batches(rows, tokens):
            idx, mask = _padded([rows[i] for i in batch], device)   # right padding: causal rows never see it
            real = mask[:, 1:].bool()                                 # the positions that predict a real token
            scores = _target_logp(model.head, model.hidden(idx[:, :-1])[real], idx[:, 1:][real])
            for i, s in zip(batch, scores.split(real.sum(1).tolist())):
                out[i] = s.tolist()
    return out


def _copies(ids: list[int], pieces: list[str], pll: str) -> list[tuple[list[int], int]]:
    """The masked copies of [CLS] t_1 .. t_n [SEP]: (the ids with the masked positions as -1, the scored position)."""
    copies = []
    for pos in range(1, len(ids) - 1):
        masked = list(ids)
        masked[pos] = -1
        if pll == "within-word-l2r":
            right = pos + 1
            while right < len(ids) - 1 and pieces[right].startswith("##"):
                masked[right] = -1
                right += 1
        copies.append((masked, pos))
    return copies


def pll_token_scores(model, tokenizer, rows: list[list[int]], pll: str = "original",
                     tokens: int = 8192) -> list[list[float]]:
    """Each row ([CLS] t_1 .. t_n [SEP]) -> [log p(t_i | the row with t_i masked (and, within-word-l2r, the pieces
    of its word to its right))] for i = 1..n: every copy of every row through the encoder in batches, the masked-LM
    head on the scored positions only."""
    if pll not in PLL:
        raise ValueError(f"pll must be one of {PLL}, got {pll!r}")
    device = next(model.parameters()).device
    copies = [(r, c) for r, ids in enumerate(rows) for c in _copies(ids, tokenizer.pieces(ids), pll)]
    scores = torch.empty(len(copies))
    inputs = [[tokenizer.mask_id if t < 0 else t for t in masked] for _, (masked, _) in copies]
    with torch.inference_mode():
        for batch in _batches(inputs, tokens):
            idx, mask = _padded([inputs[k] for k in batch], device)
            hidden, _ = model.bert(idx, attention_mask=mask)
            pos = torch.tensor([copies[k][1][1] for k in batch], device=device)
            target = torch.tensor([rows[copies[k][0]][copies[k][1][1]] for k in batch], device=device)
            scores[batch] = _target_logp(model.mlm, hidden[torch.arange(len(batch), device=device), pos], target).cpu()
    out: list[list[float]] = [[] for _ in rows]
    for (r, _), s in zip(copies, scores.tolist()):
        out[r].append(s)
    return out


def score_sentences(model, tokenizer, sentences: list[str], pll: str = "original", tokens: int = 8192) -> list[dict]:
    """Each sentence -> {"score": its log-likelihood (GPT-2) or pseudo-log-likelihood (BERT, `pll`), in nats,
    "tokens": the scored tokens' pieces, "token_scores": each one's log-probability}. `tokens`: padded tokens a
    forward (the batch's size)."""
    check_scorer(model, tokenizer)
    rows = _ids(tokenizer, list(sentences), model.config.block_size)
    causal = isinstance(model, GPT2)
    per = causal_token_scores(model, rows, tokens) if causal else pll_token_scores(model, tokenizer, rows, pll, tokens)
    return [{"score": sum(s), "tokens": tokenizer.pieces(ids[1:] if causal else ids[1:-1]), "token_scores": s}
            for ids, s in zip(rows, per)]


# --- BLiMP -------------------------------------------------------------------------------------------

def read_blimp(data) -> list[dict]:
    """BLiMP's pairs from a .jsonl file or a folder of them (the BLiMP repository's data/*.jsonl: sentence_good,
    sentence_bad, field, UID)."""
    path = Path(data)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no BLiMP .jsonl files there")
    pairs = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                pairs.append({k: item[k] for k in ("sentence_good", "sentence_bad", "field", "UID")})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{f}:{n}: not a BLiMP pair (sentence_good, sentence_bad, field, UID): {e}") from None
    return pairs


def blimp(model, tokenizer, data, pll: str = "original", tokens: int = 8192, on_progress=None) -> dict:
    """BLiMP's accuracies (percentages) for either family: {"acc", "paradigms": {UID: acc}, "fields": {field: acc},
    "pairs", "protocol", "items": [{UID, good, bad, right}]}. data: a file or folder (read_blimp), or its pairs.
    on_progress(done, total, metrics) after each paradigm."""
    pairs = data if isinstance(data, list) else read_blimp(data)
    by_uid: dict[str, list[dict]] = {}
    for p in pairs:
        by_uid.setdefault(p["UID"], []).append(p)
    items, paradigms, fields = [], {}, {}
    for uid, group in by_uid.items():
        scores = score_sentences(model, tokenizer, [s for p in group for s in (p["sentence_good"], p["sentence_bad"])],
                                 pll, tokens)
        right = [scores[2 * i]["score"] > scores[2 * i + 1]["score"] for i in range(len(group))]
        paradigms[uid] = 100 * sum(right) / len(right)
        fields.setdefault(group[0]["field"], []).append(paradigms[uid])
        items += [{"UID": uid, "good": scores[2 * i]["score"], "bad": scores[2 * i + 1]["score"], "right": r}
                  for i, r in enumerate(right)]
        if on_progress is not None:
            on_progress(len(paradigms), len(by_uid), {"acc": round(statistics.mean(paradigms.values()), 2)})
    how = ("GPT-2 log-likelihood, every token scored, the first after <|endoftext|>" if isinstance(model, GPT2) else
           f"BERT pseudo-log-likelihood ({pll})")
    return {"acc": statistics.mean(paradigms.values()), "paradigms": paradigms,
            "fields": {f: statistics.mean(v) for f, v in fields.items()}, "pairs": len(pairs),
            "protocol": f"BLiMP: a pair right when the acceptable sentence scores higher; {how}; overall = the mean "
                        "of the paradigms' accuracies", "items": items}
