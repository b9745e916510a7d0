"""Fine-tuning: heads against transformers (same losses, step by step), task readers and their errors,
features and batches, finetune() / predict() / evaluate(), export, the CLI.

The real checkpoint all-MiniLM-L6-v2 (installed by `make test`) plays BERT; GPT-2 is a tiny random model
saved in HF format. Every training here is a few steps on a few real GLUE rows."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import minilm_dir

from duolm.checkpoint import load, save
from duolm.tasks import TaskBatches
from duolm.tasks.sentence import encode_examples, load_glue
from duolm.models import GPT2, Bert, BertConfig, GPT2Config
from duolm.models.heads import HeadConfig, attach_head
from duolm.tokenizers import ByteLevelBPE
from duolm.train import TrainConfig, lr_at, train
from duolm.tasks.sentence import sequence_objective

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


def glue_rows(data_dir, task, n):
    data = load_glue(task, data_dir / "glue" / {"sst2": "SST-2", "stsb": "STS-B", "mrpc": "MRPC", "cola": "CoLA",
                                                 "rte": "RTE"}[task], splits=("train",))
    return data, data.train[:n]


def _hf_adamw(model, cfg: TrainConfig):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             fused=True)


def _reference_losses(cfg: TrainConfig, batches, params, loss_of):
    """A plain loop: the same AdamW groups, schedule and clipping as duolm's train(), on `loss_of(batch)`."""
    opt = _hf_adamw(params, cfg)
    losses = []
    for step in range(cfg.max_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.decay)
        loss = loss_of(batches.batch(step, cfg.batch_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


PARITY = TrainConfig(max_steps=30, batch_size=4, lr=1e-4, warmup_steps=3, decay="linear", weight_decay=0.01,
                     betas=(0.9, 0.999), eps=1e-6, grad_clip=1.0, eval_every=0, precision="fp32")   # as the reference


@pytest.mark.parametrize("task", ["sst2", "stsb"])
def test_bert_head_trains_as_transformers(task, minilm, data_dir):
    """MiniLM as our BertForSequence and as transformers' BertForSequenceClassification, the same head weights,
    batches, AdamW and schedule: 30 steps of losses equal (classification and regression)."""
    model, tok = minilm
    data, rows = glue_rows(data_dir, task, 120)
    head = HeadConfig(data.kind, data.labels, max_length=24)
    torch.manual_seed(0)
    ours = attach_head(model, head, dropout=0.0)
    hf = transformers.BertForSequenceClassification.from_pretrained(
        minilm_dir(), num_labels=head.n_out, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.fc.weight)
        hf.classifier.bias.copy_(ours.fc.bias)
    batches = TaskBatches(encode_examples(rows, tok, 24, data.labels, data.kind), seed=1)
    got = [r["loss"] for r in train(ours, sequence_objective("bert", data.kind), batches, PARITY)["rows"]]

    hf.train()
    ref = _reference_losses(PARITY, batches, hf, lambda b: hf(
        input_ids=b["idx"], token_type_ids=b["segment_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss)
    assert min(ref[-5:]) < ref[0]                                   # it learned something
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(data_dir, tmp_path_factory):
    """A tiny random GPT-2 with a BPE trained on MRPC sentences, saved in HF format."""
    lines = (data_dir / "glue" / "MRPC" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:400]
    tok = ByteLevelBPE.train([t for line in lines for t in line.split("\t")[3:]], vocab_size=400)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32))
    return save(model, tmp_path_factory.mktemp("gpt") / "tiny", tokenizer=tok, format="hf")


@pytest.fixture(scope="module")
def tiny_bert_dir(minilm, tmp_path_factory):
    """A tiny random BERT with MiniLM's (bert-base-uncased) vocabulary."""
    torch.manual_seed(0)
    model = Bert(BertConfig.preset("tiny", vocab_size=minilm[1].vocab_size, block_size=128))
    return save(model, tmp_path_factory.mktemp("bert") / "tiny", tokenizer=minilm[1])


def test_gpt_head_with_lm_loss_trains_as_transformers(tiny_gpt2_dir, data_dir, one_thread):
    """GPT with L = L_task + 0.5 L_LM on MRPC pairs ("A <|endoftext|> B") == transformers'
    GPT2ForSequenceClassification loss + 0.5 * GPT2LMHeadModel's loss over one shared transformer."""
    model, tok = load(tiny_gpt2_dir)
    data, rows = glue_rows(data_dir, "mrpc", 100)
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("classify", data.labels, max_length=48))
    clf = transformers.GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir, num_labels=2,
                                                                      pad_token_id=tok.eot_id)
    lm = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir)
    lm.transformer = clf.transformer                               # one transformer, two heads
    lm.lm_head.weight = clf.transformer.wte.weight                 # still tied
    with torch.no_grad():
        clf.score.weight.copy_(ours.score.weight)
    both = torch.nn.ModuleDict({"clf": clf, "lm": lm}).train()
    feats = encode_examples(rows, tok, 48, data.labels)
    assert feats.truncated > 0                                     # long pairs were cut
    batches = TaskBatches(feats, seed=2)
    got = [r["loss"] for r in train(ours, sequence_objective("gpt2", "classify", lm_coef=0.5), batches, PARITY)["rows"]]

    def loss_of(b):
        real = torch.arange(b["idx"].shape[1]) <= b["last"][:, None]
        lm_labels = torch.where(real, b["idx"], -100)
        return clf(input_ids=b["idx"], labels=b["labels"]).loss + 0.5 * lm(input_ids=b["idx"], labels=lm_labels).loss

    ref = _reference_losses(PARITY, batches, both, loss_of)
    assert min(ref[-5:]) < ref[0]
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


# --- readers: GLUE layout, user files, and their errors ------------------------------------------------

from duolm.tasks.base import eval_batches, holdout  # noqa: E402
from duolm.tasks.glue import GLUE  # noqa: E402
from duolm.tasks.sentence import (Example, SentenceFeatures, label_space, load_user, read_examples, truncate_pair,  # noqa: E402
                                  write_submission)


def test_glue_train_files_read_as_published(data_dir):
    glue = data_dir / "glue"
    counts = {"cola": ("CoLA", 8551), "sst2": ("SST-2", 67349), "mrpc": ("MRPC", 3668), "rte": ("RTE", 2490),
              "stsb": ("STS-B", 5749)}
    for name, (folder, n) in counts.items():
        data = load_glue(name, glue / folder, splits=("train",))
        assert len(data.train) == n, name
    cola = load_glue("cola", glue / "CoLA", splits=("train",)).train
    assert cola[0].text_a == "Our friends won't buy this analysis, let alone the next one we propose."
    assert cola[0].label == "1" and cola[0].where.endswith("train.tsv:1")
    mrpc = load_glue("mrpc", glue / "MRPC", splits=("train",)).train     # header starts with a byte-order mark
    assert mrpc[0].label == "1" and mrpc[0].text_a.startswith("Amrozi accused his brother")
    assert '"the witness"' in mrpc[0].text_a                              # quotes are text in GLUE tsv
    stsb = load_glue("stsb", glue / "STS-B", splits=("train",))
    assert stsb.kind == "regress" and stsb.train[1].label == 3.8 and stsb.metrics[0] == "spearman"


def test_glue_holdout_is_the_end_of_train(data_dir):
    rte = load_glue("rte", data_dir / "glue" / "RTE", splits=("train", "dev"), dev_fraction=0.1)
    assert len(rte.train) == 2241 and len(rte.dev[""]) == 249
    assert rte.dev[""][-1].where.endswith("train.tsv:2491") and "last 249 examples" in rte.notes[0]
    with pytest.raises(FileNotFoundError, match=r"no dev.tsv; pass a dev fraction"):
        load_glue("rte", data_dir / "glue" / "RTE", splits=("train", "dev"))


def test_max_train_examples_keeps_the_first_after_the_holdout(minilm, data_dir):
    from duolm.tasks import Files, TaskOptions, prepare
    from duolm.tasks.sentence import encode
    tok = minilm[1]
    task = prepare("rte", tok, "bert", TaskOptions(dev_fraction=0.1, max_train_examples=100),
                   Files(data=data_dir / "glue" / "RTE"), 512)
    assert task.info["train"] == 100 and task.info["dev"] == {"dev": 249}   # the dev set is untouched
    assert "trained on the first 100 of 2241 training examples" in task.info["notes"]
    first = load_glue("rte", data_dir / "glue" / "RTE", splits=("train",)).train[0]
    assert task.train.ids[0] == encode([first], tok, task.head).ids[0]
    ner = prepare("conll2003", tok, "bert", TaskOptions(max_train_examples=50), Files(data=data_dir / "conll2003"), 512)
    assert ner.info["train"] == 50 and "trained on the first 50 of 14041 training sentences" in ner.info["notes"]
    with pytest.raises(ValueError, match="max_train_examples=-1 must be >= 0"):
        TaskOptions(max_train_examples=-1)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def mnli_dir(tmp_path):
    head = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n"
    rows = ["0\t1\t1a\tfiction\tA man sleeps.\tA man is awake.\tcontradiction\tcontradiction",
            "1\t2\t2a\tfiction\tA dog runs.\tAn animal moves.\tentailment\tentailment",
            "2\t3\t3a\tslate\tIt rains.\tThe sun shines somewhere.\tneutral\tneutral"]
    d = tmp_path / "MNLI"
    _write(d / "train.tsv", head + "\n".join(rows * 4) + "\n")
    _write(d / "dev_matched.tsv", head + "\n".join(rows) + "\n")
    _write(d / "dev_mismatched.tsv", head + "\n".join(rows[:2]) + "\n")
    test_head = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\n"
    _write(d / "test_matched.tsv", test_head + "0\t9\t9a\tslate\tA cat.\tAn animal.\n1\t8\t8a\tslate\tB.\tC.\n")
    _write(d / "test_mismatched.tsv", test_head + "7\t9\t9a\tslate\tA cat.\tAn animal.\n")
    return d


def test_glue_layout_with_dev_and_test_files(mnli_dir, tmp_path):
    data = load_glue("MNLI", mnli_dir)
    assert data.labels == ["contradiction", "entailment", "neutral"] and len(data.train) == 12
    assert {k: len(v) for k, v in data.dev.items()} == {"": 3, "mm_": 2}
    assert {k: [e.index for e in v] for k, v in data.test.items()} == {"MNLI-m.tsv": ["0", "1"], "MNLI-mm.tsv": ["7"]}
    out = write_submission(tmp_path / "MNLI-m.tsv", data.test["MNLI-m.tsv"], ["entailment", "neutral"])
    assert out.read_text() == "index\tprediction\n0\tentailment\n1\tneutral\n"
    assert set(GLUE) == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"}


def test_user_files_csv_tsv_jsonl(tmp_path):
    csv_file = _write(tmp_path / "train.csv", 'review,stars\n"good, really",5\nbad,1\n"so-so",3\nfine,5\n')
    data = load_user(csv_file, text="review", label="stars", dev_fraction=0.25)
    assert data.kind == "classify" and data.labels == ["1", "3", "5"] and data.train[0].text_a == "good, really"
    assert [e.label for e in data.dev[""]] == ["5"] and data.metrics == ("accuracy",)
    jsonl = _write(tmp_path / "t.jsonl", '{"a": "x", "b": "y", "y": 0.5}\n\n{"a": "p", "b": "q", "y": 2}\n')
    reg = load_user(jsonl, text="a", pair="b", label="y")
    assert reg.kind == "regress" and [e.label for e in reg.train] == [0.5, 2.0] and reg.train[1].text_b == "q"
    assert label_space([Example("a", label=v) for v in ("10", "2", "2")], "f") == ("classify", ["2", "10"])
    assert holdout(list(range(10)), 0.1) == (list(range(9)), [9])


def test_bad_input_is_a_clear_error_before_training(tmp_path, data_dir):
    with pytest.raises(ValueError, match=r"unknown task 'sst3'.*GLUE tasks: cola, sst2"):
        load_glue("sst3", tmp_path)
    f = _write(tmp_path / "a.csv", "text,label\nhello,pos\nbye,neg\n")
    with pytest.raises(ValueError, match=r"a\.csv: no text column 'review'; the columns are: text, label"):
        read_examples(f, "review", label="label")
    bad = _write(tmp_path / "b.tsv", "text\tlabel\nhello\tpos\nbye\tneg\textra\n")
    with pytest.raises(ValueError, match=r"b\.tsv line 3: 3 fields, the header has 2"):
        read_examples(bad, "text", label="label")
    dev = _write(tmp_path / "dev.csv", "text,label\nhm,maybe\n")
    with pytest.raises(ValueError, match=r"dev\.csv:2: label 'maybe' was not seen in training \(labels: neg, pos\)"):
        load_user(f, dev, label="label")
    empty = _write(tmp_path / "empty.csv", "text,label\n")
    with pytest.raises(ValueError, match=r"empty\.csv: no examples"):
        load_user(empty)
    mixed = _write(tmp_path / "mixed.csv", "text,label\na,1\nb,pos\nc,2\n")
    with pytest.raises(ValueError, match=r"mixed\.csv: the label column mixes numbers \('1' at .*:2\) and words "
                                         r"\('pos' at .*:3\)"):
        load_user(mixed)
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2: not valid JSON"):
        read_examples(_write(tmp_path / "bad.jsonl", '{"text": "a"}\n{"text": \n'), "text")
    with pytest.raises(ValueError, match=r"unknown format '\.txt'"):
        read_examples(_write(tmp_path / "x.txt", "a\n"), "text")
    with pytest.raises(ValueError, match=r"a\.csv: every example has the label 'pos'"):
        load_user(_write(tmp_path / "a.csv", "text,label\nhello,pos\nbye,pos\n"))


# --- features and batches -----------------------------------------------------------------------------

def test_bert_pairs_are_encoded_as_transformers(minilm, data_dir):
    _, tok = minilm
    _, rows = glue_rows(data_dir, "mrpc", 60)
    feats = encode_examples(rows, tok, 40, ["0", "1"])
    hf = transformers.BertTokenizerFast.from_pretrained(minilm_dir())
    ref = hf([e.text_a for e in rows], [e.text_b for e in rows], truncation=True, max_length=40)
    assert feats.ids == ref["input_ids"] and feats.segment_ids == ref["token_type_ids"]
    full = hf([e.text_a for e in rows], [e.text_b for e in rows])["input_ids"]
    assert feats.truncated == sum(len(x) > 40 for x in full) > 10
    assert feats.labels == [int(e.label) for e in rows]


def test_gpt_pairs_delimited_by_end_of_text_in_one_or_both_orders():
    tok = ByteLevelBPE.train(["the cat sat on the mat", "a dog ran"], vocab_size=300)
    eot = tok.eot_id
    a, b = tok.encode_ordinary("the cat sat"), tok.encode_ordinary("a dog <|endoftext|>")
    ex = [Example("the cat sat", "a dog <|endoftext|>", "1")]
    one = encode_examples(ex, tok, 100, ["0", "1"])
    assert one.ids == [a + [eot] + b] and one.truncated == 0 and eot not in b   # a typed special token is text
    both = encode_examples(ex, tok, 100, ["0", "1"], both_orders=True)
    assert both.ids == [(a + [eot] + b, b + [eot] + a)]
    cut = encode_examples(ex, tok, 7, ["0", "1"])
    n_a, n_b = truncate_pair(len(a), len(b), 6)
    assert cut.ids == [a[:n_a] + [eot] + b[:n_b]] and len(cut.ids[0]) == 7 and cut.truncated == 1
    batch = both.collate([0])
    assert batch["idx"].shape[:2] == (1, 2) and batch["last"].tolist() == [[len(a) + len(b), len(a) + len(b)]]
    y = batch["y"][0, 0]
    assert y[:-1].tolist() == (a + [eot] + b)[1:] and y[-1] == -100


def test_truncate_pair_worked_examples():
    assert truncate_pair(10, 4, 8) == (4, 4)
    assert truncate_pair(7, 6, 9) == (5, 4)
    assert truncate_pair(3, 9, 8) == (3, 5)
    assert truncate_pair(9, 0, 5) == (5, 0)


def _toy_features(n=103, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g).tolist()
    ids = [[101] + [1000 + i] * (L - 2) + [102] for i, L in enumerate(lengths)]
    return SentenceFeatures(ids, [[0] * len(x) for x in ids], [i % 2 for i in range(n)], pad_id=0)


def test_batches_are_a_pure_function_of_seed_and_step():
    feats = _toy_features()
    a, b = TaskBatches(feats, seed=3), TaskBatches(feats, seed=3)
    assert a.steps_per_epoch(8) == 12
    for step in (0, 5, 11, 12, 30, 5):                         # any order, any instance: the same rows
        assert torch.equal(a.batch(step, 8)["idx"], b.batch(step, 8)["idx"])
    seen = [int(r[0, 1]) - 1000 for s in range(12) for r in [a.batch(s, 8)["idx"][i:i + 1] for i in range(8)]]
    assert len(seen) == len(set(seen)) == 96                   # one epoch: each example at most once
    nxt = {int(x) - 1000 for s in range(12, 24) for x in a.batch(s, 8)["idx"][:, 1]}
    assert nxt != set(seen)                                    # a new permutation next epoch
    halves = [a.batch(7, 8, rank=r, world_size=2)["idx"] for r in (0, 1)]
    whole = a.batch(7, 8)["idx"]
    assert torch.equal(halves[0], whole[:4, :halves[0].shape[1]]) and torch.equal(halves[1][:, 1], whole[4:, 1])
    assert not torch.equal(TaskBatches(feats, seed=4).batch(0, 8)["idx"], whole)


def test_length_grouping_spends_compute_on_tokens():
    feats = _toy_features(n=2000)
    grouped = TaskBatches(feats, seed=0)
    real = sum(int(grouped.batch(s, 16)["attention_mask"].sum()) for s in range(125))
    padded = sum(grouped.batch(s, 16)["idx"].numel() for s in range(125))
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(2000, generator=g).tolist()
    random_padded = sum(feats.collate(perm[i:i + 16])["idx"].numel() for i in range(0, 2000, 16))
    assert real / padded > 0.9 and real / random_padded < 0.7


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_padding_never_changes_a_result(family, tiny_bert_dir, tiny_gpt2_dir, data_dir):
    model, tok = load(tiny_bert_dir if family == "bert" else tiny_gpt2_dir)
    _, rows = glue_rows(data_dir, "mrpc", 12)
    rows = [Example(e.text_a[:10 + 9 * i], e.text_b[:40 - 3 * i], e.label) for i, e in enumerate(rows)]
    torch.manual_seed(0)
    clf = attach_head(model, HeadConfig("classify", ["0", "1"], max_length=48)).eval()
    feats = encode_examples(rows, tok, 48, ["0", "1"], both_orders=family == "gpt2")
    objective = sequence_objective(family, "classify")

    def logits(batch):
        out = objective.forward(clf, batch)
        return out if family == "bert" else out[0]

    with torch.no_grad():
        alone = torch.cat([logits(feats.collate([i])) for i in range(len(rows))])
        together = torch.empty_like(alone)
        for index, batch in eval_batches(feats, 5):
            together[index] = logits(batch)
    assert len(set(feats.lengths().tolist())) > 3
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=0)


# --- checkpoints: native and transformers formats -----------------------------------------------------

from duolm.models.heads import BertForSequence, BertForSpans, BertForTokens, GPT2ForSequence  # noqa: E402


def _hf_logits(hf, idx, kind, family):
    with torch.no_grad():
        if family == "gpt2":
            return hf(input_ids=idx).logits
        out = hf(input_ids=idx, attention_mask=(idx != 0).long())
        return torch.stack([out.start_logits, out.end_logits], -1) if kind == "span" else out.logits


def _our_logits(model, idx, family):
    with torch.no_grad():
        if family == "gpt2":
            return model(idx, torch.full((idx.shape[0],), idx.shape[1] - 1))[0]
        out = model(idx, attention_mask=(idx != 0).long())
        return torch.stack(out, -1) if isinstance(out, tuple) else out


@pytest.mark.parametrize("family,kind,cls", [
    ("bert", "classify", "BertForSequenceClassification"), ("bert", "regress", "BertForSequenceClassification"),
    ("bert", "tag", "BertForTokenClassification"), ("bert", "span", "BertForQuestionAnswering"),
    ("gpt2", "classify", "GPT2ForSequenceClassification")])
def test_head_models_round_trip_through_transformers(family, kind, cls, tiny_bert_dir, tiny_gpt2_dir, tmp_path):
    labels = {"classify": ["neg", "pos", "mixed"], "tag": ["O", "B-PER", "I-PER"]}.get(kind, [])
    head = HeadConfig(kind, labels, task="mine")
    base, tok = load(tiny_gpt2_dir if family == "gpt2" else tiny_bert_dir)
    torch.manual_seed(0)
    model = attach_head(base, head).eval()
    idx = torch.randint(5, 300, (3, 12))
    idx[1, 8:] = 0 if family == "bert" else idx[1, 8:]
    ours = _our_logits(model, idx, family)

    out = save(model, tmp_path / "hf", tokenizer=tok, format="hf")
    hf = getattr(transformers, cls).from_pretrained(out).eval()
    if kind in ("classify", "tag"):
        assert hf.config.id2label == dict(enumerate(labels)) and hf.config.label2id == {n: i for i, n in enumerate(labels)}
    if kind == "regress":
        assert hf.config.problem_type == "regression" and hf.config.num_labels == 1
    torch.testing.assert_close(_hf_logits(hf, idx, kind, family), ours, atol=1e-5, rtol=0)

    for d in (out, save(model, tmp_path / "native", tokenizer=tok)):   # both formats load back as the head model
        again, _ = load(d)
        assert type(again) is type(model) and again.head.kind == kind and again.head.labels == labels
        torch.testing.assert_close(_our_logits(again, idx, family), ours, atol=1e-6, rtol=0)
    assert load(tmp_path / "native")[0].head == head                  # native keeps the whole head config
    assert isinstance(model, (BertForSequence, BertForTokens, BertForSpans, GPT2ForSequence))


# --- finetune() / predict() / evaluate() ---------------------------------------------------------------

import json  # noqa: E402
import statistics  # noqa: E402

import scipy.stats  # noqa: E402

from duolm.tasks import Files, TaskOptions, evaluate, load_finetuned, predict  # noqa: E402
from duolm.tasks.sentence import pair_scores, write_glue_predictions  # noqa: E402
from duolm.train.finetune import FINETUNE_LOOP, FinetuneConfig, finetune, summarize  # noqa: E402


def ft_config(**kw) -> FinetuneConfig:
    """A FinetuneConfig from flat fields, as the CLI's flags give them: the loop's and the inputs' go to
    config.loop and config.inputs."""
    own = {f.name for f in dataclasses.fields(FinetuneConfig)}
    loop = {k: kw.pop(k) for k in list(kw) if k not in own and k in {f.name for f in dataclasses.fields(TrainConfig)}}
    inputs = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(TaskOptions)}}
    return FinetuneConfig(loop=dataclasses.replace(FINETUNE_LOOP, **loop), inputs=TaskOptions(**inputs), **kw)


SST2_COLUMNS = dict(text_column="review", label_column="sentiment")


@pytest.fixture(scope="module")
def sst2_csv(data_dir, tmp_path_factory):
    """A user task made of real SST-2 rows: 96 to train on, 40 to validate on, words as labels."""
    _, rows = glue_rows(data_dir, "sst2", 136)
    d = tmp_path_factory.mktemp("sst2csv")
    for name, part in (("train.csv", rows[:96]), ("dev.csv", rows[96:])):
        lines = ["review,sentiment"] + ['"' + e.text_a.replace('"', '""') + '",' + ("pos" if e.label == "1" else "neg")
                                        for e in part]
        _write(d / name, "\n".join(lines) + "\n")
    return d


def test_finetune_seeds_results_and_best_model(tiny_bert_dir, sst2_csv, tmp_path, one_thread):
    cfg = ft_config(lr=1e-3, batch_size=16, epochs=2, max_length=32, seeds=2, dropout=0.0)
    started, rows = [], []
    res = finetune(tiny_bert_dir, "classify", tmp_path / "run", cfg,
                   Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS),
                   on_start=started.append, on_log=rows.append)
    info = started[0]
    assert info["labels"] == ["neg", "pos"] and info["train"] == 96 and info["dev"] == {"dev": 40}
    assert info["config"]["lr"] == 1e-3 and info["config"]["warmup"] == 0.1     # BERT's recipe filled in
    assert info["truncated"]["train"] > 0                                   # max_length 32 cut some reviews
    assert [r["run"] for r in res["runs"]] == ["seed-0", "seed-1"] and res["metric"] == "accuracy"
    acc = [r["metrics"]["accuracy"] for r in res["runs"]]
    assert res["mean"]["accuracy"] == pytest.approx(statistics.fmean(acc))
    assert res["std"]["accuracy"] == pytest.approx(statistics.stdev(acc))
    assert res["best"]["metrics"]["accuracy"] == max(acc)
    assert json.loads((tmp_path / "run" / "results.json").read_text())["mean"] == res["mean"]
    table = (tmp_path / "run" / "results.md").read_text()
    assert "| seed-1 |" in table and f"{100 * res['mean']['accuracy']:.2f} ± " in table
    assert [r["step"] for r in rows if "val_accuracy" in r] == [6, 12] * 2           # after each epoch
    assert [r["step"] for r in rows if "init_accuracy" in r] == [0, 0]              # the untrained baseline
    assert all(r["step"] > 0 for r in res["runs"])                                  # never selected

    model, tok = load_finetuned(tmp_path / "run")                            # run/best: the best seed's best epoch
    assert model.head.labels == ["neg", "pos"] and model.head.task == "classify"
    dev = Files(dev=sst2_csv / "dev.csv", **SST2_COLUMNS)
    assert evaluate(model, tok, dev)[0] == pytest.approx(res["best"]["metrics"], abs=1e-6)
    out = predict(model, tok, ["a gripping , well-acted film", "dull and lifeless " * 30])
    assert {o["label"] for o in out} <= {"neg", "pos"} and "truncated" not in out[0] and out[1]["truncated"]
    assert sum(out[0]["probabilities"].values()) == pytest.approx(1.0)


def test_finetune_resumes_exactly(tiny_bert_dir, sst2_csv, tmp_path, one_thread):
    cfg = ft_config(lr=1e-3, batch_size=16, epochs=2, max_length=24)
    files = Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS)
    whole = finetune(tiny_bert_dir, "classify", tmp_path / "a", cfg, files)

    def killed(row):
        if row["step"] == 8:
            raise KeyboardInterrupt                                          # after the epoch-1 checkpoint (6)
    with pytest.raises(KeyboardInterrupt):
        finetune(tiny_bert_dir, "classify", tmp_path / "b", cfg, files, on_log=killed)
    resumed = finetune(tiny_bert_dir, "classify", tmp_path / "b", cfg, files, resume=True)
    assert resumed["runs"][0]["metrics"] == whole["runs"][0]["metrics"]
    a, b = (load(tmp_path / d)[0].state_dict() for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_stops_every_run_and_resume_finishes(tiny_bert_dir, sst2_csv, tmp_path, one_thread):
    import os
    import signal

    cfg = ft_config(lr=1e-3, batch_size=16, epochs=1, max_length=16, seeds=2)
    files = Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS)

    def term(row):
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)          # train() finishes the step, saves, returns
    with pytest.raises(InterruptedError, match=r"stopped by SIGTERM at step 2 of .*seed-0 \(saved; --resume"):
        finetune(tiny_bert_dir, "classify", tmp_path / "r", cfg, files, on_log=term)
    assert not (tmp_path / "r" / "seed-1").exists()         # the next seed never started
    res = finetune(tiny_bert_dir, "classify", tmp_path / "r", cfg, files, resume=True)
    assert [r["step"] for r in res["runs"]] == [6, 6]


def test_gpt_finetune_with_lm_loss_and_both_orders(tiny_gpt2_dir, data_dir, tmp_path, one_thread):
    data, _ = glue_rows(data_dir, "stsb", 0)
    d = tmp_path / "STS-B"
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    lines = (data_dir / "glue" / "STS-B" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:81]
    _write(d / "train.tsv", head + "\n".join(lines) + "\n")
    cfg = ft_config(batch_size=8, epochs=1, max_length=40, both_orders=True, dev_fraction=0.2)
    rows = []
    res = finetune(tiny_gpt2_dir, "stsb", tmp_path / "run", cfg, Files(data=d), on_log=rows.append)
    assert res["config"]["lr"] == 6.25e-5 and res["config"]["lm_coef"] == 0.5     # GPT-1's recipe
    assert res["metric"] == "spearman" and set(res["mean"]) == {"spearman", "pearson", "loss"}
    assert "last 16 examples of train.tsv" in res["notes"][0]
    trained = [r for r in rows if "lm_loss" in r]
    assert len(trained) == 8 and all(r["loss"] == pytest.approx(r["task_loss"] + 0.5 * r["lm_loss"], rel=1e-5)
                                     for r in trained)
    model, tok = load_finetuned(tmp_path / "run")
    assert model.head.both_orders and model.head.kind == "regress"
    out = predict(model, tok, [("A man plays a guitar.", "A man is playing guitar.")])
    assert set(out[0]) == {"score"}
    # a GLUE task's file given with --dev is scored as it is, without the task's folder: STS-B's metrics of the
    # regressor's scores (pair_scores, what /v1/score answers) against scipy's
    unseen = (data_dir / "glue" / "STS-B" / "train.tsv").read_text(encoding="utf-8").splitlines()[81:141]
    dev = _write(tmp_path / "sts-dev.tsv", head + "\n".join(unseen) + "\n")
    got, _ = evaluate(model, tok, Files(dev=dev))
    examples = load_glue("stsb", None, ("dev",), dev_file=dev).dev[""]
    scores = [x["score"] for x in pair_scores(model, tok, [(e.text_a, e.text_b) for e in examples])]
    gold = [float(e.label) for e in examples]
    assert len(examples) == 60 and got["spearman"] == pytest.approx(scipy.stats.spearmanr(scores, gold)[0], abs=1e-9)
    assert got["pearson"] == pytest.approx(scipy.stats.pearsonr(scores, gold)[0], abs=1e-9)


def test_wrong_model_for_the_job_says_so(tiny_bert_dir, sst2_csv, tmp_path, minilm):
    with pytest.raises(ValueError, match="without a fine-tuning head; fine-tune it first"):
        load_finetuned(tiny_bert_dir)
    torch.manual_seed(0)
    clf = save(attach_head(load(tiny_bert_dir)[0], HeadConfig("classify", ["a", "b"])), tmp_path / "clf",
               tokenizer=minilm[1])
    with pytest.raises(ValueError, match="is already fine-tuned"):
        finetune(clf, "classify", tmp_path / "r", files=Files(train=sst2_csv / "train.csv"))
    with pytest.raises(ValueError, match="both_orders is GPT's way"):
        finetune(tiny_bert_dir, "classify", tmp_path / "r", ft_config(both_orders=True),
                 Files(train=sst2_csv / "train.csv"))
    model, tok = load(clf)
    with pytest.raises(ValueError, match=r"the model predicts classify \['a', 'b'\].*the data is classify"):
        evaluate(model, tok, Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS),
                 split="train")


def test_glue_submission_files(tiny_bert_dir, mnli_dir, tmp_path):
    torch.manual_seed(0)
    model, tok = load(tiny_bert_dir)
    labels = ["contradiction", "entailment", "neutral"]
    clf = attach_head(model, HeadConfig("classify", labels, task="mnli"))
    files = write_glue_predictions(clf, tok, mnli_dir, tmp_path / "sub")
    assert [f.name for f in files] == ["MNLI-m.tsv", "MNLI-mm.tsv"]
    lines = files[0].read_text().splitlines()
    assert lines[0] == "index\tprediction" and [x.split("\t")[0] for x in lines[1:]] == ["0", "1"]
    assert all(x.split("\t")[1] in labels for x in lines[1:])


def test_summarize_picks_the_rate_by_its_mean():
    runs = [{"run": f"lr-{lr}-seed-{s}", "lr": lr, "seed": s, "metrics": {"f1": f}}
            for lr, s, f in [(5e-5, 0, 0.9), (5e-5, 1, 0.5), (2e-5, 0, 0.8), (2e-5, 1, 0.8)]]
    res = summarize(runs, "f1")
    assert res["lr"] == 2e-5 and res["mean"]["f1"] == pytest.approx(0.8) and res["std"]["f1"] == 0.0
    assert res["best"]["lr"] == 2e-5 and res["result"] == res["mean"]
    best = summarize(runs, "f1", select="best")
    assert best["best"]["run"] == "lr-5e-05-seed-0" and best["result"] == {"f1": 0.9}


# --- the commands ---------------------------------------------------------------------------------------

def test_cli_finetune_predict_evaluate(tiny_bert_dir, sst2_csv, tmp_path, capsys, one_thread):
    from duolm.cli import main
    from duolm.precision import resolve

    run = tmp_path / "run"
    main(["finetune", str(tiny_bert_dir), "--task", "classify", "--train", str(sst2_csv / "train.csv"),
          "--dev", str(sst2_csv / "dev.csv"), "--text-column", "review", "--label-column", "sentiment",
          "-o", str(run), "--lr", "1e-3", "--batch-size", "16", "--epochs", "1", "--max-length", "24", "--quiet"])
    out = capsys.readouterr().out
    assert "classify (classify, labels neg pos), 96 train, 40 dev; 1 run(s) of 6 steps" in out
    assert "train input(s) longer than 24 tokens were cut" in out and "| mean ± std (1 seed) |" in out
    results = json.loads((run / "results.json").read_text())
    auto = resolve("auto", "cpu", training=True)               # resolved once, recorded where the run is described
    assert f"in {auto}" in out and results["precision"] == auto
    assert json.loads((run / "checkpoint.json").read_text())["precision"] == auto

    main(["evaluate", str(run), "--dev", str(sst2_csv / "dev.csv"), "--text-column", "review",
          "--label-column", "sentiment", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["accuracy"] == pytest.approx(results["best"]["metrics"]["accuracy"])

    pairs = _write(tmp_path / "in.txt", "a gripping , well-acted film\nflat\tand dull\n")
    main(["predict", str(run), "--file", str(pairs), "-o", str(tmp_path / "pred.tsv")])
    lines = (tmp_path / "pred.tsv").read_text().splitlines()
    assert [line.split("\t")[:-2] for line in lines] == [["a gripping , well-acted film"], ["flat", "and dull"]]
    assert all(line.split("\t")[-2] in ("neg", "pos") for line in lines)
    capsys.readouterr()
    main(["predict", str(run), "fine", "--json"])
    (pred,) = json.loads(capsys.readouterr().out)
    assert pred["input"] == "fine" and set(pred["prediction"]["probabilities"]) == {"neg", "pos"}


def test_cli_errors_are_one_line(tiny_bert_dir, sst2_csv, tmp_path, capsys):
    from duolm.cli import main

    cases = [(["finetune", str(tiny_bert_dir), "--task", "sst9", "--data", str(tmp_path), "-o", str(tmp_path / "r")],
              "unknown task 'sst9'"),
             (["finetune", str(tiny_bert_dir), "--task", "classify", "--train", str(sst2_csv / "train.csv"),
               "-o", str(tmp_path / "r")], "no text column 'text'; the columns are: review, sentiment"),
             (["predict", str(tiny_bert_dir), "hello"], "without a fine-tuning head")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("duolm: error: ") and message in err and err.count("\n") == 1


def test_a_constant_dev_score_is_refused_before_training(tiny_bert_dir, data_dir, tmp_path, capsys):
    """Spearman's correlation with a constant is undefined: a dev set whose scores are all equal once trained for
    nothing and reported "spearman nan"; now one line at the start (embedding pairs and regression alike)."""
    from duolm.cli import main
    from duolm.metrics import spearman
    from duolm.tasks.base import check_varied

    assert math.isnan(spearman([0.1, 0.7, 0.3], [2.0, 2.0, 2.0]))
    with pytest.warns(scipy.stats.ConstantInputWarning):
        assert math.isnan(scipy.stats.spearmanr([0.1, 0.7, 0.3], [2.0, 2.0, 2.0]).statistic)
    check_varied([2.0, 2.0, 2.5], "dev.tsv")
    with pytest.raises(ValueError, match=r"^dev\.tsv: the 3 dev scores are all 2: a constant dev score has no rank"):
        check_varied([2.0, 2.0, 2.0], "dev.tsv")

    rows = [r.split("\t") for r in (data_dir / "glue" / "STS-B" / "train.tsv").read_text(encoding="utf-8").splitlines()]
    s1, s2 = rows[0].index("sentence1"), rows[0].index("sentence2")
    pairs = _write(tmp_path / "pairs.tsv", "anchor\tpositive\n" + "".join(f"{r[s1]}\t{r[s2]}\n" for r in rows[1:20]))
    flat = _write(tmp_path / "flat.tsv", "sentence1\tsentence2\tscore\n"
                  + "".join(f"{r[s1]}\t{r[s2]}\t0.6\n" for r in rows[20:30]))
    regress = _write(tmp_path / "regress.csv", "text,label\nit was fine,0.5\ngreat,2.5\ndull,1.0\n")
    flat_regress = _write(tmp_path / "flat.csv", "text,label\nok,1.5\nfine,1.5\n")
    for argv, message in (
            (["--task", "embedding", "--train", str(pairs), "--dev", str(flat)],
             f"{flat}: the 10 dev scores are all 0.6: a constant dev score has no rank correlation"),
            (["--task", "embedding", "--train", str(flat), "--dev-fraction", "0.5"],
             f"{flat} (its held-out end): the 5 dev scores are all 0.6"),
            (["--task", "regress", "--train", str(regress), "--dev", str(flat_regress)],
             f"{flat_regress}: the 2 dev scores are all 1.5")):
        with pytest.raises(SystemExit) as e:
            main(["finetune", str(tiny_bert_dir), *argv, "--batch-size", "2", "--epochs", "1", "-o", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"duolm: error: {message}") and err.count("\n") == 1
        assert not (tmp_path / "run").exists()                   # refused before a run was made


def test_glue_suite_and_the_papers_table(tiny_bert_dir, data_dir, tmp_path, one_thread):
    from duolm.train.finetune import finetune_glue, glue_table

    lines = (data_dir / "glue" / "RTE" / "train.tsv").read_text(encoding="utf-8").splitlines()[:41]
    _write(tmp_path / "GLUE" / "RTE" / "train.tsv", "\n".join(lines) + "\n")
    cfg = ft_config(batch_size=8, epochs=1, max_length=32, dev_fraction=0.2)
    res = finetune_glue(tiny_bert_dir, tmp_path / "GLUE", tmp_path / "runs", cfg)
    assert list(res) == ["rte"] and (tmp_path / "runs" / "rte" / "results.json").is_file()
    table = (tmp_path / "runs" / "glue.md").read_text().splitlines()
    assert table[0] == "| | RTE | Average |" and table[3] == "| BERT-base (paper, test) | 66.4 | 66.4 |"
    assert table[2] == f"| duolm (dev) | {100 * res['rte']['result']['accuracy']:.1f} | " \
                       f"{100 * res['rte']['result']['accuracy']:.1f} |"
    two = glue_table({"mrpc": {"metric": "f1", "result": {"f1": 0.88}},
                      "mnli": {"metric": "accuracy", "result": {"accuracy": 0.80, "mm_accuracy": 0.81}}})
    assert two.splitlines()[0] == "| | MNLI | MNLI-MM | MRPC | Average |"
    assert two.splitlines()[2] == "| duolm (dev) | 80.0 | 81.0 | 88.0 | 83.0 |"        # (80 + 81 + 88) / 3
    assert two.splitlines()[3] == "| BERT-base (paper, test) | 84.6 | 83.4 | 88.9 | 85.6 |"


def test_seeds_in_parallel_processes_give_the_same_runs(tiny_bert_dir, sst2_csv, tmp_path):
    files = Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS)
    cfg = ft_config(lr=1e-3, batch_size=32, epochs=1, max_length=16, seeds=2)
    one = finetune(tiny_bert_dir, "classify", tmp_path / "one", cfg, files)
    two = finetune(tiny_bert_dir, "classify", tmp_path / "two", dataclasses.replace(cfg, jobs=2), files)
    assert [r["seed"] for r in two["runs"]] == [0, 1] and (tmp_path / "two" / "seed-1" / "best").is_dir()
    for a, b in zip(one["runs"], two["runs"]):
        assert b["metrics"] == pytest.approx(a["metrics"], abs=1e-5) and a["step"] == b["step"]


def test_finetune_under_torchrun_fsdp_is_one_process(tiny_bert_dir, sst2_csv, tmp_path, one_thread):
    """`duolm finetune --parallel fsdp` under torchrun on 2 processes (gloo, fp32): a tiny BERT's losses, dev
    metrics and best model are one process's within 1e-5; rank 0 alone reports (one JSON object) and writes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from duolm.runs import read_metrics

    files = Files(train=sst2_csv / "train.csv", dev=sst2_csv / "dev.csv", **SST2_COLUMNS)
    one = finetune(tiny_bert_dir, "classify", tmp_path / "one",
                   ft_config(lr=1e-3, batch_size=16, epochs=1, max_length=24, dropout=0.0, precision="fp32"), files)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "duolm",
           "finetune", str(tiny_bert_dir), "--task", "classify", "--train", str(files.train), "--dev", str(files.dev),
           "--text-column", "review", "--label-column", "sentiment", "-o", str(tmp_path / "fsdp"), "--lr", "1e-3",
           "--batch-size", "16", "--epochs", "1", "--max-length", "24", "--dropout", "0", "--precision", "fp32",
           "--parallel", "fsdp", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    two = json.loads(p.stdout)                                       # one line: rank 1 printed nothing
    assert two["best"]["metrics"] == pytest.approx(one["best"]["metrics"], abs=1e-5) and two["best"]["step"] == 6
    losses = [[r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r] for run in ("one", "fsdp")]
    assert len(losses[1]) == 6 and losses[1] == pytest.approx(losses[0], abs=1e-5, rel=0)
    (a, _), (b, _) = load(tmp_path / "one" / "best"), load(tmp_path / "fsdp" / "best")    # gathered whole on rank 0
    wa, wb = a.state_dict(), b.state_dict()
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-5, rtol=0) for k in wa)
