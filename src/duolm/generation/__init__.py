"""Token ids in, token ids out: sampling filters, generate() through a KV cache, its static-shape decode step
(compiled once, a CUDA graph on GPUs), beam search and BERT mask filling.

The prompt is run once (prefill); after that every new token costs one position through the
`KVCache`. Prompts of different lengths are left-padded and masked, and the model counts positions
over real tokens only, so a prompt in a batch gives what it gives alone.

    sampling.py   the filters on logits and next_token()       base.py   checks, padding, the cache
    decode.py     generate() and the Generation it streams     static.py the static-shape step (compile=True)
    beam.py       beam_search() and fill_mask()
"""
from duolm.generation.base import StopReason
from duolm.generation.beam import beam_search, fill_mask
from duolm.generation.decode import Generation, generate
from duolm.generation.sampling import (apply_repetition_penalty, apply_temperature, next_token, top_k_filter,
                                       top_p_filter)

__all__ = ["StopReason", "Generation", "generate", "beam_search", "fill_mask", "next_token", "apply_repetition_penalty",
           "apply_temperature", "top_k_filter", "top_p_filter"]
