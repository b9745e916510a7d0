"""`duolm demo` end to end on a slice of real text, with a few steps: what it prints is what the runs hold."""
import math
import re

from duolm import demo
from duolm.runs import read_metrics


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
    assert (f"MLM accuracy {bert[0]['val_mlm_acc']:.1%} -> {bert[-1]['val_mlm_acc']:.1%}" in summary
            and f"NSP accuracy {bert[0]['val_nsp_acc']:.1%} -> {bert[-1]['val_nsp_acc']:.1%} (chance: 50%)" in summary)
    guess = float(re.search(r"most frequent piece: ([\d.]+)%", summary).group(1))
    assert 0 < guess < 50                      # a constant guess is right on some masked positions, not most
    for sentence in demo.MASKED:               # a guess for each example sentence
        assert f"{sentence!r}: " in out
