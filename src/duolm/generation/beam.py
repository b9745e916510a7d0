"""Beam search (transformers' bookkeeping, the same ids) and BERT's mask filling."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from duolm.generation.base import check_prompts, check_stop, device_dtype, last_logits, left_pad, new_cache
from duolm.models import BertForPreTraining

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
    check_prompts(model, prompts, max_new_tokens)
    stop = check_stop(stop, model.config.vocab_size)
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
    device, dtype = device_dtype(model)
    idx, mask = left_pad(prompts, device)
    idx = idx.repeat_interleave(K, 0)
    if mask is not None:
        full = torch.ones(B * K, P + n_steps - 1, dtype=torch.long, device=device)
        full[:, :P] = mask.repeat_interleave(K, 0)
    cache = new_cache(model, B * K, P + n_steps - 1, device, dtype)
    logits = last_logits(model, idx, mask if mask is None else full[:, :P], cache)

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
        logits = last_logits(model, run_seq[:, :, t].reshape(B * K, 1), m, cache)
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
