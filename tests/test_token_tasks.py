"""Token-level fine-tuning (NER tagging, SQuAD span QA): heads against transformers step by step, readers and
their errors, features (first-piece labels, document context, windows with max context), answers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from duolm.checkpoint import load
from duolm.models.heads import HeadConfig, attach_head
from duolm.objectives import IGNORE
from duolm.tasks import TaskBatches, span, tagging
from duolm.tasks.base import max_context, max_context_table, windows
from duolm.tasks.span import SpanFeatures, read_squad, span_features
from duolm.tasks.tagging import Sentence, read_conll, tag_features, tag_scheme, word_pieces
from duolm.train import TrainConfig, train
from test_finetune import _reference_losses, minilm_dir

transformers = pytest.importorskip("transformers")

STEPS = TrainConfig(max_steps=20, batch_size=4, lr=1e-4, warmup_steps=2, decay="linear", weight_decay=0.01,
                    betas=(0.9, 0.999), eps=1e-6, grad_clip=1.0, eval_every=0, precision="fp32")   # as the reference


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


@pytest.fixture(scope="module")
def conll(data_dir):
    return read_conll(data_dir / "conll2003" / "eng.train")


@pytest.fixture(scope="module")
def squad(data_dir):
    return read_squad(data_dir / "squad" / "dev-v1.1-articles-01-24.json")[0]


def test_tagger_trains_as_transformers(minilm, conll):
    """MiniLM as our BertForTokens and as BertForTokenClassification: same head, batches, AdamW: 20 steps equal."""
    model, tok = minilm
    labels = sorted({t for s in conll for t in s.tags})
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("tag", labels), dropout=0.0)
    hf = transformers.BertForTokenClassification.from_pretrained(
        minilm_dir(), num_labels=len(labels), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.fc.weight)
        hf.classifier.bias.copy_(ours.fc.bias)
    batches = TaskBatches(tag_features(conll[:200], tok, labels, max_length=32), seed=0)
    got = [r["loss"] for r in train(ours, tagging.objective("bert", ours.head), batches, STEPS)["rows"]]
    hf.train()
    ref = _reference_losses(STEPS, batches, hf, lambda b: hf(
        input_ids=b["idx"], attention_mask=b["attention_mask"], token_type_ids=b["segment_ids"], labels=b["labels"]).loss)
    assert min(ref[-5:]) < ref[0] - 0.5
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


def _full_windows(f: SpanFeatures, length: int) -> SpanFeatures:
    keep = [i for i, x in enumerate(f.ids) if len(x) == length and f.start[i] > 0]
    return dataclasses.replace(f, **{k.name: [getattr(f, k.name)[i] for i in keep] for k in dataclasses.fields(f)
                                     if isinstance(getattr(f, k.name), list) and k.name != "cut"})


def test_span_head_trains_as_transformers(minilm, squad):
    """MiniLM as our BertForSpans and as BertForQuestionAnswering (windows without padding: transformers' loss
    counts padded positions, ours leaves them out): 20 steps equal."""
    model, tok = minilm
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("span"), dropout=0.0)
    hf = transformers.BertForQuestionAnswering.from_pretrained(
        minilm_dir(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.qa_outputs.weight.copy_(ours.fc.weight)
        hf.qa_outputs.bias.copy_(ours.fc.bias)
    feats = _full_windows(span_features(squad[:300], tok, max_length=48, stride=16), 48)
    assert len(feats) >= 100
    batches = TaskBatches(feats, seed=0)
    got = [r["loss"] for r in train(ours, span.objective("bert", ours.head), batches, STEPS)["rows"]]
    hf.train()
    ref = _reference_losses(STEPS, batches, hf, lambda b: hf(
        input_ids=b["idx"], attention_mask=b["attention_mask"], token_type_ids=b["segment_ids"],
        start_positions=b["start"], end_positions=b["end"]).loss)
    assert min(ref[-5:]) < ref[0] - 0.5
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


# --- readers ----------------------------------------------------------------------------------------------

def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_conll_files_read_as_published(conll, data_dir):
    assert len(conll) == 14041 and sum(len(s.words) for s in conll) == 203621 and conll[-1].doc == 946
    assert conll[0].words[:3] == ["EU", "rejects", "German"] and conll[0].tags[:3] == ["I-ORG", "O", "I-MISC"]
    assert conll[0].where.endswith("eng.train:3") and tag_scheme(conll) == "IOB1"
    testa = read_conll(data_dir / "conll2003" / "eng.testa")
    assert len(testa) == 3250 and sum(len(s.words) for s in testa) == 51362


def test_tag_schemes_and_bad_conll_files(tmp_path):
    sent = lambda *tags: Sentence(["w"] * len(tags), list(tags), where="f:1")       # noqa: E731
    assert tag_scheme([sent("O", "I-PER", "I-PER")]) == "IOB1"
    assert tag_scheme([sent("B-PER", "I-PER", "O", "B-LOC")]) == "IOB2"
    assert tag_scheme([sent("S-PER", "O", "B-LOC", "E-LOC")]) == "IOBES"
    with pytest.raises(ValueError, match=r"f:1: tag 'PER' is not O or B-/I-/E-/S-<type>: unknown tag scheme"):
        tag_scheme([sent("O", "PER")])
    bad = _write(tmp_path / "bad.conll", "-DOCSTART- -X- O O\n\nEU NNP I-NP I-ORG\nrejects VBZ I-VP\n")
    with pytest.raises(ValueError, match=r"bad\.conll line 4: 3 columns, expected 4"):
        read_conll(bad)
    with pytest.raises(ValueError, match=r"empty\.conll: no sentences"):
        read_conll(_write(tmp_path / "empty.conll", "-DOCSTART- -X- O O\n\n"))
    two = read_conll(_write(tmp_path / "two.txt", "Hi O\n\n-DOCSTART- O\n\nBob B-PER\nruns O\n"))
    assert [(s.words, s.tags, s.doc) for s in two] == [(["Hi"], ["O"], 0), (["Bob", "runs"], ["B-PER", "O"], 1)]


def test_squad_files_and_their_problems(squad, tmp_path):
    assert len(squad) == 5696 and len({q.title for q in squad}) == 24
    assert squad[0].answers[0] == "Denver Broncos" and squad[0].context[177:191] == "Denver Broncos"
    doc = {"data": [{"title": "T", "paragraphs": [{"context": "Bob runs fast.", "qas": [
        {"id": "1", "question": "Who runs?", "answers": [{"text": "Bob", "answer_start": 0},
                                                         {"text": "Bob", "answer_start": 4}]}]}]}]}
    import json
    qs, problems = read_squad(_write(tmp_path / "s.json", json.dumps(doc)))
    assert qs[0].answers == ["Bob"] and problems == [f"{tmp_path / 's.json'}: question 1: answer 'Bob' is not at "
                                                     f"answer_start 4"]
    with pytest.raises(ValueError, match=r"not a SQuAD file"):
        read_squad(_write(tmp_path / "x.json", '{"version": "1.1"}'))
    doc["data"][0]["paragraphs"][0]["qas"][0]["question"] = "  "
    with pytest.raises(ValueError, match=r"paragraphs\[0\]: question 1 is empty"):
        read_squad(_write(tmp_path / "q.json", json.dumps(doc)))
    doc["data"][0]["paragraphs"][0]["context"] = ""
    with pytest.raises(ValueError, match=r"the context is empty"):
        read_squad(_write(tmp_path / "c.json", json.dumps(doc)))


# --- features ---------------------------------------------------------------------------------------------

def test_first_piece_labels_as_transformers_word_ids(minilm, conll):
    model, tok = minilm
    hf = transformers.BertTokenizerFast.from_pretrained(minilm_dir())
    labels = sorted({t for s in conll for t in s.tags})
    sents = conll[:300]
    f = tag_features(sents, tok, labels, max_length=512)
    assert len(f) == len(sents)
    for s, ids, lab, where in zip(sents, f.ids, f.labels, f.where):
        enc = hf(s.words, is_split_into_words=True)
        assert ids == enc["input_ids"]
        words = enc.word_ids()
        want = [IGNORE if w is None or (i and words[i - 1] == w) else labels.index(s.tags[w])
                for i, w in enumerate(words)]
        assert lab == want and [lab[p] for _, p in where] == [labels.index(t) for t in s.tags]
    assert word_pieces(tok, ["U.S.", "Hi\u200b", "\u200b"]) == [tok.encode("U.S.")[1:-1], tok.encode("Hi")[1:-1], []]


def test_long_sentences_are_windows_each_word_labelled_where_it_has_most_context(minilm):
    """21 one-piece words, 10 pieces a window, starts 5 apart: windows [0, 10) [5, 15) [10, 20) [15, 21). Worked by
    hand, score = min(left, right) + 0.01 * length: piece 7 ties 2.1 / 2.1 (the earlier window), piece 12 too;
    piece 17 scores 2.1 in [10, 20) and 2.06 in the shorter [15, 21) (the 0.01 x length term decides)."""
    _, tok = minilm
    s = Sentence(["hello"] * 20 + ["world"], ["O"] * 20 + ["B-LOC"])
    f = tag_features([s], tok, ["B-LOC", "O"], max_length=12)                   # stride: half the window, 5
    assert [len(x) for x in f.ids] == [12, 12, 12, 8] and f.cut == []
    owner = [0] * 8 + [1] * 5 + [2] * 5 + [3] * 3
    start = [0, 5, 10, 15]
    assert max_context_table(windows(21, 10, 5), 21) == owner
    assert f.where == [[(r, p - start[r] + 1) for p, r in enumerate(owner)]]
    assert [[x for x in lab if x != IGNORE] for lab in f.labels] == [[1] * 8, [1] * 5, [1] * 5, [1, 1, 0]]


def test_document_context_windows_the_document(minilm):
    _, tok = minilm
    doc = [Sentence(w.split(), ["O"] * len(w.split()), doc=d) for w, d in
           [("one two three", 1), ("four five", 1), ("six seven eight nine", 1), ("ten", 2)]]
    labels = ["O"]
    text = lambda ids: tok.decode(ids, skip_special=True)                         # noqa: E731
    wide = tag_features(doc, tok, labels, max_length=16, context="document")
    assert [text(x) for x in wide.ids] == ["one two three four five six seven eight nine", "ten"]
    assert wide.where[1] == [(0, 4), (0, 5)] and wide.where[3] == [(1, 1)]
    # 6 pieces a window, starts 3 apart: [0, 6) [3, 9); "four" (3) and "five" (4, a tie) in the first, "six" in the second
    narrow = tag_features(doc, tok, labels, max_length=8, context="document")
    assert [text(x) for x in narrow.ids] == ["one two three four five six", "four five six seven eight nine", "ten"]
    assert narrow.where[1] == [(0, 4), (0, 5)] and narrow.where[2] == [(1, 3), (1, 4), (1, 5), (1, 6)]
    assert sum(x != IGNORE for lab in narrow.labels for x in lab) == 10                 # every word once


def test_windows_and_max_context_worked_examples():
    assert windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert windows(3, 4, 3) == [(0, 3)]
    assert windows(300, 128, 128) == [(0, 128), (128, 128), (256, 44)]
    spans = [(0, 4), (3, 4), (6, 4)]
    # piece 3: window 0 gives min(3, 0) = 0, window 1 gives min(0, 3) = 0: a tie goes to the earlier window
    assert [max_context(spans, i, 3) for i in range(3)] == [True, False, False]
    # piece 4: window 1 (min(1, 2) = 1) beats window 0 (min(4, -1)... not inside) and window 2 (not inside)
    assert [max_context(spans, i, 4) for i in range(3)] == [False, True, False]
    assert [max_context(spans, i, 7) for i in range(3)] == [False, False, True]


def test_span_features_find_the_answers(minilm, squad):
    _, tok = minilm
    qs = squad[:200]
    f = span_features(qs, tok, max_length=128, stride=64)
    assert len(f) > len(qs)                                    # long contexts make several windows
    for r in range(len(f)):
        q = qs[f.question[r]]
        assert len(f.ids[r]) <= 128 and f.segment_ids[r].count(0) == f.segment_ids[r].index(1)
        if f.start[r]:
            a = f.offsets[r][f.start[r]][0]
            b = f.offsets[r][f.end[r]][1]
            assert a <= q.starts[0] and b >= q.starts[0] + len(q.answers[0])
            assert q.context[a:b].lower().strip() == q.answers[0].lower().strip() or len(q.context[a:b]) <= \
                len(q.answers[0]) + 6                       # a piece may hold a bit more than the answer ("1990s")
    scored = {}
    for r in range(len(f)):
        for t, ok in enumerate(f.max_context[r]):
            if ok:
                scored.setdefault((f.question[r], f.offsets[r][t]), 0)
                scored[(f.question[r], f.offsets[r][t])] += 1
    assert set(scored.values()) == {1}                         # each context piece is scored in one window
    found = sum(1 for qi in set(f.question) if any(f.start[r] for r in range(len(f)) if f.question[r] == qi))
    assert found == len(qs)                                    # every answer is inside some window


# --- finetune() / predict() / evaluate on token tasks -------------------------------------------------------

import json  # noqa: E402

from duolm.tasks import Files, TaskOptions, evaluate, load_finetuned, predict  # noqa: E402
from duolm.train.finetune import finetune  # noqa: E402
from test_finetune import ft_config, tiny_bert_dir  # noqa: E402,F401


@pytest.fixture(scope="module")
def conll_dir(data_dir, tmp_path_factory):
    """eng.train / eng.testa cut to their first documents."""
    d = tmp_path_factory.mktemp("conll")
    for name, n in (("eng.train", 1200), ("eng.testa", 400)):
        lines = (data_dir / "conll2003" / name).read_text(encoding="utf-8").splitlines()[:n]
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def test_ner_run_with_document_context(tiny_bert_dir, conll_dir, data_dir, tmp_path, one_thread, capsys):
    cfg = ft_config(lr=1e-3, batch_size=16, epochs=2, max_length=48, context="document")
    res = finetune(tiny_bert_dir, "conll2003", tmp_path / "ner", cfg, Files(data=conll_dir))
    assert res["kind"] == "tag" and res["metric"] == "f1" and res["labels"][0] == "O"
    assert set(res["labels"]) >= {"I-PER", "I-LOC", "I-ORG", "I-MISC", "O"} and res["notes"][-1] == "tag scheme IOB1"
    assert set(res["mean"]) == {"f1", "precision", "recall"} and res["config"]["lr"] == 1e-3
    model, tok = load_finetuned(tmp_path / "ner")
    dev = read_conll(conll_dir / "eng.testa")
    got = tagging.score(model, tok, dev, tag_features(dev, tok, model.head.labels, 48, "document"))
    assert got["f1"] == pytest.approx(res["best"]["metrics"]["f1"])
    text = "Angela Merkel visited Paris on Monday."
    (got,) = predict(model, tok, [text])
    ents = got["entities"]
    assert all(text[e["start"]:e["end"]] == e["text"] and e["type"] in ("PER", "LOC", "ORG", "MISC") for e in ents)
    from duolm.cli import main
    main(["predict", str(tmp_path / "ner"), text])                  # the text, then each entity
    assert capsys.readouterr().out == text + "\t" + "  ".join(
        f"{e['type']} {e['text']!r} [{e['start']}:{e['end']}] {e['score']:.3f}" for e in ents) + "\n"
    with pytest.raises(SystemExit):
        main(["predict", str(tmp_path / "ner"), text, text, "--pairs"])
    assert "a tagger takes texts, not pairs" in capsys.readouterr().err

    # `duolm evaluate --dev FILE` scores the file as it is, with no --data (eng.testb, say): here the next lines of
    # eng.testa, against seqeval's conlleval-mode F1 of the same predictions; and eng.testa as the folder gives it
    other = tmp_path / "other.conll"
    other.write_text("\n".join((data_dir / "conll2003" / "eng.testa").read_text(encoding="utf-8").splitlines()[400:900])
                     + "\n", encoding="utf-8")
    main(["evaluate", str(tmp_path / "ner"), "--dev", str(other), "--json"])
    got = json.loads(capsys.readouterr().out)
    sents = read_conll(other)
    seqeval = pytest.importorskip("seqeval.metrics")
    gold, pred = [s.tags for s in sents], tagging.predict_tags(model, tok, sents)[0]
    want = seqeval.classification_report(gold, pred, output_dict=True, zero_division=0)
    assert got["task"] == "conll2003" and got["f1"] == pytest.approx(want["micro avg"]["f1-score"], abs=1e-9)
    assert {t: x["support"] for t, x in got["per_type"].items()} == {t: want[t]["support"] for t in got["per_type"]}
    assert sum(x["support"] for x in got["per_type"].values()) == want["micro avg"]["support"] > 50
    main(["evaluate", str(tmp_path / "ner"), "--dev", str(conll_dir / "eng.testa"), "--json"])
    assert json.loads(capsys.readouterr().out)["f1"] == evaluate(model, tok, Files(data=conll_dir))[0]["f1"]
    # --context document scores as validation did during the run (the same windows of each document)
    main(["evaluate", str(tmp_path / "ner"), "--data", str(conll_dir), "--context", "document", "--json"])
    assert json.loads(capsys.readouterr().out)["f1"] == pytest.approx(res["best"]["metrics"]["f1"])
    other.write_text("Bob B-FOO\nruns O\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["evaluate", str(tmp_path / "ner"), "--dev", str(other)])
    assert "other.conll:1: tag 'B-FOO' was not seen in training" in capsys.readouterr().err


def test_predicted_entities_are_conlleval_chunks_of_words(minilm):
    """The words and character spans predict() works with: BERT's split of the text, chunks by conlleval."""
    _, tok = minilm
    text = "Angela  Merkel's visit (to Paris-Nord) on Monday."
    spans = tagging._words(tok, text)
    assert [text[a:b] for a, b in spans] == ["Angela", "Merkel", "'", "s", "visit", "(", "to", "Paris", "-", "Nord",
                                             ")", "on", "Monday", "."]


def test_squad_run_split_by_article(tiny_bert_dir, squad, tmp_path, one_thread):
    doc = json.loads((data_dir_path() / "squad" / "dev-v1.1-articles-01-24.json").read_text(encoding="utf-8"))
    doc["data"] = [{**a, "paragraphs": a["paragraphs"][:2]} for a in doc["data"][:5]]
    small = tmp_path / "five.json"
    small.write_text(json.dumps(doc), encoding="utf-8")
    cfg = ft_config(lr=1e-3, batch_size=16, epochs=1, max_length=96, stride=48, dev_fraction=0.2)
    res = finetune(tiny_bert_dir, "squad", tmp_path / "qa", cfg, Files(train=small))
    assert res["kind"] == "span" and res["metric"] == "f1" and set(res["mean"]) == {"f1", "exact_match"}
    held = doc["data"][4]["title"]                                     # 20% of 5 articles: the last one
    assert res["notes"][0].startswith(f"articles {held} of ") and res["dev"] == {"dev": sum(
        len(p["qas"]) for p in doc["data"][4]["paragraphs"])}
    assert 0 <= res["mean"]["f1"] <= 1
    model, tok = load_finetuned(tmp_path / "qa")
    context = "The Broncos beat the Panthers. " * 40_000                                    # 1.2 million characters
    (ans,) = predict(model, tok, [("Who beat the Panthers?", context)])
    assert context[ans["start"]:ans["end"]] == ans["answer"] and ans["end"] - ans["start"] < 400
    with pytest.raises(ValueError, match=r"input 0: a question answerer takes \(question, context\) pairs"):
        predict(model, tok, [("", "context")])


def test_squad_v2_no_answer_threshold_chosen_on_dev(tiny_bert_dir, tmp_path, capsys, one_thread):
    """SQuAD v2.0: questions moved to another article's paragraph (is_impossible, their answer elsewhere) are
    trained to point at [CLS]; the dev-chosen no-answer threshold is saved with best/ and predict / evaluate
    answer with it."""
    doc = json.loads((data_dir_path() / "squad" / "dev-v1.1-articles-01-24.json").read_text(encoding="utf-8"))
    data = [{**a, "paragraphs": [dict(p, qas=list(p["qas"])) for p in a["paragraphs"][:2]]} for a in doc["data"][:5]]
    for i, a in enumerate(data):                                  # a third of the questions, into the next article
        donor = data[(i + 1) % len(data)]["paragraphs"][0]
        moved = donor["qas"][::3]
        donor["qas"] = [q for q in donor["qas"] if q not in moved]
        a["paragraphs"][1]["qas"] += [{**q, "id": q["id"] + "-x", "is_impossible": True, "answers": [],
                                       "plausible_answers": q["answers"]} for q in moved]
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps({"version": "v2.0", "data": data}), encoding="utf-8")
    questions, _ = read_squad(v2)
    impossible = [q for q in questions if q.impossible]
    assert impossible and all(q.answers == [] and q.id.endswith("-x") for q in impossible)

    # dropout off: which answers come out of 2 epochs of a tiny model must not hang on the masks' random draws
    cfg = ft_config(lr=1e-3, batch_size=16, epochs=2, max_length=96, stride=48, dev_fraction=0.2, dropout=0.0)
    res = finetune(tiny_bert_dir, "squad", tmp_path / "qa", cfg, Files(train=v2))
    train_no_answer = sum(q.impossible for q in questions if q.title != data[4]["title"])
    assert f"SQuAD v2.0: {train_no_answer} training questions without an answer" in " ".join(res["notes"])
    model, tok = load_finetuned(tmp_path / "qa")
    threshold = model.head.null_threshold
    assert isinstance(threshold, float)
    dev = [q for q in questions if q.title == data[4]["title"]]
    scores, _ = evaluate(model, tok, Files(data=v2), options=TaskOptions(dev_fraction=0.2))  # x 100, same threshold, fp32
    assert scores == pytest.approx({k: 100 * v for k, v in res["best"]["metrics"].items()} | {"null_threshold": threshold})
    raw = span.answer_questions(model, tok, dev)
    got = predict(model, tok, [(q.question, q.context) for q in dev])
    for q, g in zip(dev, got):
        empty = raw[q.id]["null_odds"] > threshold
        assert (g["answer"], g["start"]) == (("", None) if empty else (raw[q.id]["text"], raw[q.id]["start"]))
    assert 0 < sum(g["answer"] == "" for g in got) < len(got)               # both kinds of answer occur
    from duolm.cli import main
    q = next(q for q, g in zip(dev, got) if g["answer"] == "")
    (tmp_path / "context.txt").write_text(q.context, encoding="utf-8")
    main(["predict", str(tmp_path / "qa"), "--question", q.question, "--context", str(tmp_path / "context.txt")])
    assert capsys.readouterr().out.split("\t")[1:3] == ["", "(no answer)"]


def data_dir_path():
    from conftest import DATA
    return DATA


def test_max_context_table_is_the_plain_rule():
    for n, room, stride in [(10, 4, 3), (300, 128, 128), (1000, 61, 17), (50, 50, 10), (7, 3, 1)]:
        spans = windows(n, room, stride)
        owner = max_context_table(spans, n)
        assert all(max_context(spans, owner[p], p) for p in range(n))
        assert all(max_context(spans, i, p) == (owner[p] == i) for i in range(len(spans)) for p in range(n))


def test_entities_equal_the_token_classification_pipeline(tiny_bert_dir, data_dir, tmp_path):
    """Our predict() and transformers' pipeline("token-classification", aggregation_strategy="first") on the same
    exported tagger give the same entities (type, character span, score) on 250 texts: CoNLL sentences and text
    with punctuation. (The head is a seeded random layer: the tags are arbitrary, which exercises the grouping
    rules on many more entities than a trained model would produce.)"""
    from duolm.checkpoint import save
    model, tok = _random_tagger(tiny_bert_dir)
    out = save(model, tmp_path / "hf", tokenizer=tok, format="hf")
    pipe = transformers.pipeline("token-classification", model=str(out), aggregation_strategy="first", device="cpu")
    texts = [" ".join(s.words) for s in read_conll(data_dir / "conll2003" / "eng.testa")[:240]]
    texts += ["Angela Merkel visited Paris-Nord on Monday.", "U.S. stocks (NYSE: IBM) fell 3.5%!", "Dr. Smith's cat.",
              "Café Müller, Zürich.", "x", "New York-based Acme Corp. hired O'Neil", "  spaced   out  ",
              "Ünïcödé naïve façade", "e-mail: a@b.com", "1,000,000 people"]
    ours = predict(model, tok, texts)
    ref = pipe(texts, batch_size=16)
    n = 0
    for text, a, b in zip(texts, (p["entities"] for p in ours), ref):
        assert [(e["type"], e["start"], e["end"]) for e in a] == [(e["entity_group"], e["start"], e["end"]) for e in b], text
        assert [e["score"] for e in a] == pytest.approx([float(e["score"]) for e in b], abs=1e-5)
        n += len(a)
    assert n > 500


TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-MISC", "I-MISC"]


def _random_tagger(model_dir, max_length=128):
    """A tagger with a seeded random layer, made confident: varied tags that hang on each piece's context."""
    base, tok = load(model_dir)
    torch.manual_seed(3)
    model = attach_head(base, HeadConfig("tag", TAGS, max_length=max_length)).eval()
    with torch.no_grad():
        model.fc.weight.mul_(50)
    return model, tok


def test_a_long_document_has_every_word_labelled_from_its_max_context_window(tiny_bert_dir, data_dir):
    """A CoNLL document of 400+ pieces in windows of 30 pieces. (1) A tagger blind to context (no position
    embeddings, attention values zeroed: a piece's logits hang on the piece alone) labels every word of the windowed
    document as it labels each sentence fed whole: each label was read at its own word's first piece. (2) A tagger
    that sees context labels each word as the window picked by the plain rule (max_context), run alone, does at
    that word's first piece; another window would have given some words another tag."""
    sents = read_conll(data_dir / "conll2003" / "eng.testa")
    doc = [s for s in sents if s.doc == sents[0].doc][:25]
    model, tok = _random_tagger(tiny_bert_dir)
    feats = tag_features(doc, tok, TAGS, max_length=32, context="document")
    pieces = [p for s in doc for w in word_pieces(tok, s.words) for p in w]
    assert len(pieces) > 400 and max(map(len, feats.ids)) == 32 and feats.cut == []

    spans = windows(len(pieces), 30, 15)
    with torch.no_grad():
        logits = [model(torch.tensor([[tok.cls_id] + pieces[a:a + n] + [tok.sep_id]]))[0] for a, n in spans]
    want, differ, p = [], 0, 0
    for s in doc:
        for w in word_pieces(tok, s.words):
            seen = {i: TAGS[int(logits[i][p - a + 1].argmax())] for i, (a, n) in enumerate(spans) if a <= p < a + n}
            want.append(next(t for i, t in seen.items() if max_context(spans, i, p)))
            differ += len(set(seen.values())) > 1
            p += len(w)
    got, probs = tagging.predict_tags(model, tok, doc, feats)
    assert [t for tags in got for t in tags] == want and min(x for ps in probs for x in ps) > 0
    assert differ > 20                                    # which window labels a word changes its tag

    with torch.no_grad():
        model.bert.wpe.weight.zero_()
        for block in model.bert.h:
            block.attn.c_attn.weight[2 * block.attn.c_attn.out_features // 3:].zero_()
    alone = tagging.predict_tags(model, tok, doc)                            # a row per sentence, each whole
    windowed = tagging.predict_tags(model, tok, doc, feats)
    assert windowed[0] == alone[0] and len({t for tags in alone[0] for t in tags}) > 3
    assert [x for ps in windowed[1] for x in ps] == pytest.approx([x for ps in alone[1] for x in ps], abs=1e-5)


def test_long_text_entities_equal_the_pipeline_with_stride(tiny_bert_dir, data_dir, tmp_path):
    """Four CoNLL documents as four texts of 400+ pieces, windows of 30 pieces overlapping by 5 (our stride 25 is
    the pipeline's stride=5). Both define the same entities where an entity and the words either side of it lie in
    one window only: there they are equal (type, characters, score). In the overlaps they differ by design: the
    pipeline groups each window's words into entities on their own and keeps, of entities that overlap, the longest
    (ties: the higher score); duolm labels each word from the window where it has the most context, then groups."""
    from duolm.checkpoint import save
    model, tok = _random_tagger(tiny_bert_dir, max_length=32)
    out = save(model, tmp_path / "hf", tokenizer=tok, format="hf")
    pipe = transformers.pipeline("token-classification", model=str(out), aggregation_strategy="first", device="cpu")
    pipe.tokenizer.model_max_length = 32
    sents = read_conll(data_dir / "conll2003" / "eng.testa")
    texts = [" ".join(w for s in sents if s.doc == d for w in s.words)[:3000] for d in (1, 2, 3, 4)]
    ours = tagging.predict(model, tok, texts, stride=25)
    ref = pipe(texts, stride=5)
    same = 0
    for text, a, b in zip(texts, ours, ref):
        enc = tok.encode_with_offsets(text)
        spans = windows(len(enc.ids) - 2, 30, 25)
        alone = [sum(s <= p < s + n for s, n in spans) == 1 for p in range(len(enc.ids) - 2)]
        words = tagging._words(tok, text)
        single = [all(ok for ok, (x, _) in zip(alone, enc.offsets[1:-1]) if a0 <= x < b0) for a0, b0 in words]

        def inside(start, end):
            near = [i for i, (a0, b0) in enumerate(words) if b0 > start and a0 < end]
            return all(single[max(0, near[0] - 1):near[-1] + 2])
        mine = [(e["type"], e["start"], e["end"], e["score"]) for e in a["entities"]]
        theirs = [(e["entity_group"], e["start"], e["end"], float(e["score"])) for e in b]
        keep = lambda es: [e for e in es if inside(e[1], e[2])]                   # noqa: E731
        assert [e[:3] for e in keep(mine)] == [e[:3] for e in keep(theirs)], text[:40]
        assert [e[3] for e in keep(mine)] == pytest.approx([e[3] for e in keep(theirs)], abs=1e-5)
        same += len(keep(mine))
    assert same > 100 and len(ours) == 4
