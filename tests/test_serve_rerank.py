"""POST /v1/score, /v1/rerank and /rerank against sentence-transformers: a tiny BERT pair classifier (2 labels) and
a regressor, exported to HF's format and loaded back by duolm as `duolm serve` loads them, give the scores of
sentence-transformers' CrossEncoder on the same directory, and an embedding model (all-MiniLM-L6-v2) the cosine
of SentenceTransformer's embeddings; `duolm predict --score` prints the same scores; the official `cohere` client,
pointed at a live `duolm serve`, gets the same ranking; bad requests are 4xx naming what is wrong.

The score CrossEncoder.predict defines is the same number as duolm's with these settings: for 2 labels
apply_softmax=True and the second column (its default activation for 2 labels is none: raw logits); for a
regressor activation_fn=Identity (its default for 1 label is a sigmoid, which would keep the order but not the
value). The heads have random N(0, 0.3) weights: scores far apart, so the order is defined."""
import csv
import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
import cohere  # noqa: E402
import sentence_transformers as st  # noqa: E402
from conftest import minilm_dir  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

import duolm  # noqa: E402
from duolm.checkpoint import load, save  # noqa: E402
from duolm.models.bert import BertConfig  # noqa: E402
from duolm.models.heads import HeadConfig, head_model  # noqa: E402
from duolm.serve import ServeConfig  # noqa: E402
from duolm.serve.app import create_app  # noqa: E402
from duolm.convert.st import read_pooling  # noqa: E402
from duolm.serve.schemas import MAX_INPUTS  # noqa: E402
from duolm.tasks.sentence import pair_scores  # noqa: E402
from test_serve import sharpen  # noqa: E402
from test_serve_e2e import server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS = {"classify": HeadConfig("classify", ["0", "1"], task="mrpc", max_length=64),
         "regress": HeadConfig("regress", task="stsb", max_length=64)}


@pytest.fixture(scope="module")
def sts(data_dir):
    """A query and ten documents: real STS-B sentences."""
    with open(data_dir / "glue" / "STS-B" / "train.tsv", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    col = rows[0].index("sentence2")
    return rows[1][rows[0].index("sentence1")], [r[col] for r in rows[1:40:4]]


@pytest.fixture(scope="module")
def exported(data_dir, tmp_path_factory):
    """{kind: HF directory} of tiny BERT heads with the real uncased vocabulary."""
    tok = duolm.WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt")
    cfg = BertConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32, n_inner=64)
    return {kind: save(sharpen(head_model("bert", cfg, head).eval(), seed=1), tmp_path_factory.mktemp(kind),
                       tokenizer=tok, format="hf") for kind, head in HEADS.items()}


def cross_encoder_scores(path, kind, pairs) -> np.ndarray:
    if kind == "classify":
        return st.CrossEncoder(str(path), device="cpu").predict(pairs, apply_softmax=True)[:, 1]
    return st.CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Identity()).predict(pairs)


def _client(model, tok, **kw):
    return TestClient(create_app(model, tok, ServeConfig(model_name="m", batch_window_s=0.01, **kw)))


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def check_rerank(got: dict, want: np.ndarray, docs: list, top_n=None):
    order = np.argsort(-want, kind="stable")[:top_n]
    assert [x["index"] for x in got["results"]] == order.tolist()
    assert [x["relevance_score"] for x in got["results"]] == pytest.approx(want[order].tolist(), abs=1e-5)
    assert all(x["document"] == {"text": docs[x["index"]]} for x in got["results"])


@pytest.mark.parametrize("kind", ["classify", "regress"])
def test_pair_head_scores_equal_cross_encoder(exported, sts, kind, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    query, docs = sts
    pairs = [(query, d) for d in docs]
    want = cross_encoder_scores(exported[kind], kind, pairs)
    assert np.diff(np.sort(want)).min() > 1e-4                           # a defined order
    hf_tok = st.CrossEncoder(str(exported[kind]), device="cpu").tokenizer
    tokens = sum(len(hf_tok(q, d)["input_ids"]) for q, d in pairs)
    model, tok = load(exported[kind])
    with _client(model, tok) as c:
        got = _ok(c.post("/v1/score", json={"model": "m", "text_1": query, "text_2": docs}))
        assert [d["index"] for d in got["data"]] == list(range(len(docs))) and got["object"] == "list"
        assert [d["score"] for d in got["data"]] == pytest.approx(want.tolist(), abs=1e-5)
        assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        one = _ok(c.post("/v1/score", json={"text_1": query, "text_2": docs[3]}))["data"]
        assert [d["score"] for d in one] == pytest.approx([want[3]], abs=1e-5)
        for path in ("/v1/rerank", "/rerank"):
            got = _ok(c.post(path, json={"model": "m", "query": query, "documents": docs}))
            check_rerank(got, want, docs)
            assert got["usage"] == {"total_tokens": tokens} and got["model"] == "m"
        objects = [{"text": d} for d in docs]
        check_rerank(_ok(c.post("/rerank", json={"query": query, "documents": objects, "top_n": 3})), want, docs, 3)
        bare = _ok(c.post("/v1/rerank", json={"query": query, "documents": docs, "return_documents": False}))
        assert all(set(x) == {"index", "relevance_score"} for x in bare["results"])
    assert [x["score"] for x in pair_scores(model, tok, pairs)] == pytest.approx(want.tolist(), abs=1e-5)
    from duolm.cli import main
    main(["predict", str(exported[kind]), *[t for p in pairs[:3] for t in p], "--pairs", "--score", "--json"])
    printed = [x["prediction"]["score"] for x in json.loads(capsys.readouterr().out)]
    assert printed == pytest.approx(want[:3].tolist(), abs=1e-5)
    main(["predict", str(exported[kind]), *pairs[0], "--pairs", "--score"])
    assert capsys.readouterr().out == f"{query}\t{docs[0]}\t{want[0]:.4f}\n"
    with pytest.raises(SystemExit):
        main(["predict", str(exported[kind]), query, "--score"])
    assert "duolm: error: input 0 is not a pair of texts" in capsys.readouterr().err


def test_embedding_model_scores_are_sentence_transformers_cosines(sts, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    query, docs = sts
    mdir = minilm_dir()
    ref = st.SentenceTransformer(str(mdir), device="cpu")
    want = ref.similarity(ref.encode([query]), ref.encode(docs))[0].numpy()
    tokens = sum(len(ref.tokenizer(t)["input_ids"]) for t in [query, *docs])
    model, tok = load(mdir)
    with TestClient(create_app(model, tok, ServeConfig(model_name="m"), pooling=read_pooling(mdir))) as c:
        got = _ok(c.post("/v1/score", json={"text_1": query, "text_2": docs}))
        assert [d["score"] for d in got["data"]] == pytest.approx(want.tolist(), abs=1e-5)
        assert got["usage"]["prompt_tokens"] == tokens
        check_rerank(_ok(c.post("/v1/rerank", json={"query": query, "documents": docs})), want, docs)
        long = " ".join(docs * 4)                               # over max_seq_length 256
        r = c.post("/v1/rerank", json={"query": query, "documents": ["a", long]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
        assert "documents[1] has" in r.json()["error"]["message"] and "limit 256" in r.json()["error"]["message"]
        cut = _ok(c.post("/v1/score", json={"text_1": query, "text_2": long, "truncate_prompt_tokens": -1}))
    ref_cut = ref.similarity(ref.encode([query]), ref.encode([long]))[0, 0].item()     # sentence-transformers cuts
    assert cut["data"][0]["score"] == pytest.approx(ref_cut, abs=1e-5)


def test_cohere_client_gets_the_same_ranking(exported, sts, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    query, docs = sts
    want = cross_encoder_scores(exported["classify"], "classify", [(query, d) for d in docs])
    (tmp_path / "key").write_text("secret\n")
    with server(exported["classify"], tmp_path / "serve.log", "--api-key-file", str(tmp_path / "key"),
                "--model-name", "ce") as (url, _):
        client = cohere.Client(base_url=url, api_key="secret", timeout=60)
        got = client.rerank(model="ce", query=query, documents=docs, top_n=4)
        with pytest.raises(cohere.errors.UnauthorizedError):
            cohere.Client(base_url=url, api_key="wrong", timeout=60).rerank(model="ce", query=query, documents=docs)
        with pytest.raises(cohere.errors.BadRequestError, match="documents"):
            client.rerank(model="ce", query=query, documents=[])
    order = np.argsort(-want, kind="stable")[:4]
    assert [x.index for x in got.results] == order.tolist()
    assert [x.relevance_score for x in got.results] == pytest.approx(want[order].tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def clients(exported, data_dir):
    """A pair classifier (with an API key) and models without a pair head: 3 labels, a tagger, GPT-2."""
    model, tok = load(exported["classify"])
    cfg = BertConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, n_inner=64)
    three = head_model("bert", cfg, HeadConfig("classify", ["a", "b", "c"], max_length=32)).eval()
    tagger = head_model("bert", cfg, HeadConfig("tag", ["O", "B-X"], max_length=32)).eval()
    gpt2 = duolm.GPT2(duolm.GPT2Config(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    cs = {"pair": _client(model, tok, api_key="k"), "three": _client(three, tok), "tag": _client(tagger, tok),
          "gpt2": _client(gpt2, tok)}
    for c in cs.values():
        c.__enter__()
    yield cs
    for c in cs.values():
        c.__exit__(None, None, None)


KEY = {"Authorization": "Bearer k"}


@pytest.mark.parametrize("route,body,param,message", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least 1 item"),
    ("/rerank", {"query": "q", "documents": ["d"] * (MAX_INPUTS + 1)}, "documents", f"at most {MAX_INPUTS} items"),
    ("/v1/score", {"text_1": "q", "text_2": []}, "text_2", "at least 1 item"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "word " * 80]}, "documents",
     "query and documents[1] are longer than 64 tokens"),
    ("/v1/score", {"text_1": "q", "text_2": ["word " * 80]}, "text_2", "text_1 and text_2[0] are longer than 64"),
    ("/v1/rerank", {"query": "q", "documents": [{"text": "d", "title": "t"}]}, "documents", "Extra inputs"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("/v1/score", {"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 10}, "truncate_prompt_tokens", "-1"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "model": "other"}, "model", "does not exist"),
    # a body field called "query" is named, not taken for the URL's query string
    ("/v1/rerank", {"documents": ["d"]}, "query", "query: Field required"),
    ("/rerank", {"query": None, "documents": ["d"]}, "query", "query: Input should be a valid string"),
    ("/v1/rerank", {"query": 5, "documents": ["d"]}, "query", "query: Input should be a valid string")])
def test_bad_requests_are_400_naming_the_field(clients, route, body, param, message):
    r = clients["pair"].post(route, json=body, headers=KEY)
    err = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400) and err["param"] == param and message in err["message"]


def test_long_pairs_are_cut_when_asked(clients):
    body = {"query": "q", "documents": ["word " * 80], "truncate_prompt_tokens": -1}
    got = _ok(clients["pair"].post("/v1/rerank", json=body, headers=KEY))
    assert got["usage"]["total_tokens"] == 64


@pytest.mark.parametrize("kind", ["three", "tag", "gpt2"])
@pytest.mark.parametrize("route", ["/v1/score", "/v1/rerank", "/rerank"])
def test_a_model_without_a_pair_head_is_400(clients, kind, route):
    body = {"text_1": "q", "text_2": "d"} if route == "/v1/score" else {"query": "q", "documents": ["d"]}
    r = clients[kind].post(route, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "model_family_mismatch"
    assert "needs a fine-tuned pair classifier of 2 labels or regressor, or a BERT embedding model" in err["message"]
    assert route not in clients[kind].get("/openapi.json").json()["paths"]


def test_auth_and_metrics_as_on_every_route(clients):
    c = clients["pair"]
    assert c.post("/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 401
    assert c.post("/v1/score", json={"text_1": "q", "text_2": "d"}, headers=KEY).status_code == 200
    requests = c.get("/metrics?format=json", headers=KEY).json()["requests"]
    assert requests["/v1/rerank"]["401"] >= 1 and requests["/v1/score"]["200"] >= 1
    assert {"/v1/score", "/v1/rerank", "/rerank"} <= set(c.get("/openapi.json", headers=KEY).json()["paths"])
