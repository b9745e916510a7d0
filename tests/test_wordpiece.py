"""WordPiece (BERT) against HF BertTokenizerFast: ids, offsets, pairs, truncation, files, training."""
import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from duolm.tokenizers import wordpiece as wp
from duolm.tokenizers.basic import basic_tokenize
from duolm.tokenizers.wordpiece import MAX_CHARS_PER_WORD, SPECIALS, WordPiece, wordpiece

transformers = pytest.importorskip("transformers")
BertTokenizerFast = transformers.BertTokenizerFast

VOCABS = {"uncased": True, "cased": False}  # vocab name -> lowercase


@pytest.fixture(scope="module")
def toks(data_dir):
    """{name: (ours, hf_fast)} for both BERT vocabularies."""
    out = {}
    for name, lower in VOCABS.items():
        path = data_dir / "bert-vocab" / f"bert-base-{name}-vocab.txt"
        out[name] = (WordPiece.from_vocab(path, lowercase=lower), BertTokenizerFast(str(path), do_lower_case=lower))
    return out


def assert_same(ours, hf, text, pair=None, **kw):
    e = hf(text, pair, return_offsets_mapping=True, return_special_tokens_mask=True, **kw)
    o = ours.encode_with_offsets(text, pair, **kw)
    assert o.ids == e["input_ids"], (text[:200], pair)
    assert o.offsets == [tuple(x) for x in e["offset_mapping"]], (text[:200], pair)
    assert o.segment_ids == e["token_type_ids"]
    assert o.special_mask == e["special_tokens_mask"]


# ---- real data -------------------------------------------------------------------------------------

def _text_files(data_dir):
    return sorted(p for p in data_dir.rglob("*") if p.is_file() and "bert-vocab" not in p.parts)


def _slices(text, size=60_000, seed=0):
    """The head of the file and one slice from its middle: a full pass of ~25 MB through both
    tokenizers would take minutes here (full passes were run once by hand: zero mismatches)."""
    if len(text) <= 2 * size:
        return [text]
    mid = random.Random(seed).randrange(size, len(text) - size)
    return [text[:size], text[mid:mid + size]]


@pytest.mark.parametrize("name", VOCABS)
def test_data_files_match_hf(toks, data_dir, name):
    ours, hf = toks[name]
    files = _text_files(data_dir)
    assert len(files) >= 15  # GLUE tsv, CoNLL, PTB, WikiText, tiny Shakespeare, GPT-2 files, docs
    for path in files:
        for chunk in _slices(path.read_text(encoding="utf-8")):
            # whole chunk at once, then line by line (batched through the Rust backend for speed)
            e = hf.backend_tokenizer.encode(chunk)
            o = ours.encode_with_offsets(chunk)
            assert (o.ids, o.offsets) == (e.ids, e.offsets), path
            lines = chunk.splitlines()
            for line, e in zip(lines, hf.backend_tokenizer.encode_batch(lines)):
                o = ours.encode_with_offsets(line)
                assert (o.ids, o.offsets) == (e.ids, e.offsets), (path, line)


@pytest.mark.parametrize("name", VOCABS)
def test_every_code_point_matches_hf(toks, name):
    """Every assigned-or-nearby code point between two letters: ids and offsets equal HF's. This pins
    the Unicode-table patches in wordpiece.py (control, accents, punctuation, case). Planes 0-2, the
    used part of plane 3, plane 14's tags/selectors; the private-use planes 15-16 are sampled."""
    ours, hf = toks[name]
    cps = [c for c in (*range(0x32400), *range(0xE0000, 0xE1000), *range(0xF0000, 0x110000, 251))
           if not 0xD800 <= c < 0xE000]
    for i in range(0, len(cps), 20_000):
        text = " ".join(f"x{chr(c)}y" for c in cps[i:i + 20_000])
        e = hf.backend_tokenizer.encode(text)
        o = ours.encode_with_offsets(text)
        assert o.ids == e.ids and o.offsets == e.offsets, hex(cps[i])


# ---- random unicode ------------------------------------------------------------------------------------

_PIECES = st.sampled_from(["a", "Z", "é", "e\u0301", "ß", "İ", "Σ", "ς", "中", "\u3000", " ", "\t", "\n",
                           "\x00", "\x1c", "\x7f", "\u200b", "\ufffd", ".", "'", "-", "##", "[", "]",
                           "[MASK]", "[mask]", "[SEP]", "\u0890", "\U0002B820", "\uf900", "\u037e",
                           "ﬁ", "Ǆ", "ǅ", "\u0378", "\U0001F600", "unaffable", "Hello", "123"])
_TEXTS = st.one_of(st.text(st.characters(codec="utf-8"), max_size=60), st.lists(_PIECES, max_size=25).map("".join),
                   st.lists(st.one_of(_PIECES, st.characters(codec="utf-8")), max_size=25).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, pair=st.one_of(st.none(), _TEXTS))
def test_random_unicode_matches_hf(toks, text, pair):
    # transformers' tokenizer(text, "") drops an empty pair; we (and HF's Rust backend) give
    # [CLS] A [SEP] [SEP] for it, so the empty pair is compared against the backend below
    if pair == "":
        for ours, hf in toks.values():
            e, o = hf.backend_tokenizer.encode(text, ""), ours.encode_with_offsets(text, "")
            assert (o.ids, o.offsets, o.segment_ids) == (e.ids, e.offsets, e.type_ids)
        return
    for ours, hf in toks.values():
        assert_same(ours, hf, text, pair)


# ---- the fast paths against the plain path ----------------------------------------------------------

def plain_pieces(tok, text, split_special_tokens=False):
    """The plain path: typed special tokens, then basic_tokenize and wordpiece word by word, no caches."""
    ids, offsets, pos = [], [], 0
    parts = [text] if split_special_tokens else re.split(r"(\[(?:PAD|UNK|CLS|SEP|MASK)\])", text)
    for k, part in enumerate(parts):
        if k % 2:
            ids.append(tok.vocab[part])
            offsets.append((pos, pos + len(part)))
        else:
            for word, align in basic_tokenize(part, tok.lowercase):
                for i, a, b in wordpiece(word, tok.vocab, tok.unk_id):
                    ids.append(i)
                    offsets.append((pos + align[a], pos + align[b - 1] + 1))
        pos += len(part)
    return ids, offsets


def test_basic_tokenize_worked_example():
    assert basic_tokenize("Héllo, 世界!", lowercase=True) == [
        ("hello", (0, 1, 2, 3, 4)), (",", (5,)), ("世", (7,)), ("界", (8,)), ("!", (9,))]
    assert basic_tokenize("Héllo,\x00 x", lowercase=False) == [("Héllo", (0, 1, 2, 3, 4)), (",", (5,)), ("x", (8,))]


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, split=st.booleans())
def test_fast_pieces_equal_plain_pieces(toks, text, split):
    for ours, _ in toks.values():
        assert ours._pieces(text, split) == plain_pieces(ours, text, split)


@pytest.mark.parametrize("name", VOCABS)
def test_fast_pieces_equal_plain_pieces_on_real_data(toks, data_dir, name):
    ours = WordPiece(dict(toks[name][0].vocab), lowercase=VOCABS[name])  # fresh caches
    for path in _text_files(data_dir):
        text = path.read_text(encoding="utf-8")[:12_000]
        assert ours._pieces(text) == plain_pieces(ours, text), path
        for line in text.splitlines()[:100]:
            assert ours._pieces(line) == plain_pieces(ours, line), (path, line)


def plain_wordpiece_merges(counts, n_merges, known, min_frequency):
    """_learn_merges without incremental counts: count every pair, merge the best everywhere, repeat."""
    words = [([w[0]] + ["##" + c for c in w[1:]], f) for w, f in counts.items()]
    new = []
    while len(new) < n_merges:
        pairs = Counter()
        for syms, f in words:
            for p in zip(syms, syms[1:]):
                pairs[p] += f
        if not pairs or max(pairs.values()) < max(min_frequency, 1):
            return new
        (a, b) = min(pairs, key=lambda p: (-pairs[p], p))
        merged = a + b[2:]
        if merged not in known:
            known.add(merged)
            new.append(merged)
        for k, (syms, f) in enumerate(words):
            out, i = [], 0
            while i < len(syms):
                if syms[i:i + 2] == [a, b]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[k] = (out, f)
    return new


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("abcé", min_size=1, max_size=10), st.integers(1, 5), max_size=12),
       st.integers(0, 30), st.integers(1, 3))
def test_incremental_training_equals_plain_training(counts, n_merges, min_frequency):
    known = {t for w in counts for c in w for t in (c, "##" + c)}
    assert wp._learn_merges(Counter(counts), n_merges, set(known), min_frequency) == \
        plain_wordpiece_merges(counts, n_merges, set(known), min_frequency)


# ---- slow vs fast HF tokenizers -----------------------------------------------------------------------

# Inputs on which HF's slow BertTokenizer and fast BertTokenizerFast give different ids (found by a
# scan over every code point and a search over unicode categories). We follow the fast tokenizer.
DISAGREE = [
    ("uncased", "x\u0378y"),        # unassigned code point: slow drops it (category C*), fast keeps it
    ("cased", "x\u0378y"),
    ("uncased", "ΟΔΟΣ"),            # slow lowercases whole words (final sigma ς), fast char by char (σ)
    ("cased", "e\u0301"),           # slow NFC-composes to é first, fast keeps e + U+0301
    ("cased", "a\u037eb"),          # GREEK QUESTION MARK: NFC makes it ';' (punctuation) in slow only
    ("cased", "x\U0002B820y"),      # CJK table typo in Rust (0x2B920): not split off by fast
    ("uncased", "x\u0890y"),        # Cf in Python's Unicode 14, unknown to fast's older tables
]


@pytest.mark.parametrize("name,text", DISAGREE)
def test_slow_fast_disagreements_follow_fast(toks, data_dir, name, text):
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    ours, hf = toks[name]
    slow = legacy.BertTokenizerLegacy(str(data_dir / "bert-vocab" / f"bert-base-{name}-vocab.txt"),
                                      do_lower_case=VOCABS[name])
    assert slow(text)["input_ids"] != hf(text)["input_ids"]
    assert_same(ours, hf, text)


def test_known_offset_difference_canonical_reordering(toks):
    """The one difference we keep: uncased NFD reorders a spacing mark with a nonzero combining
    class before a lower-class non-spacing mark; Rust's offsets then point at the second character.
    Ids agree; we report the character the mark came from."""
    ours, hf = toks["uncased"]
    text = "\u302f\u309a"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.encode_with_offsets(text).offsets[1] == (0, 1) and hf(text, return_offsets_mapping=True)["offset_mapping"][1] == (1, 2)


# ---- pairs, truncation, specials --------------------------------------------------------------------

PAIR_A = "The quick brown fox jumps over the lazy dog, unaffably."
PAIR_B = "Ünïcödé text: 中文字符 and [MASK] tokens!"


@pytest.mark.parametrize("strategy", ["longest_first", "only_first", "only_second"])
@pytest.mark.parametrize("max_length", [3, 5, 8, 12, 17, 22, 40])
def test_pair_truncation_matches_hf(toks, strategy, max_length):
    for ours, hf in toks.values():
        for a, b in ((PAIR_A, PAIR_B), (PAIR_B, PAIR_A), (PAIR_A, PAIR_A), ("x", PAIR_B)):
            try:
                hf(a, b, max_length=max_length, truncation=strategy)
            except Exception:  # HF refuses (sequence too short): so do we, with a ValueError
                with pytest.raises(ValueError):
                    ours.encode_with_offsets(a, b, max_length=max_length, truncation=strategy)
                continue
            assert_same(ours, hf, a, b, max_length=max_length, truncation=strategy)
        if strategy != "only_second":
            assert_same(ours, hf, PAIR_A, max_length=max_length, truncation=strategy)


def test_encoding_layout_and_specials(toks):
    ours, hf = toks["uncased"]
    e = ours.encode_with_offsets("hello [MASK] world", "a [SEP]b")
    pieces = [ours.inv[i] for i in e.ids]
    assert pieces == ["[CLS]", "hello", "[MASK]", "world", "[SEP]", "a", "[SEP]", "b", "[SEP]"]
    assert e.segment_ids == [0] * 5 + [1] * 4
    assert e.special_mask == [1, 0, 0, 0, 1, 0, 0, 0, 1]  # typed specials count as text, as in HF
    assert e.offsets[2] == (6, 12) and e.offsets[6] == (2, 7)
    assert ours.tokenize("[mask]") == ["[", "mask", "]"]  # case-sensitive, on the raw text
    for text in ("a[MASK]b", "[[CLS]]", "[PAD][UNK] [SEP]", "é[MASK]é", "[MASK]\x00x", "[mask] [Mask]"):
        assert_same(ours, hf, text)
    with pytest.raises(ValueError, match="truncation"):
        ours.encode_with_offsets("a", truncation="bogus")
    with pytest.raises(ValueError, match="max_length 1"):
        ours.encode_with_offsets("a", max_length=1)
    with pytest.raises(ValueError, match="pair"):
        ours.encode_with_offsets("a b c", max_length=4, truncation="only_second")


def test_typed_special_tokens(toks):
    """[MASK] typed in the text is the mask token by default (fill-mask needs it, as HF); with
    split_special_tokens=True every typed character is text, as HF's flag of the same name."""
    for ours, hf in toks.values():
        for text in ("Paris is the [MASK] of France.", "a [SEP] b [CLS][PAD]", "x[UNK]y é[MASK]", "[MASK]"):
            assert ours.encode(text) == hf(text)["input_ids"]
            e, h = ours.encode_with_offsets(text, split_special_tokens=True), hf(text, split_special_tokens=True,
                                                                     return_offsets_mapping=True)
            assert e.ids == h["input_ids"] and e.offsets == [tuple(x) for x in h["offset_mapping"]], text
            assert set(ours.encode(text)[1:-1]) & ours.special_ids and not set(e.ids[1:-1]) & ours.special_ids
            assert ours.tokenize(text, split_special_tokens=True) == [ours.inv[i] for i in e.ids[1:-1]]
    ours, _ = toks["uncased"]
    pair = ours.encode_with_offsets("a [MASK]", "b [SEP]", split_special_tokens=True)
    assert ours.mask_id not in pair.ids and pair.ids.count(ours.sep_id) == 2
    from duolm.tokenizers import show_pieces  # `duolm tokenizer encode`: text unless --allow-special
    assert show_pieces(ours, "a [MASK]")[1] == ["[CLS]", "a", "[", "mask", "]", "[SEP]"]
    assert show_pieces(ours, "a [MASK]", allow_special=True)[1] == ["[CLS]", "a", "[MASK]", "[SEP]"]


def test_encoding_lists_built_once_and_gc_cheap(toks):
    """The lists are made on first read and then kept (a mutation sticks); until then an Encoding
    holds only tuples the garbage collector untracks, so keeping many of them stays cheap."""
    import gc
    ours, _ = toks["uncased"]
    e = ours.encode_with_offsets("héllo wörld, [MASK]!")
    gc.collect()
    gc.collect()  # the first pass untracks the inner (start, end) tuples, the second the outer one
    assert gc.is_tracked(e) and not gc.is_tracked(e._ids) and not gc.is_tracked(e._offsets)
    assert e.ids is e.ids and e.offsets is e.offsets and e.segment_ids is e.segment_ids
    e.ids.append(7)
    assert e.ids[-1] == 7 and e.segment_ids == [0] * 7  # segment/special lists keep the encoded length
    assert e.special_mask == [1, 0, 0, 0, 0, 0, 1]
    a, b = ours.encode_with_offsets("x y", "z"), ours.encode_with_offsets("x y", "z")
    assert a == b and a != ours.encode_with_offsets("x y") and a.ids == [101, 1060, 1061, 102, 1062, 102]
    assert repr(a) == ("Encoding(ids=[101, 1060, 1061, 102, 1062, 102], segment_ids=[0, 0, 0, 0, 1, 1], "
                       "offsets=[(0, 0), (0, 1), (2, 3), (0, 0), (0, 1), (0, 0)], special_mask=[1, 0, 0, 1, 0, 1])")


def test_caches_stay_bounded_and_exact(toks, monkeypatch):
    from duolm.tokenizers import wordpiece as wp
    _, hf = toks["uncased"]
    ours = WordPiece(dict(toks["uncased"][0].vocab))
    monkeypatch.setattr(wp, "_CACHE_SIZE", 8)
    text = "naïve café déjà vu, Ōsaka 東京 über straße crème brûlée"
    for _ in range(3):
        for line in (text, text.upper(), text + " x"):
            assert_same(ours, hf, line)
    assert len(ours._chunks) <= 8 and len(ours._cache) <= 8


def test_decode_matches_hf(toks):
    for ours, hf in toks.values():
        for text in ("Hello , world . isn't it? unaffable [MASK] naïve 中文", "a.b,c!d?e 's do not", ""):
            ids = hf(text)["input_ids"]
            assert ours.decode(ids) == hf.decode(ids)      # special tokens included, as HF's default
            assert ours.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="outside"):
        ours.decode([10**9])


def test_tokenizer_protocol(toks):
    """encode gives the ids of encode_with_offsets ([CLS] pieces [SEP]); pieces spell them as vocab.txt does."""
    from duolm.tokenizers import Tokenizer

    for ours, hf in toks.values():
        tok: Tokenizer = ours
        for text in ("Hello, unaffable world [MASK]!", "naïve 中文", ""):
            ids = tok.encode(text)
            assert ids == ours.encode_with_offsets(text).ids == hf(text)["input_ids"]
            assert tok.pieces(ids) == hf.convert_ids_to_tokens(ids)
        assert tok.special_tokens == {s: hf.convert_tokens_to_ids(s) for s in ("[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                                 "[MASK]")}
        assert (tok.kind, tok.vocab_size) == ("wordpiece", hf.vocab_size)
    with pytest.raises(ValueError, match="outside"):
        ours.pieces([10**9])


# ---- the algorithm itself ----------------------------------------------------------------------------

def test_longest_match_first_worked_example(tmp_path):
    vocab = {t: i for i, t in enumerate([*SPECIALS, "un", "una", "##aff", "##able", "##a", "##ff", "##ab",
                                         "##le", "ab", "a", "##bc"])}
    # From position 0 the longest vocab prefix is "una" (not "un"), then "##ff", then "##able":
    # greedy longest-match-first never backtracks to the equally valid un ##aff ##able.
    assert _names(vocab, wordpiece("unaffable", vocab, 1)) == ["una", "##ff", "##able"]
    assert wordpiece("unaffable", vocab, 1) == ((vocab["una"], 0, 3), (vocab["##ff"], 3, 5), (vocab["##able"], 5, 9))
    # greedy can fail where another split exists: "ab" + "##c" is missing, "a" + "##bc" would work
    assert wordpiece("abc", vocab, 1) == ((1, 0, 3),)
    assert wordpiece("x" * (MAX_CHARS_PER_WORD + 1), vocab, 1) == ((1, 0, MAX_CHARS_PER_WORD + 1),)
    # and HF agrees on this vocabulary
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in vocab), encoding="utf-8")
    ours, hf = WordPiece.from_vocab(tmp_path / "vocab.txt"), BertTokenizerFast(str(tmp_path / "vocab.txt"))
    for text in ("unaffable", "abc", "ab ableable", "x" * 101):
        assert_same(ours, hf, text)


def _names(vocab, pieces):
    inv = {i: t for t, i in vocab.items()}
    return [inv[i] for i, _, _ in pieces]


# ---- bad input -----------------------------------------------------------------------------------------

def test_bad_input(toks):
    ours, hf = toks["uncased"]
    assert ours.encode("") == [ours.cls_id, ours.sep_id]
    assert ours.tokenize("") == [] and ours.tokenize(" \t\n\x00\x7f\ufffd") == []
    for text in ("a\x00b", "\x00", "a\x01\x1fb\x7fc", "x\u200by", "a\ufffdb", " \t\r\n x \u3000 "):
        assert_same(ours, hf, text)
    # lone surrogates (HF's fast tokenizer raises TypeError): dropped like other category-C characters
    assert ours.encode("a\ud800b \udfff") == hf("ab ")["input_ids"]
    assert ours.encode_with_offsets("a\ud800b").offsets[1] == (0, 3)
    # words longer than 100 characters are one [UNK]; 100 characters are still split
    assert ours.tokenize("a" * 101) == ["[UNK]"] and ours.tokenize("a" * 100) != ["[UNK]"]
    for text in ("a" * 100, "a" * 101, "é" * 101, "x " + "ab" * 60 + ".z"):
        assert_same(ours, hf, text)


def test_million_character_inputs(toks):
    ours, hf = toks["uncased"]
    e = ours.encode_with_offsets("a" * 1_000_000)
    assert e.ids == [ours.cls_id, ours.unk_id, ours.sep_id] and e.offsets[1] == (0, 1_000_000)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzé中,.") for _ in range(rng.randint(1, 12)))
             for _ in range(100_000)]
    text = " ".join(words)[:1_000_000]
    e = ours.encode_with_offsets(text)
    h = hf.backend_tokenizer.encode(text)
    assert e.ids == h.ids and e.offsets == h.offsets


# ---- files ---------------------------------------------------------------------------------------------

def test_vocab_file_errors(tmp_path):
    good = "".join(t + "\n" for t in [*SPECIALS, "a", "##b"])
    cases = {
        "bad_utf8": (good.encode() + b"\xff\xfe\n", "line 8"),
        "truncated": (good.encode() + "é".encode()[:1], "line 8"),
        "duplicate": ((good + "a\n").encode(), "line 8.*line 6"),
        "empty_line": ((good + "\nz\n").encode(), "line 8"),
        "empty": (b"", "empty"),
        "no_specials": (b"a\nb\n", "special"),
    }
    for name, (data, msg) in cases.items():
        p = tmp_path / f"{name}.txt"
        p.write_bytes(data)
        with pytest.raises(ValueError, match=msg) as err:
            WordPiece.from_vocab(p)
        if name != "no_specials":
            assert str(p) in str(err.value)
    with pytest.raises(FileNotFoundError):
        WordPiece.from_vocab(tmp_path / "missing.txt")
    (tmp_path / "ok.txt").write_text(good.rstrip("\n"), encoding="utf-8")  # no final newline is fine
    assert WordPiece.from_vocab(tmp_path / "ok.txt").vocab_size == 7


@pytest.mark.parametrize("name", VOCABS)
def test_save_load_round_trip(toks, tmp_path, name):
    ours, _ = toks[name]
    ours.save(tmp_path)
    back = WordPiece.load(tmp_path)
    assert back.vocab == ours.vocab and back.lowercase == ours.lowercase
    hf = BertTokenizerFast.from_pretrained(str(tmp_path))
    for text in (PAIR_A, PAIR_B, "Ünïcödé ΟΔΟΣ"):
        assert_same(back, hf, text)


# ---- training ------------------------------------------------------------------------------------------

def test_train_worked_example():
    # counts: "aaab" x2, "ab" x1 -> pairs (##a,##a) 2, (a,##a) 2, (##a,##b) 2, (a,##b) 1
    tok = WordPiece.train(["aaab aaab ab"], vocab_size=5 + 4 + 2)
    # ties between the count-2 pairs go to the smallest pair: ("##a", "##a") < ("##a", "##b") < ("a", "##a");
    # then "aaab" is a ##aa ##b: (##aa, ##b) 2 and (a, ##aa) 2 tie, ("##aa", "##b") is smaller
    assert list(tok.vocab)[5:] == ["a", "##a", "b", "##b", "##aa", "##aab"]
    assert tok.tokenize("aaab ab aab") == ["a", "##aab", "a", "##b", "a", "##a", "##b"]
    with pytest.raises(ValueError, match="vocab_size 3"):
        WordPiece.train(["abc"], vocab_size=3)


def test_training_reports_progress_and_prints_nothing(capsys):
    """progress(done, total) after each new piece: done 1, 2, ... up to total = the pieces asked for; when
    the pairs run out first, a last call (done, done). Nothing reaches stdout or stderr."""
    calls = []
    tok = WordPiece.train(["aaab aaab ab"], vocab_size=5 + 4 + 2, progress=lambda *a: calls.append(a))
    assert calls == [(1, 2), (2, 2)] and tok.vocab_size == 11
    calls.clear()
    tok = WordPiece.train(["aaab aaab ab"], vocab_size=100, progress=lambda *a: calls.append(a))
    n = tok.vocab_size - 9
    assert 2 < n < 91 and calls == [(i, 91) for i in range(1, n + 1)] + [(n, n)]
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("lowercase", [True, False])
def test_train_save_loads_in_hf(data_dir, tmp_path, lowercase):
    lines = (data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines()
    train, held_out = lines[:8000], lines[8000:9000] + ["Ünïcödé ΟΔΟΣ [MASK] 中文"]
    tok = WordPiece.train(train, vocab_size=1500, lowercase=lowercase)
    assert tok.vocab_size == 1500 and list(tok.vocab)[:5] == list(SPECIALS)
    for c in {c for line in train for c in (line.lower() if lowercase else line) if not c.isspace()}:
        assert c in tok.vocab and "##" + c in tok.vocab
    assert tok.vocab == WordPiece.train(train, vocab_size=1500, lowercase=lowercase).vocab  # deterministic
    assert "the" in tok.vocab and "[UNK]" not in tok.tokenize("ROMEO: Thou art, my lord?")
    tok.save(tmp_path)
    hf = BertTokenizerFast.from_pretrained(str(tmp_path))
    assert hf.do_lower_case == lowercase
    back = WordPiece.load(tmp_path)
    for text in held_out:
        assert_same(back, hf, text)


# ---- where a text may be cut, training that learns nothing, failed saves, bad files -----------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_PIECES, st.sampled_from(["\n", "\n\n", "\r\n", " \n "])), max_size=40).map("".join),
       st.integers(1, 20))
def test_safe_chunks_encode_like_the_whole(toks, text, chunk_chars):
    ours, _ = toks["uncased"]
    chunks = ours.safe_chunks(text, chunk_chars)
    assert "".join(chunks) == text and all(chunks) and all(len(c) >= chunk_chars for c in chunks[:-1])
    assert [i for c in chunks for i in ours.encode(c)[1:-1]] == ours.encode(text)[1:-1]


def test_safe_chunks_on_real_data(toks, data_dir):
    ours, _ = toks["cased"]
    text = (data_dir / "conll2003" / "eng.testa").read_text(encoding="utf-8")[:200_000]
    chunks = ours.safe_chunks(text, 5000)
    assert len(chunks) >= 30 and "".join(chunks) == text
    assert [t for c in chunks for t in ours.tokenize(c)] == ours.tokenize(text)
    with pytest.raises(ValueError, match="chunk_chars"):
        ours.safe_chunks(text, 0)


def hf_words(texts, lowercase) -> list[str]:
    """The words HF tokenizers' WordPieceTrainer counts: BertNormalizer, then BertPreTokenizer; it skips empty ones."""
    from tokenizers import normalizers, pre_tokenizers
    norm, pre = normalizers.BertNormalizer(lowercase=lowercase), pre_tokenizers.BertPreTokenizer()
    return [w for t in texts for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)) if w]


def check_trains_like_hf(texts, lowercase, held_out=()):
    """WordPiece.train on `texts`: its single characters are HF's alphabet (each also as "##c"), training fails
    only where HF's words hold no pair to merge, and the trained tokenizer encodes every text as HF's encoder
    (the `tokenizers` library) with the same vocabulary: ids and offsets."""
    from tokenizers import BertWordPieceTokenizer
    words = hf_words(texts, lowercase)
    alphabet = {c for w in words for c in w}
    if not any(len(w) > 1 for w in words):
        with pytest.raises(ValueError, match="nothing was learned"):
            WordPiece.train(texts, vocab_size=len(SPECIALS) + 2 * len(alphabet) + 1, lowercase=lowercase, min_frequency=1)
        return
    ours = WordPiece.train(texts, vocab_size=len(SPECIALS) + 2 * len(alphabet) + 20, lowercase=lowercase, min_frequency=1)
    assert {t for t in ours.vocab if len(t) == 1} == alphabet and all("##" + c in ours.vocab for c in alphabet)
    hf = BertWordPieceTokenizer(ours.vocab, lowercase=lowercase)
    for text in [*texts, *held_out]:
        e, o = hf.encode(text), ours.encode_with_offsets(text)
        assert (o.ids, o.offsets) == (e.ids, e.offsets), text


# lone combining marks (U+103A is WikiText-103's), zero-width and format characters, controls, soft hyphen
_ODD = ["\u103a", "\u0301", "\u0300", "\u0e31", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad",
        "\x00", "\x1c", "\x7f", "\x85", "\ufffd", "\u3000", " ", "\n", "\t"]
_WORDY = st.lists(st.one_of(st.sampled_from(_ODD), _PIECES, st.characters(codec="utf-8")), max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(_WORDY, min_size=1, max_size=4), _WORDY, st.booleans())
def test_any_text_trains_and_encodes_as_hf(texts, held_out, lowercase):
    check_trains_like_hf(texts, lowercase, [held_out])


def test_training_on_wikitext_103_burmese_marks(data_dir):
    """The Mongol invasions of Burma (WikiText-103 valid): "<unk> ်", a word of U+103A alone, that lowercasing
    empties; it once ended training with an IndexError."""
    lines = (data_dir / "wikitext-103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()
    start = lines.index(" = First Mongol invasion of Burma = ")
    end = next(i for i in range(start + 1, len(lines)) if re.fullmatch(r" = [^=].* = ", lines[i]))   # the next article
    article = [line for line in lines[start:end] if line.strip()]
    assert any(" \u103a " in line for line in article)
    for lowercase in (True, False):
        check_trains_like_hf(article, lowercase, ["The Mongol invasions of Burma \u103a were a series."])
    tok = WordPiece.train(article, vocab_size=600)
    assert tok.tokenize("Burmese : \u103a \u103a") == tok.tokenize("Burmese :")


@pytest.mark.parametrize("texts", [[], [""], [" \n\t\x00"], ["a b c"], ["ab cd"], ["\u103a \u0301\u200b"]])
def test_training_that_learns_nothing_raises(texts):
    with pytest.raises(ValueError, match="nothing was learned"):
        WordPiece.train(texts, vocab_size=100)


def test_failed_save_leaves_the_old_files(toks, tmp_path, monkeypatch):
    """The disk fills when the new files are flushed (fsync): both old files stay, and no temp file."""
    import os
    toks["uncased"][0].save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        toks["cased"][0].save(tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert WordPiece.load(tmp_path).lowercase is True


def test_bad_config_and_vocab_name_the_file(tmp_path):
    good = "".join(t + "\n" for t in [*SPECIALS, "a", "##b"])
    (tmp_path / "vocab.txt").write_text(good, encoding="utf-8")
    for text, msg in (("{", "not valid JSON"), ('{"do_lower_case": "yes"}', "do_lower_case"), ("[1]", "JSON object")):
        (tmp_path / "tokenizer_config.json").write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=rf"tokenizer_config\.json: .*{msg}"):
            WordPiece.load(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "vocab.txt").write_bytes(good.encode() + b"\xc3(\n")  # no config: the case is inferred after reading
    with pytest.raises(ValueError, match=r"vocab\.txt, line 8: not valid UTF-8"):
        WordPiece.load(tmp_path)
