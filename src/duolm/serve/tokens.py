"""The tokenizer's routes, in vLLM's shapes (what lm-evaluation-harness's `local-completions` probes to
tokenize on the server): POST /tokenize, POST /detokenize, GET /tokenizer_info.

Special tokens follow the served model's rules, as on its other routes: GPT-2's `<|endoftext|>` typed in a
text is text unless the request lists it in `allowed_special`; BERT's tokenizer reads [CLS], [SEP], [MASK]
typed in a text as those tokens (as HF's and sentence-transformers' do)."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from duolm.checkpoint import hf_tokenizer_config
from duolm.serve.completions import encode_text
from duolm.serve.deps import Served
from duolm.serve.schemas import APIError, DetokenizeRequest, TokenizeRequest


def router(s: Served) -> APIRouter:
    r = APIRouter()
    tok = s.tokenizer

    def ids_of(body: TokenizeRequest) -> list:
        if s.family == "gpt2":          # the request's allowed_special: GPT-2's rule for typed special tokens
            return encode_text(tok, body.prompt, body.allowed_special)
        if body.allowed_special:
            raise APIError(400, "allowed_special: BERT's tokenizer reads [CLS], [SEP], [MASK] typed in a text as "
                                "those tokens already", "allowed_special")
        ids = tok.encode(body.prompt)
        return ids if body.add_special_tokens else ids[1:-1]

    @r.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The ids of a text, as the model's other routes encode it: {"count", "max_model_len", "tokens",
        "token_strs" (with return_token_strs)}."""
        s.check_model(body.model)
        ids = await run_in_threadpool(ids_of, body)
        return {"count": len(ids), "max_model_len": s.model.config.block_size, "tokens": ids,
                "token_strs": tok.pieces(ids) if body.return_token_strs else None}

    @r.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """The text of ids: {"prompt"} (special tokens included, as HF's decode gives them)."""
        s.check_model(body.model)
        try:
            text = tok.decode(body.tokens)
        except ValueError as e:         # an id outside the vocabulary
            raise APIError(400, f"tokens: {e}", "tokens") from None
        return {"prompt": text}

    @r.get("/tokenizer_info")
    async def tokenizer_info():
        """The tokenizer_config.json of the model's Hugging Face export (duolm convert --to hf), and HF's map
        of the special tokens' ids, added_tokens_decoder."""
        specials = {str(i): {"content": t, "special": True} for t, i in tok.special_tokens.items()}
        return {**hf_tokenizer_config(tok, s.model.config.block_size), "added_tokens_decoder": specials}
    return r
