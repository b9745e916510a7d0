"""Embedding fine-tuning (duolm.tasks.embedding): losses step by step against sentence-transformers' loss classes,
the export SentenceTransformer(path) loads, a run served by /v1/embeddings, the files and their errors."""
from __future__ import annotations

import json

import pytest
import torch

from duolm.checkpoint import load, save
from duolm.convert.st import Pooling, read_pooling
from duolm.models.heads import HeadConfig, attach_head, pool_states
from duolm.tasks import Files, TaskBatches, embedding, load_finetuned, predict
from duolm.tasks.embedding import Pair, read_pairs
from duolm.train import TrainConfig, train
from test_finetune import _reference_losses, ft_config, minilm_dir

st = pytest.importorskip("sentence_transformers")
losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")

STEPS = TrainConfig(max_steps=10, batch_size=8, lr=1e-4, warmup_steps=2, decay="linear", weight_decay=0.01,
                    betas=(0.9, 0.999), eps=1e-6, grad_clip=1.0, eval_every=0, precision="fp32")


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


@pytest.fixture(scope="module")
def stsb(data_dir):
    """STS-B's training pairs, scores from 0-5 to 0-1."""
    return [Pair(p.texts, p.score / 5) for p in read_pairs(data_dir / "glue" / "STS-B" / "train.tsv", scored=True)]


def _triples(pairs):
    """(sentence1, sentence2, a hard negative: the sentence2 of the next low-scored pair) of the similar pairs."""
    low = [p.texts[1] for p in pairs if p.score < 0.3]
    return [Pair((p.texts[0], p.texts[1], low[i % len(low)])) for i, p in enumerate(p for p in pairs if p.score > 0.7)]


@pytest.mark.parametrize("loss", ["mnrl", "mnrl-hard", "cosine"])
def test_losses_equal_sentence_transformers(loss, minilm, stsb):
    """MiniLM as our BertForEmbedding and as SentenceTransformer, the same batches, AdamW and schedule: 10 steps of
    MultipleNegativesRankingLoss (pairs; pairs and a hard negative) and CosineSimilarityLoss equal within the
    rounding of float32 cosines.
    Dropout is off on both sides: the two draw their masks differently, so equal losses need no masks at all."""
    model, tok = minilm
    ours = attach_head(model, HeadConfig("embed", max_length=32), dropout=0.0)
    # MNRL: every STS-B pair as a positive pair (its dissimilar ones keep the loss well above 0), the next pair's
    # sentence2 as its hard negative
    pairs = {"mnrl": [Pair(p.texts) for p in stsb], "cosine": stsb,
             "mnrl-hard": [Pair((*p.texts, q.texts[1])) for p, q in zip(stsb, stsb[1:])]}[loss]
    batches = TaskBatches(embedding.encode(pairs[:200], tok, ours.head), seed=1)
    got = [r["loss"] for r in train(ours, embedding.objective("bert", ours.head), batches, STEPS)["rows"]]

    ref = st.SentenceTransformer(str(minilm_dir()), device="cpu")
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref.train()
    fn = (losses.CosineSimilarityLoss if loss == "cosine" else losses.MultipleNegativesRankingLoss)(ref)

    def loss_of(b):
        n = sum(k.startswith("idx") for k in b)
        features = [{"input_ids": b[f"idx{c}"], "attention_mask": b[f"mask{c}"],
                     "token_type_ids": torch.zeros_like(b[f"idx{c}"])} for c in range(n)]
        return fn(features, b.get("labels"))
    want = _reference_losses(STEPS, batches, ref, loss_of)
    assert sum(want) / len(want) > 0.005 and len(set(want)) == len(want)    # far from 0, and changing
    # A cosine, a sum of 384 products, carries float32 rounding of ~sqrt(384) u (u = 2^-24) by another order of the
    # sums (ours and theirs, or one kernel set and another). MNRL, a cross-entropy over 20 x the cosines
    # (sentence-transformers' scale), moves by at most 2 x 20 times that: 4.7e-5; CosineSimilarityLoss, the squared
    # difference of a cosine and its label (at most 2 apart), by at most 2 x 2 times it: 4.7e-6
    slope = 2 * 2 if loss == "cosine" else 2 * 20
    assert got == pytest.approx(want, abs=slope * 384 ** 0.5 * 2 ** -24, rel=0)


def test_pooling_worked_example():
    h, m = torch.tensor([[[3.0, 0.0], [1.0, 2.0], [9.0, 9.0]]]), torch.tensor([[1, 1, 0]])
    assert pool_states(h, m, "mean", False).tolist() == [[2.0, 1.0]]                  # the padding left out
    assert pool_states(h, m, "mean")[0].tolist() == pytest.approx([2 / 5 ** 0.5, 1 / 5 ** 0.5])
    assert pool_states(h, m, "cls", False).tolist() == [[3.0, 0.0]]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_run_is_served_and_loads_in_sentence_transformers(minilm, stsb, tmp_path):
    """finetune() on triples with an STS-B dev file: the run's model embeds as its export does in
    SentenceTransformer(path) (within 1e-5), pools as all-MiniLM-L6-v2 (mean, normalised: read from its files),
    and /v1/embeddings serves those embeddings."""
    from duolm.train.finetune import finetune
    train_file = _write(tmp_path / "triples.jsonl", [dict(zip(("anchor", "positive", "negative"), p.texts))
                                                     for p in _triples(stsb)[:48]])
    dev = tmp_path / "sts.tsv"
    dev.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{5 * s:.2f}\n" for (a, b), s in
                                                             ((p.texts, p.score) for p in stsb[-60:])), encoding="utf-8")
    cfg = ft_config(lr=2e-5, batch_size=16, epochs=1, max_length=32)
    res = finetune(minilm_dir(), "embedding", tmp_path / "run", cfg, Files(train=train_file, dev=dev))
    assert res["kind"] == "embed" and res["metric"] == "spearman" and 0.5 < res["mean"]["spearman"] <= 1
    assert "loss: MultipleNegativesRankingLoss (in-batch negatives, hard negatives, scale 20)" in res["notes"]
    model, tok = load_finetuned(tmp_path / "run")
    assert (model.head.pooling, model.head.normalize) == ("mean", True)
    out = save(model, tmp_path / "st", tokenizer=tok, format="hf")
    assert read_pooling(out) == Pooling("mean", True, 32, "1_Pooling/config.json")
    texts = [p.texts[0] for p in stsb[:20]] + ["x", "A much longer sentence, " * 20]
    ours = torch.tensor([p["embedding"] for p in predict(model, tok, texts)])
    ref = st.SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_tensor=True)
    assert ours.shape == ref.shape and (ours - ref).abs().max() < 1e-5
    assert embedding.score(model, tok, read_pairs(dev, scored=True))["spearman"] == pytest.approx(res["mean"]["spearman"])

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from duolm.serve import ServeConfig, pooling_of
    from duolm.serve.app import create_app
    with TestClient(create_app(model, tok, ServeConfig(model_name="m"), pooling_of(model, tmp_path / "run"))) as c:
        r = c.post("/v1/embeddings", json={"input": texts[:3], "model": "m"})
    assert r.status_code == 200, r.text
    assert (torch.tensor([d["embedding"] for d in r.json()["data"]]) - ours[:3]).abs().max() < 1e-5


@pytest.mark.parametrize("rows, message", [
    ([{"anchor": "a", "other": "b"}], "expected the columns anchor, positive"),
    ([{"anchor": "a", "positive": ""}], "line 1: anchor and positive must be non-empty texts"),
    ([{"sentence1": "a", "sentence2": "b", "score": "high"}], "line 1: score 'high' is not a number"),
    ([{"sentence1": "a", "sentence2": "b", "score": 0.5}, {"sentence1": "a", "sentence2": "b", "score": 3.8}],
     "t.jsonl:2: score 3.8 is outside [-1, 1]"),
])
def test_bad_files_are_one_line_errors(rows, message, tmp_path, capsys):
    from duolm.cli import main
    train_file = _write(tmp_path / "t.jsonl", rows)
    dev = _write(tmp_path / "d.jsonl", [{"sentence1": "a", "sentence2": "b", "score": 1}])
    with pytest.raises(SystemExit):
        main(["finetune", str(minilm_dir()), "--task", "embedding", "--train", str(train_file), "--dev", str(dev),
              "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
