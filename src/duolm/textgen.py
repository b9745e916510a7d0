"""Text in, text out, over duolm.generation's ids: UTF-8-safe streaming with stop strings (TextStream),
generate_text for GPT-2 and fill_mask_text for BERT, each with its model's tokenizer."""
from __future__ import annotations

import codecs

import torch

from duolm.generation import StopReason, beam_search, fill_mask, generate
from duolm.generation.grammar import Grammar, Vocabulary
from duolm.models import GPT2, BertForPreTraining
from duolm.tokenizers import ByteLevelBPE, WordPiece


def fill_mask_text(model, tokenizer, text: str, top_k: int = 5) -> tuple[list, str]:
    """fill_mask on text: `text` holds one or more "[MASK]" (typed by the user, so the WordPiece
    tokenizer keeps it as the mask token). -> ([[(piece, probability), ...] per mask], the text with
    every mask replaced by its most likely piece)."""
    if not isinstance(model, BertForPreTraining):
        raise ValueError(f"fill-mask needs a BERT model with its masked-LM head, got {type(model).__name__} "
                         f"(BertForPreTraining, or HF BertForMaskedLM / BertForPreTraining)")
    if not isinstance(tokenizer, WordPiece):
        raise ValueError("fill-mask needs the model's WordPiece tokenizer (vocab.txt)")
    ids = tokenizer.encode(text)
    if tokenizer.mask_id not in ids:
        raise ValueError('the text has no [MASK]; write [MASK] where a word should go, '
                         'e.g. "The capital of France is [MASK]."')
    results = fill_mask(model, ids, tokenizer.mask_id, top_k=top_k)
    best = list(ids)
    for fillers in results:
        best[best.index(tokenizer.mask_id)] = fillers[0][0]
    return ([[(tokenizer.inv[i], p) for i, p in fillers] for fillers in results],
            tokenizer.decode(best, skip_special=True))



# ---------------------------------------------------------------------------------------------
# Text out: UTF-8-safe streaming with stop strings (bytes in, printable str out)

class TextStream:
    """Turns the bytes of generated tokens into text that is safe to print as it comes: a
    multi-byte character split across tokens is held back until complete, and text that could be
    the beginning of a stop string is held back until it is known not to be one.
    feed(bytes) -> str to print now; `stopped` becomes True once a stop string appeared (the
    returned text then ends right before it); finish() -> the rest (on a normal end)."""

    def __init__(self, stop_strings=()):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stop_strings if s]
        self._hold = ""           # decoded, not yet printed
        self.stopped = False

    def feed(self, data: bytes) -> str:
        if self.stopped:
            return ""
        self._hold += self._dec.decode(data)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._hold += self._dec.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._hold
        if not self._stops:
            self._hold = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._hold = ""
            return text[:cut]
        keep = 0
        if not final:   # longest suffix of text that is a proper prefix of some stop string
            for s in self._stops:
                for n in range(min(len(s) - 1, len(text)), keep, -1):
                    if s.startswith(text[-n:]):
                        keep = n
                        break
        self._hold = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


# ---------------------------------------------------------------------------------------------
# Text in, text out

class TextGeneration:
    """What generate_text returns: iterate it for the continuation's text, piece by piece as it is
    produced (UTF-8 safe, stop strings cut). After iteration, `stop_reason` is a StopReason (or "stop"
    for a stop string); `prompt_ids` are the ids the model saw; `truncated_from` is the prompt's
    original length in tokens when truncation="left" cut it (else None)."""

    def __init__(self, pieces, prompt_ids, truncated_from):
        self._pieces, self.prompt_ids, self.truncated_from = pieces, prompt_ids, truncated_from
        self.stop_reason = None

    def __iter__(self):
        yield from self._pieces(self)


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 100, *, temperature: float = 1.0,
                  top_k=None, top_p=None, repetition_penalty: float = 1.0, num_beams: int = 1,
                  length_penalty: float = 1.0, stop=(), seed=None, truncation: str = "none",
                  allow_special: bool = False, compile: bool = False, grammar: Grammar | None = None) -> TextGeneration:
    """Continue `prompt` with a GPT-2 model and its byte-level BPE tokenizer; text in, text out.

    The prompt is text: special tokens typed in it (e.g. "<|endoftext|>") stay text unless
    `allow_special`. An empty prompt starts from <|endoftext|>, as GPT-2's unconditional samples do.
    truncation="left" drops the oldest prompt tokens so prompt + max_new_tokens fit the context window
    ("none": a prompt longer than the window is an error). Generation stops at <|endoftext|> (not
    shown), a `stop` string (cut before it), max_new_tokens or a full window. num_beams > 1: beam
    search (deterministic; the text comes in one piece). seed: reproducible sampling (None: fresh).
    Faster CPU decoding, same numbers: a model swapped by duolm.precision.quantize(model, "fp32").
    compile: the static-shape decode step (duolm.generation.generate's compile=True).
    grammar: structured output (duolm.generation.grammar.Grammar: a choice of strings, a regex, a JSON schema): every
    token drawn keeps the text one the grammar allows, and generation stops (StopReason.STOP) once it is complete."""
    if not isinstance(model, GPT2):
        raise ValueError(f"generate_text needs a GPT-2 model, got {type(model).__name__} (for BERT use fill_mask)")
    if not isinstance(tokenizer, ByteLevelBPE):
        raise ValueError("generate_text needs the model's byte-level BPE tokenizer (vocab.json + merges.txt)")
    if truncation not in ("none", "left"):
        raise ValueError(f"truncation={truncation!r} must be 'none' or 'left'")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0 or num_beams < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0 and num_beams ({num_beams}) >= 1")
    eot = tokenizer.eot_id
    ids = tokenizer.encode(prompt, allowed_special="all" if allow_special else set(), disallowed_special=())
    if not ids:
        if eot is None:
            raise ValueError("the prompt is empty and the tokenizer has no <|endoftext|> to start from")
        ids = [eot]
    window, truncated_from = model.config.block_size, None
    room = max(1, window - max_new_tokens + 1)           # prompt + new tokens fit the window
    if truncation == "left" and len(ids) > room:
        truncated_from, ids = len(ids), ids[-room:]
    elif len(ids) > window:
        raise ValueError(f"the prompt is {len(ids)} tokens but the model's context window is {window}; "
                         f"shorten it or truncate it on the left")
    stop_ids = [[eot]] if eot is not None else []
    if grammar is not None and num_beams > 1:
        raise ValueError("a grammar constrains sampling, not beam search: use num_beams=1")
    constraints = None if grammar is None else [Vocabulary.of(tokenizer, model.config.vocab_size).constraint(grammar)]

    def pieces(result):
        stream = TextStream(list(stop))
        if num_beams > 1:
            new = beam_search(model, [ids], max_new_tokens, num_beams, length_penalty=length_penalty,
                              stop=stop_ids)[0]
            yield stream.feed(tokenizer.decode_bytes(new[:-1] if new and new[-1] == eot else new))
            result.stop_reason = StopReason.STOP if new and new[-1] == eot else StopReason.MAX_NEW_TOKENS
        else:
            g = torch.Generator(device=next(model.parameters()).device)
            g.seed() if seed is None else g.manual_seed(seed)
            gen = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           repetition_penalty=repetition_penalty, stop=stop_ids, generator=g, compile=compile,
                           constraints=constraints)
            for (t,) in gen:
                if t is not None and t != eot:
                    yield stream.feed(tokenizer.decode_bytes([t]))   # holds back split characters
                    if stream.stopped:
                        break
            result.stop_reason = gen.stop_reasons[0]
        yield stream.finish()
        if stream.stopped:
            result.stop_reason = StopReason.STOP

    return TextGeneration(pieces, ids, truncated_from)
