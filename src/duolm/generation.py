"""Token ids in, token ids out: sampling filters, generate() through a KV cache, beam search and
BERT mask filling.

The prompt is run once (prefill); after that every new token costs one position through the
`KVCache`. Prompts of different lengths are left-padded and masked, and the model counts positions
over real tokens only, so a prompt in a batch gives what it gives alone.

Sampling is the composition of small pure functions on logits (B, V), applied in the order
`transformers` uses: repetition penalty, temperature, top-k, top-p, then a draw from the softmax.
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from duolm.models import BertForPreTraining


# ---------------------------------------------------------------------------------------------
# Sampling filters: pure functions, logits (B, V) -> logits (B, V); removed tokens become -inf

def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL (Keskar et al., 2019): make tokens already in the text less likely. A seen token's logit
    is divided by `penalty` when positive and multiplied by it when negative, so `penalty > 1`
    always lowers it. `seen` is a bool mask (B, V) of the ids present in prompt + generated text."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T): T < 1 sharpens, T > 1 flattens. T = 0 means greedy (handled by the caller)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 here (0 means greedy: take the argmax)")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept, as in transformers)."""
    if k < 1:
        raise ValueError(f"top_k={k} must be >= 1")
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al., 2019): keep the smallest set of most likely tokens whose
    probabilities sum to at least p (always at least the most likely one). Same rule as
    transformers: sorted ascending, drop the tokens whose cumulative probability is <= 1 - p."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={p} must be in (0, 1]")
    if p == 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1.0 - p)
    drop_sorted[..., -1] = False                     # the most likely token always stays
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> ids (B,): argmax when temperature == 0, else a draw from the filtered
    softmax (with `generator`, so a seed makes it reproducible)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------------------------
# Shared plumbing

class StopReason(str, Enum):
    """Why a prompt stopped producing tokens."""
    STOP = "stop"                   # it produced one of the stop sequences (included in the output)
    MAX_NEW_TOKENS = "max_new_tokens"
    CONTEXT = "context"             # the context window (block_size) is full


def _check_prompts(model, prompts, max_new_tokens):
    cfg = model.config
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ValueError(f"prompt {i} is empty or not a list of token ids; every prompt needs >= 1 token")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"prompt {i}: token ids must be in [0, {cfg.vocab_size}); got min {lo}, max {hi}")
        if len(p) > cfg.block_size:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the context window is block_size="
                             f"{cfg.block_size}; truncate it (keep the last tokens: "
                             f"prompt[-{cfg.block_size}:], or `duolm generate --truncate left`)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")


def _check_stop(stop, vocab_size):
    stop = [list(s) for s in (stop or [])]
    for s in stop:
        if not s or min(s) < 0 or max(s) >= vocab_size:
            raise ValueError(f"stop sequence {s} must be a non-empty list of ids in [0, {vocab_size})")
    return stop


def _left_pad(prompts, device):
    """-> idx (B, P) left-padded with id 0, attention mask (B, P) of 0/1, or None if no padding."""
    P = max(len(p) for p in prompts)
    idx = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        idx[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return idx, (None if bool(mask.all()) else mask)


def _model_device_dtype(model):
    w = model.wte.weight
    return w.device, w.dtype


def _new_cache(model, batch_size, max_len, device, dtype):
    # Imported here so this module stays importable for fill_mask-only use; the cache class is
    # the model's own (duolm.models.gpt2.KVCache).
    from duolm.models.gpt2 import KVCache
    return KVCache(model.config, batch_size, max_len=max_len, device=device, dtype=dtype)


def _last_logits(model, idx, mask, cache):
    """Run idx through the model (writing the cache) and return fp32 logits (B, V) of the last
    position only: the output layer is never applied to the rest of the prompt."""
    h = model.hidden(idx, attention_mask=mask, cache=cache)
    return model.head(h[:, -1]).float()


# ---------------------------------------------------------------------------------------------
# Streaming generation

class Generation:
    """The iterator generate() returns. Each step yields a list with one new id per prompt, or None
    for a prompt that has stopped; iteration ends when every prompt has stopped.
    `stop_reasons[i]` is a StopReason once prompt i has stopped (None while it runs);
    `tokens[i]` is the list of ids prompt i produced so far."""

    def __init__(self, steps, state):
        self._steps = steps
        self._state = state

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._steps)

    @property
    def stop_reasons(self) -> list:
        return list(self._state["reasons"])

    @property
    def tokens(self) -> list:
        return [list(t) for t in self._state["tokens"]]


def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             repetition_penalty=1.0, stop=None, generator=None) -> Generation:
    """Sample (or, with temperature=0, greedily pick) up to `max_new_tokens` ids after each prompt.

    prompts: list of token-id lists, any lengths (left-padded internally). The prompts are
    prefilled once; each step then feeds one position per prompt through a preallocated KVCache.
    stop: list of token-id sequences; a prompt stops right after producing one (its ids included).
    A prompt longer than block_size raises ValueError. When the window fills up (in a batch, the
    longest prompt plus the steps taken reaches block_size + 1) the running prompts stop with
    StopReason.CONTEXT; `Generation.stop_reasons` tells every prompt's reason.
    The model should be in eval mode (dropout off). Runs under torch.inference_mode."""
    _check_prompts(model, prompts, max_new_tokens)
    V = model.config.vocab_size
    stop = _check_stop(stop, V)
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 or None")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0 (1.0 = off)")
    prompts = [list(p) for p in prompts]
    state = {"reasons": [None] * len(prompts), "tokens": [[] for _ in prompts]}
    steps = _generate_steps(model, prompts, max_new_tokens, temperature, top_k, top_p,
                            repetition_penalty, stop, generator, state)
    return Generation(steps, state)


def _generate_steps(model, prompts, max_new_tokens, temperature, top_k, top_p,
                    repetition_penalty, stop, generator, state):
    cfg = model.config
    B, V = len(prompts), cfg.vocab_size
    reasons, tokens = state["reasons"], state["tokens"]
    if max_new_tokens == 0:
        reasons[:] = [StopReason.MAX_NEW_TOKENS] * B
        return
    P = max(len(p) for p in prompts)
    # Step s (0-based) needs the logits after P + s positions; the last step's token is never fed.
    n_steps = min(max_new_tokens, cfg.block_size - P + 1)
    device, dtype = _model_device_dtype(model)
    running = [True] * B
    with torch.inference_mode():
        idx, mask = _left_pad(prompts, device)
        if mask is not None:   # grows by one real column per step; sliced, never reallocated
            full = torch.ones(B, P + n_steps - 1, dtype=torch.long, device=device)
            full[:, :P] = mask
        cache = _new_cache(model, B, P + n_steps - 1, device, dtype)
        seen = None
        if repetition_penalty != 1.0:
            seen = torch.zeros(B, V, dtype=torch.bool, device=device)
            for i, p in enumerate(prompts):
                seen[i, p] = True
        logits = _last_logits(model, idx, mask, cache)
        for s in range(n_steps):
            if seen is not None:
                logits = apply_repetition_penalty(logits, seen, repetition_penalty)
            nxt = next_token(logits, temperature, top_k, top_p, generator)
            ids = nxt.tolist()
            out = []
            for i, t in enumerate(ids):
                if not running[i]:
                    out.append(None)
                    continue
                out.append(t)
                tokens[i].append(t)
                if any(tokens[i][-len(q):] == q for q in stop if len(q) <= len(tokens[i])):
                    running[i] = False
                    reasons[i] = StopReason.STOP
            if s == n_steps - 1:
                last = StopReason.MAX_NEW_TOKENS if n_steps == max_new_tokens else StopReason.CONTEXT
                for i in range(B):
                    if running[i]:
                        running[i] = False
                        reasons[i] = last
            yield out
            if not any(running):
                return
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            m = None if mask is None else full[:, :cache.length + 1]
            logits = _last_logits(model, nxt[:, None], m, cache)


# ---------------------------------------------------------------------------------------------
# Beam search

def beam_search(model, prompts, max_new_tokens, num_beams, length_penalty=1.0, stop=None,
                early_stopping=False) -> list:
    """Keep the `num_beams` best partial continuations (sum of log-probabilities) of each prompt
    and return, per prompt, the ids of the best finished one (stop ids included).

    A beam finishes when it produces a stop sequence or reaches max_new_tokens (or the context
    window); its score is sum_logprob / n_new_tokens ** length_penalty. The bookkeeping is that of
    transformers' beam search (2 * num_beams candidates per step, the same `early_stopping`
    rules: False = stop when no running beam can still beat the worst kept finished one at the
    current length, True = stop once num_beams beams finished, "never" = use the best possible
    length), so the ids equal `transformers` generate(num_beams=..., do_sample=False)."""
    _check_prompts(model, prompts, max_new_tokens)
    stop = _check_stop(stop, model.config.vocab_size)
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams!r} must be an int >= 1")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping={early_stopping!r} must be True, False or 'never'")
    prompts = [list(p) for p in prompts]
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    with torch.inference_mode():
        fin = _beam_steps(model, prompts, max_new_tokens, num_beams, length_penalty, stop, early_stopping)
    return [fin.seq[b, 0, :int(fin.length[b, 0])].tolist() for b in range(len(prompts))]


_NEG = -1.0e9      # the score of what must not be chosen


class _Finished:
    """The K best finished beams of each of B prompts: ids (B, K, n_steps), lengths (B, K), length-normalised
    scores (B, K) and whether each place holds a finished beam yet (done)."""

    def __init__(self, B: int, K: int, n_steps: int, device):
        self.seq = torch.zeros(B, K, n_steps, dtype=torch.long, device=device)
        self.length = torch.zeros(B, K, dtype=torch.long, device=device)
        self.score = torch.full((B, K), _NEG, device=device)
        self.done = torch.zeros(B, K, dtype=torch.bool, device=device)

    def add(self, cand_seq, norm, just, t: int) -> None:
        """Keep the K best of the kept beams and the candidates (B, keep, n_steps) that finish at step t
        (just), scored `norm` (_NEG where they may not enter)."""
        K, n_steps = self.score.shape[1], self.seq.shape[2]
        scores = torch.cat([self.score, norm], 1)
        best = torch.topk(scores, K, dim=-1).indices
        self.seq = torch.gather(torch.cat([self.seq, cand_seq], 1), 1, best[:, :, None].expand(-1, -1, n_steps))
        self.score = torch.gather(scores, 1, best)
        lengths = torch.full_like(just, t + 1, dtype=torch.long)
        self.length = torch.gather(torch.cat([self.length, lengths], 1), 1, best)
        self.done = torch.gather(torch.cat([self.done, just], 1), 1, best)


def _stop_hits(cand_seq, stop, t: int):
    """(B, keep) bool: the candidates whose new ids (B, keep, n_steps), up to step t, end with a stop sequence."""
    hits = torch.zeros(cand_seq.shape[:2], dtype=torch.bool, device=cand_seq.device)
    for q in stop:
        if len(q) <= t + 1:
            tail = cand_seq[:, :, t + 1 - len(q):t + 1]
            hits |= (tail == torch.tensor(q, device=cand_seq.device)).all(-1)
    return hits


def _beam_steps(model, prompts, max_new_tokens, K, length_penalty, stop, early_stopping) -> _Finished:
    """beam_search's decoding loop (checked arguments, under inference_mode) -> the kept finished beams."""
    cfg = model.config
    V, B, P = cfg.vocab_size, len(prompts), max(len(p) for p in prompts)
    n_steps = min(max_new_tokens, cfg.block_size - P + 1)
    keep = max(2, 1 + len(stop)) * K          # enough candidates that K stay alive if K stop
    device, dtype = _model_device_dtype(model)
    idx, mask = _left_pad(prompts, device)
    idx = idx.repeat_interleave(K, 0)
    if mask is not None:
        full = torch.ones(B * K, P + n_steps - 1, dtype=torch.long, device=device)
        full[:, :P] = mask.repeat_interleave(K, 0)
    cache = _new_cache(model, B * K, P + n_steps - 1, device, dtype)
    logits = _last_logits(model, idx, mask if mask is None else full[:, :P], cache)

    run_seq = torch.zeros(B, K, n_steps, dtype=torch.long, device=device)
    run_score = torch.full((B, K), _NEG, device=device)
    run_score[:, 0] = 0.0                  # only beam 0 is live at first (all K are the same)
    fin = _Finished(B, K, n_steps, device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    top_k_mask = torch.arange(keep, device=device) < K
    batch_off = (torch.arange(B, device=device) * K)[:, None]
    for t in range(n_steps):
        logp = F.log_softmax(logits, dim=-1).view(B, K, V) + run_score[:, :, None]
        cand_score, flat = torch.topk(logp.view(B, K * V), keep, dim=-1)      # (B, keep)
        cand_beam, cand_tok = flat // V, flat % V
        cand_seq = torch.gather(run_seq, 1, cand_beam[:, :, None].expand(-1, -1, n_steps)).clone()
        cand_seq[:, :, t] = cand_tok
        hits = _stop_hits(cand_seq, stop, t)
        if t == n_steps - 1:
            hits[:] = True
        # the K best candidates that did not finish continue
        alive_score = cand_score + hits.float() * _NEG
        nxt = torch.topk(alive_score, K, dim=-1).indices
        run_seq = torch.gather(cand_seq, 1, nxt[:, :, None].expand(-1, -1, n_steps))
        run_score = torch.gather(alive_score, 1, nxt)
        src_beam = torch.gather(cand_beam, 1, nxt)
        # finished candidates among the top K enter the kept finished set if they score better
        just = hits & top_k_mask[None, :]
        norm = cand_score / float(t + 1) ** length_penalty
        if early_stopping is True:
            norm = norm + (fin.done.all(-1, keepdim=True)).float() * _NEG
        fin.add(cand_seq, norm + (~improvable).float() * _NEG + (~just).float() * _NEG, just, t)
        # can a running beam still beat the worst kept finished one?
        L = n_steps if (early_stopping == "never" and length_penalty > 0) else t + 1
        best_running = run_score[:, :1] / float(L) ** length_penalty
        worst_fin = torch.where(fin.done, fin.score.min(-1, keepdim=True).values, torch.full_like(fin.score, _NEG))
        improvable = improvable & (best_running > worst_fin).any(-1, keepdim=True)
        all_full = bool(fin.done.all()) and early_stopping is True
        if t == n_steps - 1 or not bool(improvable.any()) or all_full or bool(hits.all()):
            break
        cache.reorder((batch_off + src_beam).view(-1))
        m = None if mask is None else full[:, :cache.length + 1]
        logits = _last_logits(model, run_seq[:, :, t].reshape(B * K, 1), m, cache)
    return fin


# ---------------------------------------------------------------------------------------------
# BERT: fill [MASK]

def fill_mask(model, ids, mask_id, top_k=5, segment_ids=None) -> list:
    """ids: one sequence of token ids (already with [CLS] ... [SEP]) holding one or more `mask_id`.
    Returns, for each mask in order of position, the top_k (id, probability) pairs of the MLM head,
    most likely first. Each mask is predicted independently from the same input (one pass)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("ids must be a non-empty list of token ids")
    positions = [i for i, t in enumerate(ids) if t == mask_id]
    if not positions:
        raise ValueError(f"no mask token (id {mask_id}) in the {len(ids)} input ids; put [MASK] where a word should go")
    V = model.config.vocab_size
    if not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {V}]")
    if not isinstance(model, BertForPreTraining):
        raise ValueError("fill_mask needs a BERT model with its masked-LM head (BertForPreTraining)")
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(f"token ids must be in [0, {V}); got min {min(ids)}, max {max(ids)}")
    if len(ids) > model.config.block_size:
        raise ValueError(f"the input is {len(ids)} tokens but the model's context window is "
                         f"{model.config.block_size}; shorten it")
    if segment_ids is not None and (len(segment_ids) != len(ids) or
                                    not set(segment_ids) <= set(range(model.config.type_vocab_size))):
        raise ValueError(f"segment_ids must be {len(ids)} ids in [0, {model.config.type_vocab_size})")
    device = next(model.parameters()).device
    with torch.inference_mode():
        idx = torch.tensor([list(ids)], dtype=torch.long, device=device)
        seg = None if segment_ids is None else torch.tensor([list(segment_ids)], dtype=torch.long, device=device)
        hidden, _ = model.bert(idx, segment_ids=seg)
        logits = model.mlm(hidden[0, positions]).float()                 # (n_masks, V): masks only
        probs, top = logits.softmax(-1).topk(top_k, dim=-1)
    return [list(zip(t.tolist(), p.tolist())) for t, p in zip(top, probs)]
