"""`duolm demo` end to end on a slice of real text, with a few steps: what it prints is what the runs hold."""
import math
import re

import pytest

from duolm import demo
from duolm.data.mlm import BertBatches, MaskSpec
from duolm.runs import read_metrics
from duolm.tokenizers import WordPiece


def test_demo_reports_what_both_models_learned(data_dir, tmp_path, capsys, one_thread):
    text = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:60_000]
    paragraphs = [p.strip() for p in text.split("\n") if len(p.split()) > 30]
    (tmp_path / "wiki.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    demo.run(str(tmp_path / "demo"), text=str(tmp_path / "wiki.txt"), gpt2_steps=4, bert_steps=4)
    out = capsys.readouterr().out
    gpt2 = [r["val_loss"] for r in read_metrics(tmp_path / "demo" / "gpt2") if "val_loss" in r]
    bert = [r for r in read_metrics(tmp_path / "demo" / "bert") if "val_mlm_acc" in r]
    summary = out.split("== done in", 1)[1]
    assert f"perplexity {math.exp(gpt2[0]):.0f} -> {math.exp(gpt2[-1]):.1f}" in summary
    assert f"MLM accuracy {bert[0]['val_mlm_acc']:.1%} -> {bert[-1]['val_mlm_acc']:.1%}" in summary
    first, last = bert[0]["val_nsp_acc"], bert[-1]["val_nsp_acc"]
    nsp = re.search(rf"NSP accuracy {first:.1%} -> {last:.1%} \(always guessing the majority class: ([\d.]+)%(.*?)\)",
                    summary)
    assert nsp and 50 <= float(nsp.group(1)) <= 100 and nsp.group(2) in ("", "; NSP learned nothing")
    shown, majority = float(f"{100 * last:.1f}"), float(nsp.group(1))
    assert shown <= majority if nsp.group(2) else shown >= majority     # said when no better than the majority guess
    guess = float(re.search(r"most frequent piece: ([\d.]+)%", summary).group(1))
    assert 0 < guess < 50                      # a constant guess is right on some masked positions, not most
    for sentence in demo.MASKED:               # a guess for each example sentence
        assert f"{sentence!r}: " in out


@pytest.fixture(scope="module")
def sentence_docs():
    """The demo's BERT documents (docstrings cut into sentences, those of two or more), on a small corpus."""
    return [s for s in (demo._sentences(d) for d in demo.stdlib_docstrings(max_chars=150_000)) if len(s) >= 2]


def _val_data(docs, tok, seed=1):
    """Validation pairs as the demo's run builds them (build(): static masks, 64-token sequences, seed + 1)."""
    ids = [[tok.encode(s)[1:-1] for s in doc] for doc in docs]
    return BertBatches(ids, MaskSpec.from_tokenizer(tok), max_seq_length=64, seed=seed, masking="static")


def test_nsp_baseline_is_the_majority_class_of_the_validation_pairs(sentence_docs):
    """The demo's short documents make most NSP pairs "random next" (a one-sentence chunk always is): the baseline is
    that share, counted here from the pairs themselves, not 50%; documents of one sentence give only such pairs."""
    tok = WordPiece.train([s for d in sentence_docs for s in d], vocab_size=1000)
    val = _val_data(sentence_docs[:300], tok)
    mlm, nsp = demo.guess_baselines(val, batch_size=32, max_batches=8)
    labels = [e["nsp_label"] for e in val.instances[:32 * 8]]
    assert len(labels) == 256 and nsp == max(labels.count(0), labels.count(1)) / 256
    assert nsp > 0.55 and labels.count(1) > labels.count(0)       # random next is the majority
    assert 0 < mlm < 0.5
    one = _val_data([[s] for d in sentence_docs[:40] for s in d[:1]], tok)
    assert demo.guess_baselines(one, batch_size=8, max_batches=2)[1] == 1.0


def test_nsp_summary_says_when_nsp_learned_nothing():
    assert demo.nsp_summary(0.648, 0.612, 0.648) == (
        "NSP accuracy 64.8% -> 61.2% (always guessing the majority class: 64.8%; NSP learned nothing)")
    assert demo.nsp_summary(0.648, 0.648, 0.648).endswith("; NSP learned nothing)")
    assert demo.nsp_summary(0.5, 0.81, 0.648) == "NSP accuracy 50.0% -> 81.0% (always guessing the majority class: 64.8%)"
