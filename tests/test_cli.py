"""`duolm tokenizer train|encode` through the command's own entry point."""
import ast
import re

import pytest

from duolm.cli import main
from duolm.tokenizers import ByteLevelBPE, WordPiece, load_tokenizer


@pytest.fixture
def corpus(data_dir, tmp_path):
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:60_000]
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


def _printed(out: str, label: str):
    line = next(l for l in out.splitlines() if l.startswith(label))
    return ast.literal_eval(line[len(label):].strip())


@pytest.mark.parametrize("kind, cls, size", [("bpe", ByteLevelBPE, 400), ("wordpiece", WordPiece, 300)])
def test_tokenizer_train_then_encode(kind, cls, size, corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    main(["tokenizer", "train", "--kind", kind, "--vocab-size", str(size), str(corpus), "-o", str(out)])
    summary, bar = capsys.readouterr()
    tok = load_tokenizer(out)
    assert isinstance(tok, cls) and tok.vocab_size == size
    assert f"vocab {size}" in summary and str(out) in summary
    # the library's progress callback drives the command's bar (on stderr), up to the merges learned
    percent, done, total = re.findall(rf"{kind} merges: +(\d+)%\|.*?\| (\d+)/(\d+) ", bar)[-1]
    assert percent == "100" and done == total and (kind != "bpe" or total == str(size - 257))

    text = "To be, or not to be: that is the question."
    main(["tokenizer", "encode", str(out), text])
    printed = capsys.readouterr().out
    ids = tok.encode(text)
    assert _printed(printed, "ids:") == ids
    pieces = _printed(printed, "pieces:")
    assert len(pieces) == len(ids)
    if kind == "bpe":
        assert "".join(pieces) == text          # BPE pieces are the text, byte for byte
    else:
        assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]"


def test_tokenizer_errors_say_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "encode", str(tmp_path), "hello"])
    assert e.value.code == 2
    assert "duolm tokenizer train" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "train", "--kind", "bpe", "--vocab-size", "300", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t")])
    assert e.value.code == 2
    assert "missing.txt" in capsys.readouterr().err


def test_wordpiece_trains_on_a_lone_combining_mark(tmp_path, capsys):
    """Issue 63's reproduction: a word of U+103A alone, which lowercasing empties, once ended in an IndexError."""
    path = tmp_path / "burma.txt"
    path.write_text("The Mongol invasions of Burma \u103a were a series.\nof military conflicts in Burma\n", encoding="utf-8")
    main(["tokenizer", "train", "--kind", "wordpiece", "--vocab-size", "80", str(path), "-o", str(tmp_path / "tok")])
    tok = load_tokenizer(tmp_path / "tok")
    assert "\u103a" not in "".join(tok.vocab) and tok.tokenize("burma \u103a") == tok.tokenize("burma")


def test_env_prints_the_engines_this_machine_chose(monkeypatch, capsys):
    """`duolm env --json`: the machine, the fp32 and int8 engines as duolm.engines chose them (here given choices, so
    no timing runs) with their timings, and attention's engine; without --json the same in lines."""
    import json

    from duolm import precision

    chosen = {"few": "onednn", "wide": "mkl", "times": {"mkl": {"1": 0.002, "8": 0.004, "512": 0.3}}, "key": "k1"}
    int8 = {"few": "duolm", "wide": "torch", "times": {"torch": {"1": 0.001, "8": 0.002, "512": 0.1}}, "key": "k1"}
    monkeypatch.setattr(precision, "fp32_choice", lambda: chosen)
    monkeypatch.setattr(precision, "int8_choice", lambda: int8)
    main(["env", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["fp32"] == chosen and got["int8"] == int8 and got["machine"] == precision.machine()
    assert got["attention"]
    main(["env"])
    out = capsys.readouterr().out
    assert "fp32: onednn up to 32 rows, mkl above" in out and "1 rows 2.00 ms, 8 rows 4.00 ms, 512 rows 300.00 ms" in out
    assert "int8: duolm up to 32 rows, torch above" in out and "1 rows 1.00 ms, 8 rows 2.00 ms" in out
