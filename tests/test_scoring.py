"""Sentence scoring (duolm.evaluation.scoring): GPT-2's log-likelihood and BERT's pseudo-log-likelihood against
minicons (pinned, test-only, run in a subprocess with transformers 4.57.3: tests/minicons_scores.py), BLiMP item for
item, the masking of within-word-l2r, bad input, `duolm score` and `duolm eval --task blimp`."""
from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import duolm
from conftest import qa_reference
from duolm.cli import main
from duolm.evaluation import evaluate_lm, scoring
from duolm.evaluation.scoring import _copies, blimp, read_blimp, score_sentences
from duolm.models import GPT2, Bert, BertConfig, BertForPreTraining, GPT2Config

PAIRS = 12                       # the first pairs of each BLiMP paradigm in ../shared/data/blimp


@pytest.fixture(scope="module")
def tokenizers(data_dir):
    return (duolm.ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe"),
            duolm.WordPiece.from_vocab(data_dir / "bert-vocab" / "bert-base-uncased-vocab.txt"))


def _models():
    torch.manual_seed(0)
    gpt = GPT2(GPT2Config(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    bert = BertForPreTraining(BertConfig(vocab_size=30522, block_size=64, n_layer=2, n_head=2, n_embd=32,
                                         n_inner=64)).eval()
    return gpt, bert


@pytest.fixture(scope="module")
def blimp_slice(data_dir, tmp_path_factory):
    """The first PAIRS pairs of every paradigm, in BLiMP's files' format."""
    folder = tmp_path_factory.mktemp("blimp")
    for f in sorted((data_dir / "blimp").glob("*.jsonl")):
        (folder / f.name).write_text("".join(f.read_text(encoding="utf-8").splitlines(keepends=True)[:PAIRS]))
    return folder


KINDS = [("gpt2", None), ("bert", "original"), ("bert", "within_word_l2r")]     # minicons' PLL metrics


def _sentences(pairs: list[dict]) -> list[str]:
    """The BLiMP pairs' sentences, good then bad, and sentences with many-piece words."""
    return [s for p in pairs for s in (p["sentence_good"], p["sentence_bad"])] + [
        "Unbelievably, the antidisestablishmentarianism persisted.", "A b.", "naïve café owners' co-operation"]


@pytest.fixture(scope="module")
def minicons(tokenizers, blimp_slice, tmp_path_factory) -> dict:
    """(kind, pll) -> minicons' summed score of each of _sentences, for each of KINDS, on _models()' HF exports; all
    in one process of its own (minicons' import takes seconds)."""
    folder = tmp_path_factory.mktemp("minicons")
    for model, tok, name in zip(_models(), tokenizers, ("gpt2", "bert")):
        duolm.save(model, folder / name, tokenizer=tok, format="hf")
    (folder / "sentences.json").write_text(json.dumps(_sentences(read_blimp(blimp_slice))))
    (folder / "jobs.json").write_text(json.dumps([(str(folder / kind), kind, pll) for kind, pll in KINDS]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sys.prefix) / "minicons-reference"),
                                                         str(qa_reference())])}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("minicons_scores.py")),
                        str(folder / "sentences.json"), str(folder / "jobs.json")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(zip(KINDS, json.loads(r.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("kind,pll", KINDS)
def test_scores_and_blimp_items_equal_minicons(kind, pll, tokenizers, blimp_slice, minicons):
    """Every sentence's score within 1e-4 nats of minicons' (GPT-2 with bos_token=True; BERT's PLL `original` and
    `within_word_l2r`) on the BLiMP pairs and sentences with many-piece words, and every BLiMP pair judged alike."""
    gpt, bert = _models()
    model, tok = (gpt, tokenizers[0]) if kind == "gpt2" else (bert, tokenizers[1])
    pairs = read_blimp(blimp_slice)
    sentences = _sentences(pairs)
    theirs = minicons[(kind, pll)]
    assert len(theirs) == len(sentences)
    ours = [r["score"] for r in score_sentences(model, tok, sentences, pll=(pll or "original").replace("_", "-"))]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    if pll == "within_word_l2r":            # the variants differ where a word has several pieces
        original = score_sentences(model, tok, sentences[-3:])
        assert any(abs(o["score"] - s) > 1e-5 for o, s in zip(original, ours[-3:]))
    result = blimp(model, tok, blimp_slice, pll=(pll or "original").replace("_", "-"))
    assert [i["right"] for i in result["items"]] == [theirs[2 * k] > theirs[2 * k + 1] for k in range(len(pairs))]
    uids = sorted({p["UID"] for p in pairs})
    assert sorted(result["paradigms"]) == uids and result["pairs"] == len(pairs) == PAIRS * len(uids)
    assert result["acc"] == pytest.approx(sum(result["paradigms"].values()) / len(uids))


def test_within_word_l2r_masks_a_word_to_its_right():
    """The module's worked example: "un ##believ ##able" as one word, then a word of one piece."""
    ids, pieces = [1, 10, 11, 12, 13, 2], ["[CLS]", "un", "##believ", "##able", "it", "[SEP]"]
    masks = lambda pll: [[i for i, t in enumerate(m) if t < 0] for m, _ in _copies(ids, pieces, pll)]  # noqa: E731
    assert masks("original") == [[1], [2], [3], [4]]
    assert masks("within-word-l2r") == [[1, 2, 3], [2, 3], [3], [4]]
    assert [pos for _, pos in _copies(ids, pieces, "within-word-l2r")] == [1, 2, 3, 4]
    assert doctest.testmod(scoring).failed == 0


def test_scoring_batches_give_each_sentence_its_own_scores(tokenizers):
    """A sentence scored alone or among others of other lengths (padded, the copies of several sentences in one
    forward) gets the same scores, per token and summed."""
    gpt, bert = _models()
    sentences = ["The cat sat on the mat.", "Dogs bark.", "Whoever left the door open should close it now."]
    for model, tok in ((gpt, tokenizers[0]), (bert, tokenizers[1])):
        together = score_sentences(model, tok, sentences, tokens=64)
        for s, t in zip(sentences, together):
            alone = score_sentences(model, tok, [s])[0]
            assert alone["tokens"] == t["tokens"] and len(t["token_scores"]) == len(t["tokens"])
            torch.testing.assert_close(torch.tensor(alone["token_scores"]), torch.tensor(t["token_scores"]),
                                       atol=1e-5, rtol=0)


def test_bad_input_is_a_clear_error(tokenizers):
    gpt, bert = _models()
    bpe, wp = tokenizers
    with pytest.raises(ValueError, match="sentence 1 is empty"):
        score_sentences(gpt, bpe, ["fine", "  "])
    with pytest.raises(ValueError, match="sentence 0 is 8[0-9] tokens .* window is 64"):
        score_sentences(bert, wp, ["word " * 80])
    with pytest.raises(ValueError, match="masked-LM head"):
        score_sentences(Bert(bert.config).eval(), wp, ["a sentence"])
    with pytest.raises(ValueError, match="GPT-2 with its byte-level BPE or BERT"):
        score_sentences(gpt, wp, ["a sentence"])
    with pytest.raises(ValueError, match="pll must be one of"):
        score_sentences(bert, wp, ["a sentence"], pll="left-to-right")


def test_cli_score_and_eval_blimp(tokenizers, blimp_slice, tmp_path, capsys):
    """`duolm score --json` prints the library's scores; `duolm eval --task blimp` runs BERT's PLL and prints the
    paradigms; a file of sentences and a bad call end in one line."""
    _, bert = _models()
    duolm.save(bert, tmp_path / "bert", tokenizer=tokenizers[1])
    model, tok = duolm.load(tmp_path / "bert")
    want = score_sentences(model, tok, ["The cat sat.", "Cats sat the."], pll="within-word-l2r")
    main(["score", str(tmp_path / "bert"), "--text", "The cat sat.", "--text", "Cats sat the.", "--pll",
          "within-word-l2r", "--json", "--tokens"])
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-6)
    assert got[0]["tokens"] == want[0]["tokens"] == ["the", "cat", "sat", "."]
    (tmp_path / "s.txt").write_text("The cat sat.\n\nCats sat the.\n")
    main(["score", str(tmp_path / "bert"), "--file", str(tmp_path / "s.txt"), "--pll", "within-word-l2r"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[1] for line in lines] == ["The cat sat.", "Cats sat the."]
    assert float(lines[0].split("\t")[0]) == pytest.approx(want[0]["score"], abs=1e-4)
    with pytest.raises(SystemExit) as e:
        main(["score", str(tmp_path / "bert"), "--text", ""])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "duolm: error: sentence 0 is empty: there is nothing to score\n"
    result = evaluate_lm(model, tok, "blimp", blimp_slice)
    main(["eval", str(tmp_path / "bert"), "--task", "blimp", "--data", str(blimp_slice), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["paradigms"] == pytest.approx(result["paradigms"]) and "pseudo-log-likelihood" in printed["protocol"]


def test_pretrain_logs_the_blimp_accuracy_duolm_eval_gives_on_its_checkpoint(data_dir, tokenizers, blimp_slice,
                                                                              tmp_path, capsys):
    """`duolm pretrain bert --eval-blimp` logs val_blimp_acc at every validation: the overall accuracy `duolm eval
    --task blimp` gives on the run's last checkpoint (BERT's pseudo-log-likelihood)."""
    from duolm.data import prepare
    from duolm.runs import read_metrics

    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:20_000]
    (tmp_path / "text.txt").write_text(text)
    prepare([tmp_path / "text.txt"], tokenizers[1], tmp_path / "data", val_fraction=0.1, chunk_chars=8192)
    run = tmp_path / "run"
    main(["pretrain", "bert", "--data", str(tmp_path / "data"), "-o", str(run), "--preset", "tiny", "--block-size",
          "64", "--batch-size", "4", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--quiet",
          "--precision", "fp32", "--eval-blimp", str(blimp_slice)])
    rows = [r for r in read_metrics(run) if "val_blimp_acc" in r]
    assert [r["step"] for r in rows] == [0, 2]
    main(["eval", str(run), "--task", "blimp", "--data", str(blimp_slice), "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["acc"] == rows[-1]["val_blimp_acc"]


def test_a_served_bert_scores_text_as_completions_clients_ask(tokenizers):
    """`duolm serve` of a BERT with its masked-LM head answers POST /v1/completions as clients send it to score text
    (max_tokens 0, echo, logprobs): through the official openai client, each prompt's tokens and their
    pseudo-log-likelihood terms as score_sentences gives them; generating text, or an empty prompt, is a 400 naming
    the field."""
    import openai

    from duolm.serve import ServeConfig
    from duolm.serve.app import create_app
    from test_serve import serving

    _, bert = _models()
    wp = tokenizers[1]
    texts = ["The cat sat.", "Unbelievably, it persisted."]
    want = score_sentences(bert, wp, texts)
    with serving(create_app(bert, wp, ServeConfig(model_name="tiny-bert"))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="tiny-bert", prompt=texts, max_tokens=0, echo=True, logprobs=0)
        for choice, w in zip(out.choices, want):
            assert choice.logprobs.tokens == w["tokens"]
            assert choice.logprobs.token_logprobs == pytest.approx(w["token_scores"], abs=1e-5)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-bert", prompt="The cat", max_tokens=5)
        assert e.value.body["param"] == "max_tokens" and "scores text and writes none" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-bert", prompt=["fine", " "], max_tokens=0, echo=True)
        assert e.value.body["message"] == "prompt[1] is empty: there is nothing to score"
