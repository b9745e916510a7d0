"""duolm serve's routes for fine-tuned models (/v1/classify, /v1/ner, /v1/qa) in-process through FastAPI's
TestClient: each answers what the library's predict() (the one `duolm predict` runs) answers for the same
saved model and inputs, exists only for its head kind, and names the field of a bad body.

The models are tiny heads with random weights on a tiny BERT (GPT-2 for the GPT classifier) with the real
vocabularies, saved with duolm.checkpoint.save and loaded back with load_finetuned, as `duolm serve` does."""
import threading

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import duolm  # noqa: E402
from duolm.checkpoint import save  # noqa: E402
from duolm.models import GPT2Config  # noqa: E402
from duolm.models.bert import BertConfig  # noqa: E402
from duolm.models.heads import HeadConfig, head_model  # noqa: E402
from duolm.serve import ServeConfig  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402
from duolm.tasks import load_finetuned, predict  # noqa: E402

HEADS = {"classify": HeadConfig("classify", ["negative", "positive", "neutral"], task="mine", max_length=16),
         "regress": HeadConfig("regress", task="stsb", max_length=32),
         "tag": HeadConfig("tag", ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"], task="ner", max_length=32),
         "span": HeadConfig("span", task="squad", max_length=96)}
TEXTS = ["the movie was great", "", "John Smith lives in Paris and works in New York for Mary Jones"]
CONTEXT = " ".join(f"In {1900 + i} the city of Paris had {i * 1000} houses and {i} bridges." for i in range(20))


pytestmark = pytest.mark.usefixtures("one_thread")      # tiny models: one thread is faster on a shared CPU


@pytest.fixture(scope="module")
def bert_tok(data_dir):
    return duolm.WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt")


def _sharpen(model):
    """Weights N(0, 0.3): outputs far from uniform, so argmaxes differ between tokens and inputs."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.fixture(scope="module")
def saved(bert_tok, tmp_path_factory):
    """{kind: (model, tokenizer)} loaded back from a saved directory, as `duolm serve` loads it."""
    cfg = BertConfig(vocab_size=bert_tok.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=32, n_inner=64)
    out = {}
    for kind, head in HEADS.items():
        d = save(_sharpen(head_model("bert", cfg, head)), tmp_path_factory.mktemp("heads") / kind, tokenizer=bert_tok)
        out[kind] = load_finetuned(d)
    return out


def _client(model, tok):
    return TestClient(create_app(model, tok, ServeConfig(model_name="tiny", batch_window_s=0.02)))


@pytest.fixture(scope="module")
def clients(saved):
    cs = {kind: _client(*mt) for kind, mt in saved.items()}
    for c in cs.values():
        c.__enter__()
    yield cs
    for c in cs.values():
        c.__exit__(None, None, None)


def _data(r):
    assert r.status_code == 200, r.text
    out = r.json()
    assert [d.pop("index") for d in out["data"]] == list(range(len(out["data"])))
    return out["data"]


def test_classify_equals_predict(clients, saved):
    model, tok = saved["classify"]
    inputs = [*TEXTS, ["a man is playing", "someone plays a guitar"], "word " * 40]
    got = _data(clients["classify"].post("/v1/classify", json={"input": inputs, "model": "tiny"}))
    want = predict(model, tok, [x if isinstance(x, str) else tuple(x) for x in inputs])
    assert got == want
    assert want[-1]["truncated"] and len({str(w["probabilities"]) for w in want}) == len(want)   # all differ
    assert _data(clients["classify"].post("/v1/classify", json={"input": TEXTS[0]})) == predict(model, tok, TEXTS[:1])
    card = clients["classify"].get("/v1/models").json()["data"][0]
    assert card["head"] == {"kind": "classify", "labels": ["negative", "positive", "neutral"], "task": "mine",
                            "max_length": 16}


def test_regress_gives_the_score(clients, saved):
    model, tok = saved["regress"]
    pairs = [["a cat sits", "a cat is sitting"], ["stocks fell", "the sun rose"]]
    got = _data(clients["regress"].post("/v1/classify", json={"input": pairs}))
    assert got == predict(model, tok, [tuple(p) for p in pairs])
    assert all(set(g) == {"score"} for g in got) and got[0] != got[1]


def test_ner_equals_predict(clients, saved):
    model, tok = saved["tag"]
    want = predict(model, tok, TEXTS)
    got = [d["entities"] for d in _data(clients["tag"].post("/v1/ner", json={"input": TEXTS}))]
    assert got == [w["entities"] for w in want]
    assert got[0] and got[2] and got[1] == []                      # random tags: entities to compare
    for text, ents in zip(TEXTS, got):
        assert all(text[e["start"]:e["end"]] == e["text"] for e in ents)
    one = _data(clients["tag"].post("/v1/ner", json={"input": TEXTS[2]}))
    assert one == predict(model, tok, TEXTS[2:])
    assert clients["tag"].get("/v1/models").json()["data"][0]["head"]["labels"] == HEADS["tag"].labels


def test_qa_equals_predict_through_windows(clients, saved):
    model, tok = saved["span"]
    questions = [("how many bridges did paris have?", CONTEXT), ("who lives here?", "Mary lives here with Tom.")]
    assert len(tok.encode(CONTEXT)) > 2 * HEADS["span"].max_length       # several windows
    want = predict(model, tok, questions)
    body = {"input": [{"question": q, "context": c} for q, c in questions]}
    assert _data(clients["span"].post("/v1/qa", json=body)) == want
    one = {"question": questions[0][0], "context": CONTEXT}
    assert _data(clients["span"].post("/v1/qa", json=one)) == predict(model, tok, questions[:1])
    assert CONTEXT[want[0]["start"]:want[0]["end"]] == want[0]["answer"]


def test_concurrent_requests_batch_to_the_same_answers(clients, saved):
    model, tok = saved["classify"]
    inputs = [[f"sentence number {i} " * (1 + i % 5)] for i in range(8)]
    got = [None] * len(inputs)

    def ask(i):
        got[i] = _data(clients["classify"].post("/v1/classify", json={"input": inputs[i]}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, x in zip(got, inputs):                  # padded with other requests' inputs == alone
        (want,) = predict(model, tok, x)
        assert g[0]["label"] == want["label"]
        assert g[0]["probabilities"] == pytest.approx(want["probabilities"], abs=1e-6)


@pytest.mark.parametrize("kind,route,body", [
    ("tag", "/v1/classify", {"input": "a"}), ("span", "/v1/classify", {"input": "a"}),
    ("classify", "/v1/ner", {"input": "a"}), ("regress", "/v1/ner", {"input": "a"}),
    ("tag", "/v1/qa", {"question": "q", "context": "c"}), ("classify", "/v1/fill-mask", {"input": "a [MASK]"}),
    ("span", "/v1/completions", {"prompt": "a"})])
def test_a_route_of_another_head_is_400_naming_the_model(clients, kind, route, body):
    r = clients[kind].post(route, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "model_family_mismatch"
    assert f"a fine-tuned {kind} head" in err["message"] and route in err["message"]
    assert clients[kind].get("/health").json() == {"status": "ok"}


def test_the_docs_list_the_heads_own_route_only(clients):
    routes = {"classify": "/v1/classify", "regress": "/v1/classify", "tag": "/v1/ner", "span": "/v1/qa"}
    for kind, c in clients.items():
        paths = set(c.get("/openapi.json").json()["paths"])
        assert paths & set(routes.values()) == {routes[kind]} and "/v1/embeddings" in paths
        assert "/v1/completions" not in paths and "/v1/fill-mask" not in paths
        assert f"POST {routes[kind]}" in c.get("/v1/none").json()["error"]["message"]


def test_a_model_without_a_head_has_no_head_routes(bert_tok):
    from duolm.models import BertForPreTraining
    cfg = BertConfig(vocab_size=bert_tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, n_inner=64)
    with _client(BertForPreTraining(cfg).eval(), bert_tok) as c:
        r = c.post("/v1/classify", json={"input": "a"})
        assert r.status_code == 400 and "(BertForPreTraining)" in r.json()["error"]["message"]
        assert "head" not in c.get("/v1/models").json()["data"][0]


@pytest.mark.parametrize("kind,route,body,param", [
    ("classify", "/v1/classify", {"input": 5}, "input"),
    ("classify", "/v1/classify", {"input": []}, "input"),
    ("classify", "/v1/classify", {"input": [["only one"]]}, "input"),
    ("classify", "/v1/classify", {"input": "a", "inputs": "a"}, "inputs"),
    ("tag", "/v1/ner", {"input": [["a", "b"]]}, "input"),
    ("tag", "/v1/ner", {"input": ["a"] * 2049}, "input"),
    ("span", "/v1/qa", {"question": "q", "context": "   "}, "context"),
    ("span", "/v1/qa", {"input": [{"question": "q"}]}, "input"),
    ("span", "/v1/qa", {"input": [{"question": "q", "context": "c", "id": 1}]}, "input")])
def test_bad_body_names_the_field(clients, kind, route, body, param):
    r = clients[kind].post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body", [{"question": "q"}, {}, {"question": "q", "context": "c",
                                                            "input": [{"question": "q", "context": "c"}]}])
def test_qa_needs_one_form(clients, body):
    r = clients["span"].post("/v1/qa", json=body)
    assert r.status_code == 400 and "give question and context, or input" in r.json()["error"]["message"]


def test_gpt_classifier_is_served(data_dir, tmp_path):
    tok = duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32)
    head = HeadConfig("classify", ["no", "yes"], max_length=32)
    model, tok = load_finetuned(save(_sharpen(head_model("gpt2", cfg, head)), tmp_path / "gpt-clf", tokenizer=tok))
    inputs = ["is it raining?", ["the sky is blue", "it is daytime"]]
    with _client(model, tok) as c:
        want = predict(model, tok, [inputs[0], tuple(inputs[1])])
        assert _data(c.post("/v1/classify", json={"input": inputs})) == want
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 400 and "GPT2ForSequence, a fine-tuned classify head" in r.json()["error"]["message"]
        assert c.get("/v1/models").json()["data"][0]["family"] == "gpt2"
