"""Every request body the server takes, walked field by field from its published schema (GET /openapi.json): each
field missing (where required), null (where null is not allowed) and of each JSON type it does not allow is a 400
whose `param` is the field (a nested object's field: the top-level field that holds it) and whose message names
it. The fields and their types are read from the schemas, so a new field is covered without a new test; a new
request body needs a valid example in VALID (the test says so)."""
import contextlib

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from pydantic import BaseModel  # noqa: E402

import duolm  # noqa: E402
from duolm.models.bert import BertConfig, BertForPreTraining  # noqa: E402
from duolm.models.heads import HeadConfig, head_model  # noqa: E402
from duolm.serve import ServeConfig, schemas  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# valid bodies of each request schema (one, or a list where nested objects exclude each other), holding every nested
# object the schema can hold
VALID = {
    "CompletionRequest": [
        {"prompt": "hi", "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "hi", "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}}},
        {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"choice": ["a", "b"]}}],
    "TokenizeRequest": {"prompt": "hi"},
    "DetokenizeRequest": {"tokens": [1, 2]},
    "EmbeddingRequest": {"input": "hi"},
    "FillMaskRequest": {"input": "a [MASK] b"},
    "ScoreRequest": {"text_1": "a", "text_2": "b"},
    "RerankRequest": {"query": "a", "documents": ["b", {"text": "c"}]},
    "ClassifyRequest": {"input": "hi"},
    "NERRequest": {"input": "John lives in Paris"},
    "QARequest": {"input": [{"question": "who lives here?", "context": "John lives here."}]},
}
# a value of each JSON type, sent where the field does not allow that type
OF_TYPE = {"string": "5", "integer": 5, "number": 0.5, "boolean": True, "array": ["5"], "object": {"5": 5}, "null": None}


@pytest.fixture(scope="module")
def clients(data_dir):
    """A client of each kind of model that answers some route: GPT-2, BERT (MLM + embeddings), three heads."""
    bpe = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    wp = duolm.WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt")
    cfg = BertConfig(vocab_size=wp.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, n_inner=64)
    torch.manual_seed(0)
    models = [(duolm.GPT2(duolm.GPT2Config(vocab_size=bpe.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32)),
               bpe), (BertForPreTraining(cfg), wp)]
    models += [(head_model("bert", cfg, head), wp) for head in (
        HeadConfig("classify", ["0", "1"], max_length=32), HeadConfig("tag", ["O", "B-X"], max_length=32),
        HeadConfig("span", task="squad", max_length=64))]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(TestClient(create_app(m.eval(), tok, ServeConfig(model_name="m"))))
               for m, tok in models]


def routes(clients) -> dict:
    """{path: (client, its request body's schema name, the published schemas)}: each POST route with a body,
    from the first model that serves it (a route a model cannot answer is left out of its docs)."""
    out = {}
    for c in clients:
        spec = c.get("/openapi.json").json()
        for path, ops in spec["paths"].items():
            body = ops.get("post", {}).get("requestBody")
            if body is not None and path not in out:
                ref = body["content"]["application/json"]["schema"]["$ref"]
                out[path] = (c, ref.rsplit("/", 1)[1], spec["components"]["schemas"])
    return out


def json_types(prop: dict) -> set:
    """The JSON types a property's schema allows ($ref: an object)."""
    if "$ref" in prop:
        return {"object"}
    types = {prop["type"]} if "type" in prop else set()
    for alt in prop.get("anyOf", []):
        types |= json_types(alt)
    return types | ({"integer"} if "number" in types else set())


def refs(prop: dict) -> list[str]:
    """The schemas (by name) a property's value or its items may be."""
    if "$ref" in prop:
        return [prop["$ref"].rsplit("/", 1)[1]]
    alts = prop.get("anyOf", []) + ([prop["items"]] if "items" in prop else [])
    return [r for alt in alts for r in refs(alt)]


def objects(name: str, components: dict, body: dict, where: tuple = ()):
    """(where, schema name, object) for `body` and each object nested in it (the first of a list): `where` is the
    path of keys and indices to it."""
    yield where, name, body
    for field, prop in components[name]["properties"].items():
        value = body.get(field)
        if not refs(prop):                  # a free-form dict (a JSON schema) is a value, not a nested request object
            continue
        found = ([(k, v) for k, v in enumerate(value) if isinstance(v, dict)][:1] if isinstance(value, list)
                 else [(None, value)] if isinstance(value, dict) else [])
        for k, obj in found:
            inner = next(r for r in refs(prop) if set(obj) <= set(components[r]["properties"]))
            yield from objects(inner, components, obj, where + (field,) + (() if k is None else (k,)))


def wrong(schema: dict, field: str) -> set:
    """What to send for `field`: "missing" where it is required, and every JSON type its schema does not allow."""
    return ({"missing"} if field in schema.get("required", ()) else set()) | set(OF_TYPE) - json_types(
        schema["properties"][field])


def with_case(body, where: tuple, field: str, kind: str):
    """A copy of `body` whose `field` at path `where` is left out (kind "missing") or a value of JSON type `kind`."""
    if where:
        out = dict(body) if isinstance(body, dict) else list(body)
        out[where[0]] = with_case(body[where[0]], where[1:], field, kind)
        return out
    out = {k: v for k, v in body.items() if k != field}
    return out if kind == "missing" else {**out, field: OF_TYPE[kind]}


def test_every_field_of_every_request_is_named_when_wrong(clients):
    walked = set()
    for path, (client, schema, components) in routes(clients).items():
        assert schema in VALID, f"{path} takes a {schema}: add a valid body for it to VALID"
        for body in VALID[schema] if isinstance(VALID[schema], list) else [VALID[schema]]:
            assert client.post(path, json=body).status_code == 200, (path, body)
            for where, name, obj in objects(schema, components, body):
                walked.add(name)
                for field in components[name]["properties"]:
                    top = where[0] if where else field
                    for kind in wrong(components[name], field):
                        r = client.post(path, json=with_case(body, where, field, kind))
                        err = r.json()["error"]
                        assert r.status_code == 400 and err["param"] == top, (path, where, field, kind, r.text)
                        assert err["message"].startswith(top) and field in err["message"], (path, field, kind, err)
    models = {c.__name__ for c in vars(schemas).values()
              if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == schemas.__name__
              and not c.__name__.startswith("_")}
    assert walked == models, "a request schema or a nested object that no route was walked with"
