"""A fine-tuned head's route, the one its kind answers: POST /v1/classify (classify, regress),
POST /v1/ner (tag), POST /v1/qa (span). Each answers what the library's predict() answers (the
function `duolm predict` runs), its requests batched by the encoders.EncoderWorker like BERT's."""
from __future__ import annotations

from fastapi import APIRouter

from duolm.serve.bert import run_batch
from duolm.serve.deps import Served
from duolm.serve.schemas import ClassifyRequest, NERRequest, QARequest
from duolm.tasks import predict


def router(s: Served) -> APIRouter:
    """The three routes; each but the served head's own answers 400 (as on a model without a head)."""
    r = APIRouter()
    kind = None if s.head is None else s.head.kind

    def predict_fn(items):
        return predict(s.model, s.tokenizer, items)

    async def predictions(model: str | None, items: list) -> list:
        s.check_model(model)
        _, results = await run_batch(s, predict_fn, lambda: items)
        return results

    @r.post("/v1/classify", **s.model_route(kind in ("classify", "regress"), "a fine-tuned classifier or regressor"))
    async def classify(body: ClassifyRequest):
        """A label and the probabilities of all labels (classify), or a score (regress), per text or pair."""
        inputs = [body.input] if isinstance(body.input, str) else body.input
        texts = [x if isinstance(x, str) else tuple(x) for x in inputs]
        data = [{"index": i, **r} for i, r in enumerate(await predictions(body.model, texts))]
        return {"object": "list", "model": s.name, "data": data}

    @r.post("/v1/ner", **s.model_route(kind == "tag", "a fine-tuned token tagger"))
    async def ner(body: NERRequest):
        """The entities of each text: type, text, start, end, score."""
        texts = [body.input] if isinstance(body.input, str) else body.input
        data = [{"index": i, "entities": r} for i, r in enumerate(await predictions(body.model, texts))]
        return {"object": "list", "model": s.name, "data": data}

    @r.post("/v1/qa", **s.model_route(kind == "span", "a fine-tuned question answerer (span head)"))
    async def qa(body: QARequest):
        """The answer span of each question in its context: answer, start, end, score."""
        data = [{"index": i, **r} for i, r in enumerate(await predictions(body.model, body.pairs()))]
        return {"object": "list", "model": s.name, "data": data}
    return r
