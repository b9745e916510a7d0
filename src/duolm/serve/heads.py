"""A fine-tuned head's route, the one its task names (Task.route): POST /v1/classify (classify, regress),
POST /v1/ner (tag), POST /v1/qa (span). Each answers what the library's predict() answers (the
function `duolm predict` runs), its requests batched by the encoders.EncoderWorker like BERT's."""
from __future__ import annotations

from fastapi import APIRouter

from duolm.serve.bert import run_batch
from duolm.serve.deps import Served
from duolm.serve.schemas import ClassifyRequest, NERRequest, QARequest
from duolm.tasks import head_task, predict


def router(s: Served) -> APIRouter:
    """The three routes; each but the served head's own answers 400 (as on a model without a head)."""
    r = APIRouter()
    served = None if s.head is None else head_task(s.head).route

    def predict_fn(items):
        return predict(s.model, s.tokenizer, items)

    async def predictions(model: str | None, items: list) -> dict:
        s.check_model(model)
        _, results = await run_batch(s, predict_fn, lambda: items)
        return {"object": "list", "model": s.name, "data": [{"index": i, **r} for i, r in enumerate(results)]}

    @r.post("/v1/classify", **s.model_route(served == "/v1/classify", "a fine-tuned classifier or regressor"))
    async def classify(body: ClassifyRequest):
        """A label and the probabilities of all labels (classify), or a score (regress), per text or pair."""
        return await predictions(body.model, body.inputs())

    @r.post("/v1/ner", **s.model_route(served == "/v1/ner", "a fine-tuned token tagger"))
    async def ner(body: NERRequest):
        """The entities of each text: type, text, start, end, score."""
        return await predictions(body.model, body.inputs())

    @r.post("/v1/qa", **s.model_route(served == "/v1/qa", "a fine-tuned question answerer (span head)"))
    async def qa(body: QARequest):
        """The answer span of each question in its context: answer, start, end, score."""
        return await predictions(body.model, body.inputs())
    return r
