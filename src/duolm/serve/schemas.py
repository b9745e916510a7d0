"""Request bodies, validated by pydantic: OpenAI's field names and ranges, strict types (no "5" for
5), unknown fields refused. A failure becomes a 400 that names the field (see app.py)."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

Float = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[Float, Field(ge=-2, le=2)]
Ids = list[int]
# OpenAI's prompt / input shapes: a string, a list of strings, token ids, a list of token-id lists
Texts = Union[str, list[str], Ids, list[Ids]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    user: str | None = None          # accepted, unused (OpenAI's end-user id)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JSONSchema(_Shape):
    """OpenAI's response_format.json_schema."""
    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Shape):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StructuredOutputs(_Shape):
    """vLLM's structured_outputs (its StructuredOutputsParams), the constraints duolm runs: one of them."""
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    regex: str | None = None
    json_: dict | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None


class CompletionRequest(_Request):
    prompt: Texts
    max_tokens: Annotated[int, Field(ge=0)] | None = None                 # None: 16
    temperature: Annotated[Float, Field(ge=0)] | None = None              # None: 1
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None              # None: 1
    top_k: Annotated[int, Field(ge=1)] | None = None                      # extension
    # OpenAI allows 4 stop strings; lm-evaluation-harness's tasks send up to 6 (their own and the end-of-text)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2 ** 63)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None                      # None: 0
    frequency_penalty: Penalty | None = None                     # None: 0
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None     # token id -> bias
    # OpenAI's fields that duolm accepts only with their neutral value (completions.check_neutral)
    best_of: Annotated[int, Field(ge=1)] | None = None           # = n
    suffix: str | None = None                                    # "": GPT-2 does not insert text
    # extension: special tokens spelled in the prompt that become special ids (else they are text)
    allowed_special: Literal["all"] | list[str] = []
    # structured output (serve/structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_regex: str | None = None
    guided_json: dict | bool | str | None = None
    structured_outputs: StructuredOutputs | None = None


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize (the completion form)."""
    prompt: str
    add_special_tokens: bool = True          # BERT: [CLS] ... [SEP] around the pieces; GPT-2 adds none
    return_token_strs: bool = False
    allowed_special: Literal["all"] | list[str] = []        # GPT-2, as in CompletionRequest


class DetokenizeRequest(_Request):
    tokens: Ids


class EmbeddingRequest(_Request):
    input: Texts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    # vLLM's: cut each input to this many tokens ([CLS] ... [SEP]); -1: to the model's limit; None: refuse longer
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class FillMaskRequest(_Request):
    input: str | Annotated[list[str], Field(min_length=1, max_length=256)]
    top_k: Annotated[int, Field(ge=1, le=100)] = 5


MAX_INPUTS = 2048        # inputs in one request (OpenAI's limit for embeddings)
# fine-tuned heads' inputs: a question or a context must hold more than blanks
Text = Annotated[str, Field(pattern=r"\S")]
Pair = Annotated[list[str], Field(min_length=2, max_length=2)]


def _many(item):
    return Annotated[list[item], Field(min_length=1, max_length=MAX_INPUTS)]


class ClassifyRequest(_Request):
    """A text, or a list of texts and [text, text] pairs."""
    input: str | _many(Union[str, Pair])

    def inputs(self) -> list:
        """What predict() takes: texts and (text, text) pairs."""
        inputs = [self.input] if isinstance(self.input, str) else self.input
        return [x if isinstance(x, str) else tuple(x) for x in inputs]


class ScoreRequest(_Request):
    """vLLM's POST /v1/score: text_1 scored against text_2, or against each text of a list."""
    text_1: str
    text_2: str | _many(str)
    # vLLM's: -1 cuts each input to the model's limit (a pair: the longer text first); None refuses longer inputs
    truncate_prompt_tokens: Literal[-1] | None = None


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str


class RerankRequest(_Request):
    """Jina's and Cohere's rerank, as vLLM serves it: the documents (texts, or {"text"} objects) ranked by
    relevance to the query."""
    query: str
    documents: _many(Union[str, Document])
    top_n: Annotated[int, Field(ge=0)] | None = None              # None or 0 (vLLM's): every document
    return_documents: bool = True
    truncate_prompt_tokens: Literal[-1] | None = None             # as in ScoreRequest

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class NERRequest(_Request):
    input: str | _many(str)

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class Question(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    question: Text
    context: Text


class QARequest(_Request):
    """{"question", "context"} for one question, or {"input": [{"question", "context"}, ...]}."""
    question: Text | None = None
    context: Text | None = None
    input: _many(Question) | None = None

    @model_validator(mode="after")
    def _one_form(self):
        one = self.question is not None and self.context is not None
        if one == (self.input is not None) or (self.input is not None and (self.question or self.context)):
            raise ValueError("give question and context, or input: a list of {question, context} (not both)")
        return self

    def inputs(self) -> list[tuple[str, str]]:
        items = self.input or [self]
        return [(q.question, q.context) for q in items]


class APIError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
