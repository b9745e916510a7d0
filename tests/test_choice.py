"""Multiple choice (SWAG-style, BERT section 4.4): the head against transformers' BertForMultipleChoice step by step,
the reader and its errors, finetune / predict / evaluate and the CLI. The examples are real MRPC sentences: the
context is a sentence, the right ending its paraphrase, the wrong ones other sentences of the file."""
from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch

from duolm.checkpoint import load, save
from duolm.models.heads import HeadConfig, attach_head
from duolm.tasks import Files, TaskBatches, choice, evaluate, load_finetuned, predict
from duolm.train import train
from duolm.train.finetune import finetune
from test_finetune import PARITY, _reference_losses, ft_config, minilm, minilm_dir, tiny_bert_dir  # noqa: F401

transformers = pytest.importorskip("transformers")


def mrpc_choices(data_dir, n: int, endings: int = 4, seed: int = 0) -> list[choice.Choice]:
    """Paraphrase pairs of MRPC's train.tsv as multiple choice: sentence 1, then its paraphrase among endings - 1
    sentences of other pairs, at a random position."""
    lines = (data_dir / "glue" / "MRPC" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    pairs = [line.split("\t")[3:5] for line in lines if line.split("\t")[0] == "1"][:n]
    rng = random.Random(seed)
    out = []
    for i, (a, b) in enumerate(pairs):
        wrong = [pairs[j][1] for j in rng.sample([j for j in range(len(pairs)) if j != i], endings - 1)]
        label = rng.randrange(endings)
        out.append(choice.Choice(a, wrong[:label] + [b] + wrong[label:], label))
    return out


def write_jsonl(path, choices):
    path.write_text("".join(json.dumps({"context": c.context, **{f"ending{j}": e for j, e in enumerate(c.endings)},
                                        "label": c.label}) + "\n" for c in choices), encoding="utf-8")
    return path


def test_choice_head_trains_as_transformers(data_dir):
    """MiniLM as our BertForChoice and as transformers' BertForMultipleChoice, the same head weights, batches,
    AdamW and schedule: the losses of 20 steps equal."""
    model, tok = load(minilm_dir())
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("choice", max_length=40), dropout=0.0)
    hf = transformers.BertForMultipleChoice.from_pretrained(minilm_dir(), hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.fc.weight)
        hf.classifier.bias.copy_(ours.fc.bias)
    feats = choice.encode(mrpc_choices(data_dir, 120), tok, ours.head)
    assert feats.cut                                                        # some inputs were cut to 40
    batches = TaskBatches(feats, seed=1)
    steps = dataclasses.replace(PARITY, max_steps=20)
    got = [r["loss"] for r in train(ours, choice.objective("bert", ours.head), batches, steps)["rows"]]
    hf.train()
    ref = _reference_losses(steps, batches, hf, lambda b: hf(
        input_ids=b["idx"], token_type_ids=b["segment_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss)
    assert min(ref[-5:]) < ref[0]                                          # it learned something
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


def test_inputs_are_bert_pairs_as_transformers_encodes_them(data_dir):
    _, tok = load(minilm_dir())
    rows = mrpc_choices(data_dir, 30)
    feats = choice.encode(rows, tok, HeadConfig("choice", max_length=32))
    hf = transformers.BertTokenizerFast.from_pretrained(minilm_dir())
    for c, ids, segs in zip(rows, feats.ids, feats.segment_ids):
        ref = hf([c.context] * len(c.endings), c.endings, truncation=True, max_length=32)
        assert ids == ref["input_ids"] and segs == ref["token_type_ids"]
    batch = feats.collate([0, 1, 2])
    assert batch["idx"].shape[:2] == (3, 4) and batch["labels"].tolist() == [c.label for c in rows[:3]]
    assert batch["attention_mask"].sum().item() == sum(len(x) for r in feats.ids[:3] for x in r)


def test_reader_and_its_errors(tmp_path):
    good = tmp_path / "ok.csv"
    good.write_text("context,ending0,ending1,ending2,label\nA man sits.,He stands.,He reads.,He flies.,1\n",
                    encoding="utf-8")
    (c,) = choice.read_choices(good)
    assert c.endings == ["He stands.", "He reads.", "He flies."] and c.label == 1 and c.where.endswith("ok.csv:2")
    cases = {"context,ending0,label\nx,y,0\n": "expected the columns ending0, ending1",
             "context,ending0,ending2,label\nx,y,z,0\n": "expected the columns ending0, ending1",
             "text,ending0,ending1,label\nx,y,z,0\n": "no context column 'context'",
             "context,ending0,ending1,label\nx,y,z,2\n": "line 2: label '2' is not the number of an ending (0 to 1)",
             "context,ending0,ending1\nx,y,z\n": "no label column 'label'"}
    for text, message in cases.items():
        bad = tmp_path / "bad.csv"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=re.escape(message)):
            choice.read_choices(bad)


def test_finetune_predict_evaluate_and_the_cli(tiny_bert_dir, data_dir, tmp_path, capsys, one_thread):
    from duolm.cli import main

    rows = mrpc_choices(data_dir, 80, endings=3)
    train_f, dev_f = write_jsonl(tmp_path / "train.jsonl", rows[:64]), write_jsonl(tmp_path / "dev.jsonl", rows[64:])
    res = finetune(tiny_bert_dir, "multiple-choice", tmp_path / "run", ft_config(lr=1e-3, batch_size=16, epochs=2,
                                                                                 max_length=48),
                   Files(train=train_f, dev=dev_f))
    assert res["kind"] == "choice" and res["metric"] == "accuracy" and res["dev"] == {"dev": 16}
    assert set(res["mean"]) == {"accuracy", "loss"}
    model, tok = load_finetuned(tmp_path / "run")
    metrics, _ = evaluate(model, tok, Files(dev=dev_f))
    assert metrics == pytest.approx(res["best"]["metrics"], abs=1e-6)
    (p,) = predict(model, tok, [(rows[70].context, rows[70].endings)])
    assert 0 <= p["label"] < 3 and sum(p["probabilities"]) == pytest.approx(1.0)
    hf = save(model, tmp_path / "hf", tokenizer=tok, format="hf")           # transformers reads the export
    ref = transformers.BertForMultipleChoice.from_pretrained(hf).eval()
    b = choice.encode(rows[64:], tok, model.head).collate(list(range(16)))
    with torch.no_grad():
        theirs = ref(input_ids=b["idx"], token_type_ids=b["segment_ids"], attention_mask=b["attention_mask"]).logits
        torch.testing.assert_close(model.eval()(b["idx"], b["segment_ids"], b["attention_mask"]), theirs,
                                   atol=1e-5, rtol=0)
    assert type(load(hf)[0]) is type(model) and load(hf)[0].head.kind == "choice"

    main(["finetune", str(tiny_bert_dir), "--task", "multiple-choice", "--train", str(train_f), "--dev", str(dev_f),
          "-o", str(tmp_path / "cli"), "--epochs", "1", "--batch-size", "16", "--max-length", "48", "--quiet",
          "--json"])
    assert json.loads(capsys.readouterr().out)["metric"] == "accuracy"
    main(["predict", str(tmp_path / "cli"), rows[70].context, *rows[70].endings])
    best, number, prob = capsys.readouterr().out.strip().split("\t")
    assert rows[70].endings[int(number)] == best and 0 < float(prob) <= 1
