"""Byte-level BPE against tiktoken and HF `tokenizers` on real text, random text, files and bad input."""
import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from duolm.tokenizers import ByteLevelBPE
from duolm.tokenizers import bpe, pieces
from duolm.tokenizers.files import bytes_to_unicode
from duolm.tokenizers.bpe import bpe_merge, bpe_merge_long, learn_merges, merge_word
from duolm.tokenizers.pieces import GPT2_PATTERN, pre_split, safe_chunks, split_pieces

tiktoken = pytest.importorskip("tiktoken")
hf = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
# Reference runs are slow on the big files of a shared machine: tiktoken sees every file whole and the first
# LINES_SLICE characters line by line; HF tokenizers (~1 MB/s) the first HF_SLICE characters, whole and by line.
LINES_SLICE = 300_000
HF_SLICE = 100_000


def hf_bpe(vocab_json, merges_txt):
    """HF tokenizers with GPT-2's settings (byte-level pre-tokenizer, no prefix space)."""
    t = hf.Tokenizer(hf.models.BPE.from_file(str(vocab_json), str(merges_txt)))
    t.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = hf.decoders.ByteLevel()
    return t


def tiktoken_from_vocab_json(path, special_tokens):
    """tiktoken.Encoding whose mergeable ranks are the ids of vocab.json (bytes spelled as GPT-2 spells them)."""
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads(path.read_text(encoding="utf-8"))
    ranks = {bytes(char_to_byte[c] for c in t): i for t, i in vocab.items() if t not in special_tokens}
    return tiktoken.Encoding("trained", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special_tokens)


@pytest.fixture(scope="module")
def gpt2(data_dir):
    return ByteLevelBPE.from_tiktoken(data_dir / "gpt2" / "gpt2.tiktoken")


@pytest.fixture(scope="module")
def gpt2_files(data_dir):
    return ByteLevelBPE.from_files(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")


@pytest.fixture(scope="module")
def ref_tiktoken(data_dir):
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(str(data_dir / "gpt2" / "gpt2.tiktoken"))
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})


@pytest.fixture(scope="module")
def ref_hf(data_dir):
    return hf_bpe(data_dir / "gpt2" / "encoder.json", data_dir / "gpt2" / "vocab.bpe")


def text_files(data_dir):
    out = []
    for p in sorted(data_dir.rglob("*")):
        if p.is_file():
            try:
                out.append((p, p.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                pass
    assert len(out) >= 15
    return out


# --- the plain algorithm, worked --------------------------------------------------------------------

def test_worked_example_aaabdaaabac():
    # SPEC: "aaabdaaabac" -> "ZabdZabac" (aa -> Z) -> "ZYdZYac" (ab -> Y); then ZY -> X gives "XdXac".
    # After aa -> Z, (Z, a) and (a, b) both occur twice: the tie goes to the smaller ids, (a, b).
    assert learn_merges({b"aaabdaaabac": 1}, 3, min_frequency=1) == [(b"a", b"a"), (b"a", b"b"), (b"aa", b"ab")]
    a, b, c, d, Z, Y = 1, 2, 3, 4, 256, 257
    w = merge_word([a, a, a, b, d, a, a, a, b, a, c], (a, a), Z)
    assert w == [Z, a, b, d, Z, a, b, a, c]
    assert merge_word(w, (a, b), Y) == [Z, Y, d, Z, Y, a, c]
    # bpe_merge's docstring: each rank level in turn (the ranks up to a level give the state after it)
    ranks = {b"aa": 0, b"ab": 1, b"aaab": 2}
    piece = b"aaabdaaabac"
    assert bpe_merge(piece, {}) == list(b"a a a b d a a a b a c".split())
    assert bpe_merge(piece, {b"aa": 0}) == b"aa a b d aa a b a c".split()
    assert bpe_merge(piece, {b"aa": 0, b"ab": 1}) == b"aa ab d aa ab a c".split()
    assert bpe_merge(piece, ranks) == b"aaab d aaab a c".split() == bpe_merge_long(piece, ranks)
    assert bytes_to_unicode()[ord(" ")] == "Ġ" and len(set(bytes_to_unicode().values())) == 256


def test_pre_split_worked_example():
    assert pre_split("I'm   fine, 2024!\n") == ["I", "'m", "  ", " fine", ",", " 2024", "!", "\n"]
    assert safe_chunks("one\ntwo\n  three\n four", 3) == ["one\n", "two\n  three\n", " four"]


# --- each fast path against the plain function it replaces ---------------------------------------------

@st.composite
def rank_tables(draw):
    """A piece over a 1-3 letter alphabet and random distinct ranks for random tokens over it: longer
    tokens may rank below their parts, which no learned vocabulary does (the merge's heap path)."""
    alphabet = draw(st.sampled_from([b"a", b"ab", b"abc", b"a\xc3"]))
    tokens = draw(st.lists(st.binary(min_size=2, max_size=6).map(lambda t: bytes(alphabet[x % len(alphabet)] for x in t)),
                           max_size=40, unique=True))
    order = draw(st.permutations(tokens))
    piece = draw(st.lists(st.sampled_from(alphabet), max_size=300).map(bytes))
    return piece, {t: r for r, t in enumerate(order)}


@settings(max_examples=300, deadline=None)
@given(rank_tables())
def test_long_merge_equals_plain_merge_random_ranks(case):
    piece, ranks = case
    assert bpe_merge_long(piece, ranks) == bpe_merge(piece, ranks)


def test_long_merge_equals_plain_merge_on_long_pieces(gpt2, data_dir):
    rng = random.Random(0)
    text = (data_dir / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    french = (data_dir / "wmt14" / "newstest2014-fren.fr.txt").read_text(encoding="utf-8")
    real = []  # real text without whitespace: long pieces of every kind of content
    for source in (text, french):
        squeezed = "".join(source[:200_000].split()).encode()
        for _ in range(12):
            s = rng.randrange(len(squeezed) - 1200)
            real.append(squeezed[s:s + rng.randrange(65, 1200)])
    repetitive = [b"a" * 3000, b"=" * 999, b"-" * 1001, b"ab" * 777, "ÃĥÃĤ".encode() * 200, "日本語".encode() * 150,
                  b" " + b"a" * 2001, b"\xff\xfe" * 500, bytes(rng.choice(b"ab") for _ in range(2000))]
    mixed = ["".join(rng.choice("aab cdeé\u4e00") for _ in range(rng.randint(2, 200))).encode() for _ in range(100)]
    trained = ByteLevelBPE.train([text[:100_000]], 1000)._ranks
    for piece in real + repetitive + mixed:
        for ranks in (gpt2._ranks, trained):
            assert bpe_merge_long(piece, ranks) == bpe_merge(piece, ranks), piece[:40]


def test_fast_split_equals_plain_split_on_real_data(data_dir):
    for path, text in text_files(data_dir):
        text = text[:100_000]
        assert split_pieces(text) == pre_split(text), path


def test_encode_equals_plain_composition_on_real_data(data_dir, gpt2):
    """encode_ordinary (fast split, piece cache, long-piece merge) = pre_split, then bpe_merge per piece."""
    ranks, encoder = gpt2._ranks, gpt2._encoder
    for name in ("wikitext-2/test.txt", "tinyshakespeare/input.txt", "wmt14/newstest2014-fren.fr.txt"):
        text = (data_dir / name).read_text(encoding="utf-8")[:50_000] + "=" * 200 + " ab" * 30
        plain = [encoder[t] for p in pre_split(text) for t in bpe_merge(p.encode(), ranks)]
        assert gpt2.encode_ordinary(text) == plain, name


def plain_learn_merges(word_counts, num_merges, min_frequency):
    """learn_merges without incremental counts: count every pair, merge the best everywhere, repeat."""
    tokens = list(bpe._BASE_TOKENS)
    byte_id = {t[0]: i for i, t in enumerate(tokens)}
    words = [([byte_id[b] for b in w], c) for w, c in word_counts.items()]
    merges = []
    while len(merges) < num_merges:
        counts = Counter()
        for w, c in words:
            for p in zip(w, w[1:]):
                counts[p] += c
        new = [(-c, p) for p, c in counts.items() if tokens[p[0]] + tokens[p[1]] not in tokens]
        if not new or -min(new)[0] < min_frequency:
            return merges
        pair = min(new)[1]
        merges.append((tokens[pair[0]], tokens[pair[1]]))
        tokens.append(tokens[pair[0]] + tokens[pair[1]])
        words = [(merge_word(w, pair, len(tokens) - 1), c) for w, c in words]
    return merges


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.lists(st.sampled_from(b"abc\xc3"), min_size=1, max_size=12).map(bytes),
                       st.integers(1, 5), max_size=12), st.integers(0, 30), st.integers(1, 3))
def test_incremental_training_equals_plain_training(word_counts, num_merges, min_frequency):
    assert learn_merges(word_counts, num_merges, min_frequency) == plain_learn_merges(word_counts, num_merges,
                                                                                      min_frequency)


def test_min_frequency_and_determinism():
    texts = ["low lower lowest newer wider new"] * 3 + ["rare"]  # "ra", "ar" occur once
    t1 = ByteLevelBPE.train(texts, 1000, min_frequency=2)
    assert t1._merges == ByteLevelBPE.train(texts, 1000, min_frequency=2)._merges
    tokens = {a + b for a, b in t1._merges}
    assert b" lower" in tokens and b"ra" not in tokens and b"ar" not in tokens
    assert t1.vocab_size == 256 + len(t1._merges) + 1 < 1000 and t1.eot_id == t1.vocab_size - 1
    assert b"rare" in {a + b for a, b in ByteLevelBPE.train(texts, 1000, min_frequency=1)._merges}


def test_training_reports_progress_and_prints_nothing(capsys):
    """progress(done, total) after each merge: done 1, 2, ... up to total = the merges asked for; when the
    pairs run out first, a last call (done, done). Nothing reaches stdout or stderr."""
    texts = ["low lower lowest newer wider new"] * 3
    calls = []
    tok = ByteLevelBPE.train(texts, 256 + 1 + 10, progress=lambda done, total: calls.append((done, total)))
    assert len(tok._merges) == 10 and calls == [(i, 10) for i in range(1, 11)]
    calls.clear()
    tok = ByteLevelBPE.train(texts, 1000, progress=lambda done, total: calls.append((done, total)))
    n = len(tok._merges)
    assert 10 < n < 1000 - 257                                    # the pairs ran out
    assert calls == [(i, 1000 - 257) for i in range(1, n + 1)] + [(n, n)]
    assert capsys.readouterr() == ("", "")


# --- where a text may be cut ----------------------------------------------------------------------------

_FRAGMENTS = st.sampled_from(["a", "Ab", " ", "  ", "\n", "\n ", " \n", "\n\n", "\r\n", "\t", "é", "日本", "1", "!?",
                              "'s", "'", "\u00a0", "\x1c", "\u2028", "\x85", " x", "<|endoftext|>"])


@settings(max_examples=500, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=60).map("".join), st.integers(1, 30))
def test_safe_chunks_encode_like_the_whole(gpt2, text, chunk_chars):
    chunks = gpt2.safe_chunks(text, chunk_chars)
    assert "".join(chunks) == text and all(chunks) and all(len(c) >= chunk_chars for c in chunks[:-1])
    assert [p for c in chunks for p in pre_split(c)] == pre_split(text)
    assert [i for c in chunks for i in gpt2.encode_ordinary(c)] == gpt2.encode_ordinary(text)


def test_safe_chunks_on_real_data(gpt2, data_dir):
    # PTB and WikiText start every line with a space: cut before " word" (a piece of its own)
    for name in ("ptb/ptb.valid.txt", "wikitext-2/test.txt", "tinyshakespeare/input.txt"):
        text = (data_dir / name).read_text(encoding="utf-8")[:300_000]
        chunks = safe_chunks(text, 5000)
        assert len(chunks) >= 40 and "".join(chunks) == text, name
        assert [i for c in chunks for i in gpt2.encode_ordinary(c)] == gpt2.encode_ordinary(text), name
    # a newline followed by two spaces is no cut: "\n " is one piece there, "\n" + " " if cut
    assert pre_split("a\n") + pre_split("  b") != pre_split("a\n  b") and safe_chunks("a\n  b", 1) == ["a\n  b"]
    # paragraphs of one line between blank lines: cut between the two newlines, "\n" + "\n" both ways
    assert safe_chunks("one para.\n\nTwo.\n\n\nThree", 1) == ["one para.\n", "\nTwo.\n\n", "\nThree"]
    assert safe_chunks("", 10) == []
    with pytest.raises(ValueError, match="chunk_chars"):
        safe_chunks("abc", 0)


# --- real text against the references -------------------------------------------------------------

def test_gpt2_files_and_tiktoken_file_are_the_same_tokenizer(gpt2, gpt2_files):
    assert gpt2._encoder == gpt2_files._encoder and gpt2_files._ranks is gpt2_files._encoder
    assert gpt2.vocab_size == gpt2_files.vocab_size == 50257 and gpt2.eot_id == gpt2_files.eot_id == 50256


def test_every_data_file_matches_tiktoken(data_dir, gpt2, ref_tiktoken):
    for path, text in text_files(data_dir):
        assert gpt2.encode_ordinary(text) == ref_tiktoken.encode_ordinary(text), path
        lines = text[:LINES_SLICE].splitlines(keepends=True)
        assert [gpt2.encode_ordinary(x) for x in lines] == [ref_tiktoken.encode_ordinary(x) for x in lines], path


def test_every_data_file_matches_hf_tokenizers(data_dir, gpt2_files, ref_hf):
    for path, text in text_files(data_dir):
        text = text[:HF_SLICE]
        ids = gpt2_files.encode_ordinary(text)
        assert ids == ref_hf.encode(text).ids, path
        lines = text.splitlines(keepends=True)
        assert [gpt2_files.encode_ordinary(x) for x in lines] == [e.ids for e in ref_hf.encode_batch(lines)], path
        assert gpt2_files.decode(ids) == text == ref_hf.decode(ids)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_random_unicode(gpt2, ref_tiktoken, ref_hf, text):
    ids = gpt2.encode(text, disallowed_special=())
    assert gpt2.decode_bytes(ids) == text.encode()
    assert ids == ref_tiktoken.encode_ordinary(text)
    assert ids == ref_hf.encode(text).ids


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["a", "Ab", " ", "\n", "\n ", " \n", "\r\n", "\t", "é", "日本", "1", "!?", "'s", "'",
                                 "\u00a0", "\u3000", "\x1c", "\x00", "\u0558", "\U0003d000"]), max_size=60).map("".join))
def test_fast_split_equals_the_pattern(text):
    # split_pieces runs stdlib `re` on ASCII stretches cut at safe newlines: the same pieces as GPT-2's pattern
    assert split_pieces(text) == pre_split(text)


def test_code_points_in_every_category(gpt2, ref_tiktoken, ref_hf):
    # `regex` knows a newer Unicode than the references; code points they do not know must split as they do.
    # (A scan of all 1.1M code points this way found exactly the ranges in pieces._NEWER_UNICODE; here a sample.)
    newer = [int(h, 16) for r in pieces._NEWER_UNICODE.split() for h in r.split("-")]
    for i, cp in enumerate(sorted({*range(0, 0x110000, 23), *newer, *(c + 1 for c in newer)} - {*range(0xD800, 0xE000)})):
        c = chr(cp)
        text = f"a{c}1 {c}{c}'s {c}1 !{c}\n"
        assert gpt2.encode_ordinary(text) == ref_tiktoken.encode_ordinary(text), hex(cp)
        if i % 10 == 0:
            assert gpt2.encode_ordinary(text) == ref_hf.encode(text).ids, hex(cp)


def _fix_surrogates(text):  # what tiktoken does to lone surrogates: U+FFFD
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["replace", "surrogateescape", "ignore", "backslashreplace"]))
def test_random_bytes(gpt2, ref_tiktoken, data, errors):
    text = data.decode("utf-8", errors)
    ids = gpt2.encode_ordinary(text)
    assert ids == ref_tiktoken.encode_ordinary(text)
    assert gpt2.decode_bytes(ids) == _fix_surrogates(text).encode()
    if errors != "surrogateescape":
        assert gpt2.decode(ids) == text


# --- train, save, load in the references -----------------------------------------------------------

def test_train_save_load_roundtrip(tmp_path, data_dir):
    train_text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:300_000]
    tok = ByteLevelBPE.train(train_text.splitlines(keepends=True), 2000, special_tokens=(EOT, "<pad>"))
    assert tok.vocab_size == 2000 and tok.special_tokens == {EOT: 1998, "<pad>": 1999}
    tok.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"vocab.json", "merges.txt", "special_tokens.json"}
    back = ByteLevelBPE.load(tmp_path)
    ours = hf_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")
    tik = tiktoken_from_vocab_json(tmp_path / "vocab.json", tok.special_tokens)
    text = (data_dir / "wikitext-2" / "test.txt").read_text()[:100_000] + " héllo wörld 😀 日本語"
    ids = tok.encode(text)
    assert len(set(ids)) > 1000
    assert back.encode(text) == ids == ours.encode(text).ids == tik.encode_ordinary(text)
    assert back.decode(ids) == text
    assert tok.encode(f"a{EOT}b<pad>", allowed_special="all") == tik.encode(f"a{EOT}b<pad>", allowed_special="all")
    assert back.special_tokens == tok.special_tokens and back._merges == tok._merges


def test_load_a_vocab_trained_by_hf(tmp_path, data_dir):
    # HF's trainer lays ids out its own way (special first, bytes sorted by character): ids come from
    # vocab.json, the merge order from merges.txt
    t = hf.Tokenizer(hf.models.BPE())
    t.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = hf.trainers.BpeTrainer(vocab_size=1500, special_tokens=[EOT], show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([(data_dir / "tinyshakespeare" / "input.txt").read_text()[:200_000]], trainer)
    t.model.save(str(tmp_path))
    ours = ByteLevelBPE.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert ours.special_tokens == {EOT: 0} and ours.vocab_size == t.get_vocab_size()
    text = (data_dir / "wikitext-2" / "test.txt").read_text()[:50_000]
    assert ours.encode(text) == t.encode(text).ids


def test_save_gpt2_from_tiktoken_derives_the_merges(tmp_path, data_dir, gpt2, ref_hf):
    gpt2.save(tmp_path)
    theirs = (data_dir / "gpt2" / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    assert (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()[1:] == [x for x in theirs[1:] if x]
    assert json.loads((tmp_path / "vocab.json").read_text()) == json.loads((data_dir / "gpt2" / "encoder.json").read_text())
    text = "Hello world, this is GPT-2's tokenizer!  \n\n 12345 ünïcödé"
    assert ByteLevelBPE.load(tmp_path).encode(text) == ref_hf.encode(text).ids


def test_encode_batch_processes(gpt2, ref_tiktoken):
    texts = [f"line {i}: the quick brown fox {i * 7919}" for i in range(200)]
    assert gpt2.encode_batch(texts, workers=2) == gpt2.encode_batch(texts) == ref_tiktoken.encode_ordinary_batch(texts)


# --- bad input -------------------------------------------------------------------------------------

def test_special_token_injection(gpt2, ref_tiktoken):
    # what a user typed is text: the one call that says so, and what it gives (issue: `duolm generate`)
    typed = f"Hello{EOT}World"
    assert gpt2.encode(typed, allowed_special=set(), disallowed_special=()) == [15496, 27, 91, 437, 1659, 5239, 91, 29,
                                                                              10603]
    assert gpt2.encode(typed, disallowed_special=()) == ref_tiktoken.encode(typed, disallowed_special=())
    assert gpt2.encode(typed, allowed_special={EOT}) == [15496, 50256, 10603] == ref_tiktoken.encode(typed, allowed_special={EOT})
    text = f"hello {EOT} world"
    with pytest.raises(ValueError, match="allowed_special"):
        gpt2.encode(text)
    with pytest.raises(ValueError):
        ref_tiktoken.encode(text)
    assert gpt2.encode(text, allowed_special={EOT}) == ref_tiktoken.encode(text, allowed_special={EOT})
    assert 50256 in gpt2.encode(text, allowed_special="all")
    assert gpt2.encode(text, disallowed_special=()) == gpt2.encode_ordinary(text) == ref_tiktoken.encode_ordinary(text)
    assert 50256 not in gpt2.encode_ordinary(text)
    assert gpt2.decode(gpt2.encode(text, allowed_special="all")) == text
    with pytest.raises(ValueError, match="not special tokens"):
        gpt2.encode("x", allowed_special={"<|im_start|>"})


@pytest.mark.parametrize("text", ["", " ", "\x00", "a\x00b\x01\x02\x7f\x1b[0m\r\n\t\x0b\x0c", "\u200b\ufeff\u2028\u00a0",
                                  "\ud800", "a\udfffb", "\ud83d\ude00", "x\ud83d", "'s'S'll  \n\n  \t x"])
def test_edge_inputs(gpt2, ref_tiktoken, text):
    ids = gpt2.encode(text)
    assert ids == ref_tiktoken.encode(text)  # lone surrogates: both replace them by U+FFFD
    assert gpt2.decode_bytes(ids) == _fix_surrogates(text).encode()
    assert gpt2.encode("") == [] and gpt2.decode([]) == ""


def test_decode_replaces_invalid_utf8_and_rejects_unknown_ids(gpt2):
    ids = gpt2.encode("é")
    partial = [i for i in range(256) if gpt2.decode_bytes([i]) == "é".encode()[:1]]
    assert gpt2.decode(partial) == "\ufffd" and gpt2.decode(ids) == "é"
    with pytest.raises(ValueError, match="50257"):
        gpt2.decode([50257])
    with pytest.raises(ValueError):
        gpt2.decode([-1])


def test_million_character_pieces(gpt2, ref_tiktoken):
    rng = random.Random(0)
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(100_000))
    for text in ["a" * 1_000_000, letters, "1" * 50_000 + " " * 50_000 + "!" * 50_000 + "\n" * 50_000]:
        assert gpt2.encode(text) == ref_tiktoken.encode(text)
    # that this is not quadratic (doubling a long piece ~doubles its time) is measured by benchmarks/tokenizers.py


@pytest.mark.parametrize("texts", [[], [""], ["\n\n"], ["abc def"], ["é"]])
def test_training_that_learns_nothing_raises(texts):
    with pytest.raises(ValueError, match="nothing was learned"):
        ByteLevelBPE.train(texts, 1000)
    assert ByteLevelBPE.train(texts, 257).vocab_size == 257  # no merge asked for: the 256 bytes + <|endoftext|>


def test_word_cache_is_bounded(gpt2, monkeypatch):
    monkeypatch.setattr(bpe, "_CACHE_SIZE", len(gpt2._base_cache) + 100)
    rng = random.Random(1)
    words = " ".join("".join(rng.choice("qxzjvk") for _ in range(8)) for _ in range(1000))
    gpt2.encode(words)
    assert len(gpt2._cache) <= len(gpt2._base_cache) + 100


def test_corrupt_files(tmp_path, data_dir):
    enc = (data_dir / "gpt2" / "encoder.json").read_text(encoding="utf-8")
    merges = (data_dir / "gpt2" / "vocab.bpe").read_text(encoding="utf-8")
    tik = (data_dir / "gpt2" / "gpt2.tiktoken").read_bytes()
    good_vocab, good_merges = tmp_path / "good.json", tmp_path / "good.bpe"
    good_vocab.write_text(enc, encoding="utf-8")
    good_merges.write_text(merges, encoding="utf-8")

    bad = tmp_path / "truncated.json"
    bad.write_text(enc[: len(enc) // 2], encoding="utf-8")
    with pytest.raises(ValueError, match=r"truncated\.json: not valid JSON .*line \d+"):
        ByteLevelBPE.from_files(bad, good_merges)

    lines = merges.splitlines(keepends=True)
    bad = tmp_path / "garbled.bpe"
    bad.write_text("".join(lines[:100]) + "Ġthe\n" + "".join(lines[100:]), encoding="utf-8")
    with pytest.raises(ValueError, match=r"garbled\.bpe: line 101"):
        ByteLevelBPE.from_files(good_vocab, bad)
    bad.write_text("".join(lines[:100]) + "Ġt zzz\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"garbled\.bpe: line 101.*not in"):
        ByteLevelBPE.from_files(good_vocab, bad)
    bad = tmp_path / "short.bpe"
    bad.write_text("".join(lines[:30_000]), encoding="utf-8")  # cut at a line boundary
    with pytest.raises(ValueError, match=r"made by no merge in .*short\.bpe.*truncated"):
        ByteLevelBPE.from_files(good_vocab, bad)

    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(tik[:5000] + b"!!notbase64 12\n" + tik[5000:])
    n = tik[:5000].count(b"\n") + 1
    with pytest.raises(ValueError, match=rf"bad\.tiktoken: line {n}"):
        ByteLevelBPE.from_tiktoken(bad)
    bad.write_bytes(tik[: len(tik) // 2 + 3])  # cut mid-line
    with pytest.raises(ValueError, match=r"bad\.tiktoken: line \d+"):
        ByteLevelBPE.from_tiktoken(bad)
    with pytest.raises(FileNotFoundError):
        ByteLevelBPE.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="vocab_size"):
        ByteLevelBPE.train(["abc"], 100)


def test_bad_ids_and_encodings_name_the_file(tmp_path, data_dir):
    enc = json.loads((data_dir / "gpt2" / "encoder.json").read_text(encoding="utf-8"))
    merges = (data_dir / "gpt2" / "vocab.bpe").read_bytes()
    vocab, bpe_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    bpe_file.write_bytes(merges)
    for bad in (2 ** 40, -1, 1.5, True, "7"):
        vocab.write_text(json.dumps({**enc, "Ġthe": bad}), encoding="utf-8")
        with pytest.raises(ValueError, match=r"vocab\.json: token 'Ġthe': id .* is not an integer from 0"):
            ByteLevelBPE.from_files(vocab, bpe_file)
    vocab.write_text(json.dumps(enc), encoding="utf-8")
    lines = merges.split(b"\n")
    bpe_file.write_bytes(b"\n".join(lines[:500] + [b"\xff\xfe \x80"] + lines[500:]))
    with pytest.raises(ValueError, match=r"merges\.txt: line 501: not valid UTF-8"):
        ByteLevelBPE.from_files(vocab, bpe_file)
    tik = tmp_path / "big.tiktoken"
    tik.write_bytes((data_dir / "gpt2" / "gpt2.tiktoken").read_bytes() + b"YWJjZGVm 99999999999\n")
    with pytest.raises(ValueError, match=r"big\.tiktoken: line 50257: id 99999999999"):
        ByteLevelBPE.from_tiktoken(tik)
    d = tmp_path / "saved"
    ByteLevelBPE.train(["low lower lowest"] * 3, 300).save(d)
    for specials in ('{"special_tokens": {"<|endoftext|>": 1e300}}', '{"special_tokens": ["<|endoftext|>"]}',
                     '{"special_tokens": '):
        (d / "special_tokens.json").write_text(specials, encoding="utf-8")
        with pytest.raises(ValueError, match=r"special_tokens\.json"):
            ByteLevelBPE.load(d)


def test_failed_save_leaves_the_old_files(tmp_path, monkeypatch):
    """A write that fails midway (the disk fills while merges.txt is written) leaves every old file as
    it was (vocab.json, already written, is not renamed over the old one either) and no temporary file."""
    old = ByteLevelBPE.train(["low lower lowest newer wider"] * 3, 280)
    old.save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_open = open

    def full_disk(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and ".merges.txt." in str(file):
            f.write("#version: 0.2\n")
            f.close()
            raise OSError(28, "No space left on device")
        return f

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(OSError, match="merges.txt"):
        ByteLevelBPE.train(["the quick brown fox jumps over the lazy dog"] * 3, 290).save(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert ByteLevelBPE.load(tmp_path)._merges == old._merges


def test_tokenizer_protocol(gpt2_files, ref_hf):
    """pieces spell each id as vocab.json does (HF's convert_ids_to_tokens), special tokens included."""
    from duolm.tokenizers import Tokenizer

    tok: Tokenizer = gpt2_files
    ids = tok.encode("Hello world, naïve 日本") + [50256]
    assert tok.pieces(ids) == [ref_hf.id_to_token(i) for i in ids]
    assert tok.pieces(ids)[-1] == "<|endoftext|>" and tok.decode(ids).endswith("<|endoftext|>")
    assert (tok.kind, tok.vocab_size, tok.special_tokens) == ("bpe", 50257, {"<|endoftext|>": 50256})
