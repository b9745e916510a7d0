"""BERT's tokenizer: the basic tokenizer (clean, CJK, lowercase + strip accents, split punctuation)
followed by greedy longest-match-first WordPiece with "##" continuation pieces.

Which reference we follow. HF ships two BERT tokenizers that disagree on some inputs; we follow the
fast one (`BertTokenizerFast`, the Rust `tokenizers` library): it is what `tokenizer(text)` gives in
transformers today and it defines the character offsets we return. Where they disagree (a scan of
every code point; pinned in tests/test_wordpiece.py::test_slow_fast_disagreements_follow_fast):
  - unassigned code points (category Cn, ~110k in planes 0-3): the slow one drops them as
    "control", the fast one keeps them ("x\u0378y" -> [UNK] in fast, x ##y in slow);
  - the slow one lowercases whole words (Greek final sigma: "ΟΔΟΣ" -> ##ος), the fast one
    character by character (-> ##ο ##σ);
  - the slow one NFC-normalises first: "e\u0301", U+0341, U+037E (-> ";"), CJK compatibility
    ideographs give other pieces in the cased vocabulary;
  - the Rust CJK table has 0x2B920..0x2CEAF where the Python one has 0x2B820..: the 256 ideographs
    U+2B820..U+2B91F are not split off as single characters by the fast tokenizer;
  - the slow one uses Python's unicodedata (Unicode 14 on Python 3.11), the fast one older tables
    for "control", "punctuation" and "non-spacing mark" and Rust's (newer) lowercase table. The
    _HF_* tables below list those code points, so we match the fast tokenizer on every code point
    under Python's Unicode 14.0.0 (the tables are switched off under another Unicode version).
Special tokens typed in the text: "[MASK]" written by a user becomes the [MASK] id, as in both HF
tokenizers (the fast one matches the five specials on the raw text, case-sensitively, before
normalisation); "[mask]" is plain text. Lone surrogates (which the fast tokenizer refuses with a
TypeError) are dropped like other category-C characters.
Known difference (offsets only, ids equal): with uncased NFD, Rust reorders a spacing mark of nonzero
combining class before a following lower-class non-spacing mark ("\u302f\u309a") and then reports
the second character's span; we normalise character by character and report the first.
"""
from __future__ import annotations

import heapq
import json
import re
import unicodedata
from collections import Counter
from itertools import accumulate, islice
from pathlib import Path
from typing import Iterable

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_CHARS_PER_WORD = 100  # longer words become [UNK] (HF max_input_chars_per_word)
_CACHE_SIZE = 1 << 17     # words; the cache is emptied when full so memory stays bounded

# ---------------------------------------------------------------------------------------------
# Character classes of the basic tokenizer (as HF tokenizers' BertNormalizer + BertPreTokenizer).

# Whitespace: \t \n \r and category Z (equal to Unicode's White_Space minus the control chars,
# which are removed before whitespace is looked at).
_WS = "\t\n\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CHUNK = re.compile(f"[^{_WS}]+")
# ASCII fast path: a chunk of ASCII letters/digits/punctuation with no control characters.
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
_ASCII_SAFE = re.compile(f"[A-Za-z0-9{_ASCII_PUNCT}]*")
_ASCII_WORD = re.compile(f"[A-Za-z0-9]+|[{_ASCII_PUNCT}]")
_ASCII_SPLIT = re.compile(f"([A-Za-z0-9]+|[{_ASCII_PUNCT}])")
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPECIAL_SPLIT = re.compile(r"(\[(?:PAD|UNK|CLS|SEP|MASK)\])")


def _is_chinese(cp: int) -> bool:
    # HF tokenizers' table, including its 0x2B920 (the Python/BERT table says 0x2B820).
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _ranges(spec: str) -> frozenset:
    out = set()
    for part in spec.split():
        a, _, b = part.partition("-")
        out.update(range(int(a, 16), int(b or a, 16) + 1))
    return frozenset(out)


# Where HF tokenizers' Unicode tables differ from Python 3.11's unicodedata (Unicode 14.0.0).
# Found by scanning every code point against BertTokenizerFast (tokenizers 0.23); the test
# `test_every_code_point_matches_hf` re-checks them all.
_HF_KEPT = _ranges("890-891 8E2 110CD 13430-13438")  # category Cf in Python, kept by HF
_HF_NOT_MN = _ranges(  # category Mn in Python, not stripped as an accent by HF
    "7FD 898-89F 8CA-8E1 9FE AFA-AFF B55 C04 C3C D00 D3B-D3C D81 EBA 180F 1885-1886 1ABF-1ACE "
    "1DF6-1DFB A82C A8C5 A8FF A9BD 10D24-10D27 10EAB-10EAC 10F46-10F50 10F82-10F85 11070 "
    "11073-11074 110C2 111C9 111CF 1123E 1133B 11438-1143F 11442-11444 11446 1145E 1182F-11837 "
    "11839-1183A 1193B-1193C 1193E 11943 119D4-119D7 119DA-119DB 119E0 11A01-11A0A 11A33-11A38 "
    "11A3B-11A3E 11A47 11A51-11A56 11A59-11A5B 11A8A-11A96 11A98-11A99 11C30-11C36 11C38-11C3D "
    "11C3F 11C92-11CA7 11CAA-11CB0 11CB2-11CB3 11CB5-11CB6 11D31-11D36 11D3A 11D3C-11D3D "
    "11D3F-11D45 11D47 11D90-11D91 11D95 11D97 11EF3-11EF4 16F4F 16FE4 1CF00-1CF2D 1CF30-1CF46 "
    "1E000-1E006 1E008-1E018 1E01B-1E021 1E023-1E024 1E026-1E02A 1E130-1E136 1E2AE 1E2EC-1E2EF "
    "1E944-1E94A")
_HF_MN = _ranges("1734")  # Mc in Python 3.11, stripped as an accent by HF
_HF_NOT_PUNCT = _ranges(  # category P* in Python, not punctuation for HF
    "61D 9FD A76 C77 C84 1B7D-1B7E 2E43-2E4F 2E52-2E5D 10EAD 10F55-10F59 10F86-10F89 1144B-1144F "
    "1145A-1145B 1145D 11660-1166C 116B9 1183B 11944-11946 119E2 11A3F-11A46 11A9A-11A9C "
    "11A9E-11AA2 11C41-11C45 11C70-11C71 11EF7-11EF8 11FFF 12FF1-12FF2 16E97-16E9A 16FE2 "
    "1E95E-1E95F")
_HF_PUNCT = _ranges("166D 111C9")  # punctuation for HF, not P* in Python 3.11
_HF_NO_NFD = _ranges("11938")  # decomposed by Python's NFD, not by HF's
# Lowercase mappings Rust knows (Unicode 16) for code points unassigned in Unicode 14.
_HF_LOWER = {0x1C89: 0x1C8A, 0xA7CB: 0x264, 0xA7CC: 0xA7CD, 0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3,
             0xA7D4: 0xA7D5, 0xA7DA: 0xA7DB, 0xA7DC: 0x19B,
             **{cp: cp + 0x20 for cp in range(0x10D50, 0x10D66)},
             **{cp: cp + 0x1B for cp in range(0x16EA0, 0x16EB9)}}
_HF_TABLE_PATCHES = unicodedata.unidata_version == "14.0.0"


def _is_punct(c: str) -> bool:
    cp = ord(c)
    if _HF_TABLE_PATCHES and (cp in _HF_PUNCT or cp in _HF_NOT_PUNCT):
        return cp in _HF_PUNCT
    return (33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
            or unicodedata.category(c)[0] == "P")


def _is_removed(c: str) -> bool:
    cp = ord(c)
    if cp == 0 or cp == 0xFFFD:
        return True
    if c in "\t\n\r" or (_HF_TABLE_PATCHES and cp in _HF_KEPT):
        return False
    return unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs")


def _is_mn(c: str) -> bool:
    cp = ord(c)
    if _HF_TABLE_PATCHES and (cp in _HF_NOT_MN or cp in _HF_MN):
        return cp in _HF_MN
    return unicodedata.category(c) == "Mn"


def _lower(c: str) -> str:
    if _HF_TABLE_PATCHES and ord(c) in _HF_LOWER:
        return chr(_HF_LOWER[ord(c)])
    return c.lower()  # one char at a time: no final-sigma rule, as Rust's char::to_lowercase


# What the basic tokenizer does with one character of the input:
_KEEP, _SPACE, _ALONE, _MIXED = 0, 1, 2, 3  # word chars / boundary / CJK word / may hold punctuation


def _classify(c: str, lowercase: bool) -> tuple[int, str]:
    """(kind, normalised chars) for one input character; order as HF: clean, CJK, accents, case."""
    if _is_removed(c):
        return _KEEP, ""
    if c in "\t\n\r" or unicodedata.category(c)[0] == "Z":
        return _SPACE, ""
    out = c
    if lowercase:  # uncased BERT: strip accents (NFD, drop Mn), then lowercase
        if not (_HF_TABLE_PATCHES and ord(c) in _HF_NO_NFD):
            out = unicodedata.normalize("NFD", c)
        out = "".join(_lower(ch) for ch in out if not _is_mn(ch))
    if _is_chinese(ord(c)):
        return _ALONE, out
    if any(_is_punct(ch) or ch.isspace() for ch in out):
        return _MIXED, out
    return _KEEP, out


# ---------------------------------------------------------------------------------------------
# WordPiece proper.

def wordpiece(word: str, vocab: dict[str, int], unk_id: int, max_piece: int = 1 << 30
              ) -> tuple[tuple[int, int, int], ...]:
    """Greedy longest-match-first split of one pre-tokenized word.

    Returns (id, start, end) per piece, start/end in characters of `word`. Pieces after the first
    are looked up with the "##" prefix. A word with any unmatched position, or longer than
    MAX_CHARS_PER_WORD characters, is one [UNK]. `max_piece` (the longest vocab entry) only bounds
    the search. Example with vocab {un, ##aff, ##able, ##a}: "unaffable" -> un ##aff ##able.
    """
    n = len(word)
    if n > MAX_CHARS_PER_WORD:
        return ((unk_id, 0, n),)
    out = []
    start = 0
    while start < n:
        end = min(n, start + max_piece)
        while end > start:
            sub = word[start:end] if start == 0 else "##" + word[start:end]
            i = vocab.get(sub)
            if i is not None:
                out.append((i, start, end))
                break
            end -= 1
        else:
            return ((unk_id, 0, n),)
        start = end
    return tuple(out)


class Encoding:
    """One encoded input: [CLS] A [SEP] (B [SEP]); attributes ids, segment_ids, offsets and
    special_mask, each a list.

    offsets are (start, end) character spans into the original text of the segment the token came
    from ((0, 0) for [CLS]/[SEP]), as HF's offset_mapping; special_mask is 1 for the added
    [CLS]/[SEP] only (a "[MASK]" typed in the text counts as text, as in HF).
    Each list is built on its first read (later reads return that same list): until then an
    Encoding holds tuples, which Python's garbage collector stops scanning, so keeping millions
    of encodings does not make every collection walk all their lists (it tripled the time of
    [tok.encode(line) for line in lines]).
    """
    __slots__ = ("_ids", "_offsets", "_n", "_m", "_segment_ids", "_special_mask")

    def __init__(self, ids: tuple, offsets: tuple, n_first: int):  # n_first: tokens of segment 0
        self._ids, self._offsets, self._n, self._m = ids, offsets, n_first, len(ids) - n_first
        self._segment_ids = self._special_mask = None

    @property
    def ids(self) -> list[int]:
        if type(self._ids) is tuple:
            self._ids = list(self._ids)
        return self._ids

    @property
    def offsets(self) -> list[tuple[int, int]]:
        if type(self._offsets) is tuple:
            self._offsets = list(self._offsets)
        return self._offsets

    @property
    def segment_ids(self) -> list[int]:
        if self._segment_ids is None:
            self._segment_ids = [0] * self._n + [1] * self._m
        return self._segment_ids

    @property
    def special_mask(self) -> list[int]:
        if self._special_mask is None:
            n, m = self._n, self._m
            self._special_mask = [1, *[0] * (n - 2), 1, *[0] * (m - 1), *[1] * (m > 0)]
        return self._special_mask

    def __eq__(self, other):
        if not isinstance(other, Encoding):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in _ENCODING_FIELDS)

    __hash__ = None

    def __repr__(self):
        return "Encoding(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _ENCODING_FIELDS) + ")"


_ENCODING_FIELDS = ("ids", "segment_ids", "offsets", "special_mask")


class WordPiece:
    """BERT's WordPiece tokenizer over a vocab.txt vocabulary (token per line, id = line number)."""

    def __init__(self, vocab: dict[str, int], lowercase: bool = True):
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise ValueError(f"vocabulary lacks the special token(s) {missing}; BERT needs {list(SPECIALS)}")
        self.vocab = dict(vocab)
        self.lowercase = bool(lowercase)
        self.inv = {i: t for t, i in self.vocab.items()}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self.vocab[s] for s in SPECIALS)
        self.special_ids = frozenset(self.vocab[s] for s in SPECIALS)
        self._max_piece = max(len(t) for t in self.vocab)
        self._chars: dict[str, tuple[int, str]] = {}  # _classify cache (bounded by the alphabet)
        self._cache: dict[str, tuple] = {}  # word -> pieces
        self._chunks: dict[str, tuple] = {}  # whitespace-free chunk -> its words (see _words)
        self._seed_cache()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _seed_cache(self):
        self._cache.clear()
        for s in SPECIALS:  # typed specials arrive as one "word" (_SPECIAL_SPLIT); others never hold "["
            self._cache[s] = ((self.vocab[s], 0, len(s)),)

    # ---- files ---------------------------------------------------------------------------------
    @classmethod
    def from_vocab(cls, vocab_txt, lowercase: bool = True) -> "WordPiece":
        return cls(read_vocab(vocab_txt), lowercase=lowercase)

    @classmethod
    def load(cls, directory) -> "WordPiece":
        """vocab.txt + tokenizer_config.json's do_lower_case; without it, lower-case only when the
        vocabulary has no piece that lower-casing would change (an uncased vocabulary)."""
        d = Path(directory)
        lowercase = None
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            try:
                lowercase = json.loads(cfg.read_text(encoding="utf-8")).get("do_lower_case")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise ValueError(f"{cfg}: not a JSON object ({e}); delete it or rewrite it") from None
        vocab_txt = d / "vocab.txt"
        if lowercase is None:
            lowercase = _looks_uncased(vocab_txt)
        return cls.from_vocab(vocab_txt, lowercase=bool(lowercase))

    def save(self, directory) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tokens = [self.inv[i] for i in range(len(self.inv))]
        (d / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
        cfg = {"do_lower_case": self.lowercase, "tokenizer_class": "BertTokenizer",
               **{k: v for k, v in zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS)}}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    # ---- basic tokenizer -------------------------------------------------------------------------
    def _words(self, text: str, base: int, out: list) -> None:
        """Append (word, start, align) for each pre-token of text (no special-token handling).

        word is normalised; start is its index in the whole input (text begins at index base);
        align is None when word equals the input[start:start+len(word)] up to case, else a tuple
        giving, per character of word, the index of its original character counted from start.
        """
        if text.isascii() and not _ASCII_CONTROL.search(text):  # fast path: no normalisation but case
            out.extend((w.group(), base + w.start(), None) for w in _ASCII_WORD.finditer(text))
            return
        chunks = self._chunks
        for m in _CHUNK.finditer(text):
            chunk = m.group()
            words = chunks.get(chunk)
            if words is None:
                if len(chunks) >= _CACHE_SIZE:
                    chunks.clear()
                words = chunks[chunk] = self._split_chunk(chunk)
            start = base + m.start()
            for w, rel, align in words:
                out.append((w, start + rel, align))

    def _split_chunk(self, chunk: str) -> tuple:
        """(word, start in chunk, align) for the words of one whitespace-free chunk."""
        if chunk.isascii() and _ASCII_SAFE.fullmatch(chunk):
            return tuple((w.group(), w.start(), None) for w in _ASCII_WORD.finditer(chunk))
        chars, lowercase = self._chars, self.lowercase
        out, word, align = [], [], []
        for i, c in enumerate(chunk):
            r = chars.get(c)
            if r is None:
                r = chars[c] = _classify(c, lowercase)
            kind, norm = r
            if kind == _KEEP:
                word.append(norm)
                align.extend([i] * len(norm))
                continue
            if word:
                out.append(("".join(word), 0, tuple(align)))
                word, align = [], []
            if kind == _ALONE:
                out.append((norm, 0, (i,) * len(norm)))
            elif kind == _MIXED:
                for ch in norm:
                    if _is_punct(ch) or ch.isspace():
                        if word:
                            out.append(("".join(word), 0, tuple(align)))
                            word, align = [], []
                        if not ch.isspace():
                            out.append((ch, 0, (i,)))
                    else:
                        word.append(ch)
                        align.append(i)
        if word:
            out.append(("".join(word), 0, tuple(align)))
        return tuple(out)

    def _lookup(self, word: str, norm: str) -> tuple:
        """Cached wordpiece split of one pre-token; the cache is keyed by the raw ASCII word or the
        normalised word (the two agree: a normalised uncased word holds no capitals)."""
        if len(self._cache) >= _CACHE_SIZE:
            self._seed_cache()
        pieces = self._cache[word] = wordpiece(norm, self.vocab, self.unk_id, self._max_piece)
        return pieces

    def _pieces(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """ids and original-text offsets of text's word pieces (no [CLS]/[SEP])."""
        cache = self._cache
        if text.isascii() and "[" not in text and not _ASCII_CONTROL.search(text):
            # Fast path, no per-character Python: split into [sep, word, sep, word, ..., sep];
            # a word starts where the text before it ends.
            parts = _ASCII_SPLIT.split(text)
            words = parts[1::2]
            found = list(map(cache.get, words))
            if None in found:
                lower = self.lowercase
                found = [p if p is not None else self._lookup(w, w.lower() if lower else w)
                         for w, p in zip(words, found)]
            ids = [i for p in found for i, _, _ in p]
            starts = islice(accumulate(map(len, parts)), 0, None, 2)
            offsets = [(s + a, s + b) for s, p in zip(starts, found) for _, a, b in p]
            return ids, offsets
        words: list = []
        parts = _SPECIAL_SPLIT.split(text) if "[" in text else (text,)
        pos = 0
        for k, part in enumerate(parts):
            if k % 2:  # a special token typed in the text
                words.append((part, pos, None))
            elif part:
                self._words(part, pos, words)
            pos += len(part)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        lower = self.lowercase
        for w, start, align in words:
            pieces = cache.get(w)
            if pieces is None:
                pieces = self._lookup(w, w.lower() if lower and align is None else w)
            if align is None:
                for i, a, b in pieces:
                    ids.append(i)
                    offsets.append((start + a, start + b))
            else:
                for i, a, b in pieces:
                    ids.append(i)
                    offsets.append((start + align[a], start + align[b - 1] + 1))
        return ids, offsets

    def tokenize(self, text: str) -> list[str]:
        """Word pieces of text as strings (no [CLS]/[SEP])."""
        return [self.inv[i] for i in self._pieces(text)[0]]

    # ---- encode / decode ---------------------------------------------------------------------------
    def encode(self, text: str, pair: str | None = None, max_length: int | None = None,
               truncation: str = "longest_first") -> Encoding:
        """[CLS] text [SEP] (pair [SEP]) with segment ids, offsets and special mask, as HF's
        tokenizer(text, pair, max_length=..., truncation=...)."""
        if truncation not in ("longest_first", "only_first", "only_second"):
            raise ValueError(f"truncation must be 'longest_first', 'only_first' or 'only_second', not {truncation!r}")
        a_ids, a_off = self._pieces(text)
        b_ids, b_off = self._pieces(pair) if pair is not None else ((), ())
        if max_length is not None:
            n_a, n_b = _truncated_lengths(len(a_ids), len(b_ids), pair is not None, max_length, truncation)
            a_ids, a_off, b_ids, b_off = a_ids[:n_a], a_off[:n_a], b_ids[:n_b], b_off[:n_b]
        cls, sep, none = self.cls_id, self.sep_id, (0, 0)
        if pair is None:
            return Encoding((cls, *a_ids, sep), (none, *a_off, none), len(a_ids) + 2)
        return Encoding((cls, *a_ids, sep, *b_ids, sep), (none, *a_off, none, *b_off, none), len(a_ids) + 2)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ids as HF's WordPiece decoder: pieces joined by spaces, "##" pieces glued on,
        " ." " ," " ?" " !" glued to the word before; specials left out unless skip_special=False."""
        out = []
        for i in ids:
            t = self.inv.get(int(i))
            if t is None:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self.inv) - 1})")
            if skip_special and int(i) in self.special_ids:
                continue
            if out:
                t = t[2:] if t.startswith("##") else " " + t
                for dirty, clean in _CLEANUP:
                    t = t.replace(dirty, clean)
            out.append(t)
        return "".join(out)

    # ---- training ------------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, lowercase: bool = True, progress: bool = False,
              min_frequency: int = 2) -> "WordPiece":
        """Learn a WordPiece vocabulary the way HF tokenizers' WordPieceTrainer does: BPE merges of
        the most frequent adjacent pair over pre-tokenized words, non-initial symbols carrying "##".

        The vocabulary is the five specials, every character seen with and without "##" (so any
        word of seen characters splits without [UNK]), then merged pieces in merge order until
        vocab_size. Ties go to the lexicographically smallest pair (deterministic).
        """
        base = cls({s: i for i, s in enumerate(SPECIALS)}, lowercase=lowercase)
        counts: Counter = Counter()
        for text in texts:
            words: list = []
            base._words(text, 0, words)
            counts.update(w.lower() if lowercase and a is None else w for w, _, a in words)
        for s in SPECIALS:  # specials typed in the text are not words to learn from
            counts.pop(s, None)
        alphabet = sorted({c for w in counts for c in w})
        tokens = list(SPECIALS) + [t for c in alphabet for t in (c, "##" + c)]
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(SPECIALS)} special tokens + "
                             f"2 x {len(alphabet)} characters seen = {len(tokens)}; ask for at least that")
        tokens += _learn_merges(counts, vocab_size - len(tokens), set(tokens), min_frequency, progress)
        return cls({t: i for i, t in enumerate(tokens)}, lowercase=lowercase)


_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _truncated_lengths(n_a: int, n_b: int, has_pair: bool, max_length: int, strategy: str) -> tuple[int, int]:
    """Lengths of A and B after truncation, as HF tokenizers' truncate_encodings."""
    n_special = 3 if has_pair else 2
    if max_length < n_special:
        raise ValueError(f"max_length {max_length} leaves no room for the {n_special} [CLS]/[SEP] tokens")
    budget = max_length - n_special
    if n_a + n_b <= budget:
        return n_a, n_b
    if budget == 0:  # HF empties both sequences whatever the strategy
        return 0, 0
    if strategy == "longest_first":
        if not has_pair:
            return budget, 0
        n1, n2, swap = (n_b, n_a, True) if n_a > n_b else (n_a, n_b, False)  # n1 is the shorter
        n2 = n1 if n1 > budget else max(n1, budget - n1)
        if n1 + n2 > budget:
            n1 = budget // 2
            n2 = n1 + budget % 2
        return (n2, n1) if swap else (n1, n2)
    if strategy == "only_second" and not has_pair:
        raise ValueError("truncation='only_second' needs a pair")
    remove = n_a + n_b - budget
    target = n_a if strategy == "only_first" else n_b
    if target <= remove:
        raise ValueError(f"truncation={strategy!r}: that sequence has {target} tokens, {remove} must go to fit "
                         f"max_length {max_length}; use 'longest_first' or a larger max_length")
    return (n_a - remove, n_b) if strategy == "only_first" else (n_a, n_b - remove)


def _learn_merges(counts: Counter, n_merges: int, known: set, min_frequency: int, progress: bool) -> list[str]:
    """BPE merges with "##" continuation symbols; returns the new tokens in order (at most n_merges).

    Pair counts are kept incrementally: a merge only revisits the words that contain the pair.
    """
    words = [[w[0]] + ["##" + c for c in w[1:]] for w in counts]
    freq = list(counts.values())
    pairs: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for k, (syms, f) in enumerate(zip(words, freq)):
        for p in zip(syms, syms[1:]):
            pairs[p] += f
            where.setdefault(p, set()).add(k)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n_merges, desc="wordpiece", unit="token")
    new: list[str] = []
    while len(new) < n_merges and heap:
        c, p = heapq.heappop(heap)
        if pairs.get(p, 0) != -c:
            continue  # stale heap entry
        if -c < max(min_frequency, 1):
            break
        a, b = p
        merged = a + b[2:]
        if merged not in known:
            known.add(merged)
            new.append(merged)
            if bar is not None:
                bar.update(1)
        changed = set()
        for k in where.pop(p, ()):
            syms, f = words[k], freq[k]
            for q in zip(syms, syms[1:]):
                pairs[q] -= f
                changed.add(q)
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == a and syms[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[k] = out
            for q in zip(out, out[1:]):
                pairs[q] += f
                changed.add(q)
                where.setdefault(q, set()).add(k)
        pairs.pop(p, None)
        for q in changed:
            n = pairs.get(q, 0)
            if n > 0 and q != p:
                heapq.heappush(heap, (-n, q))
            elif n <= 0:
                pairs.pop(q, None)
    if bar is not None:
        bar.close()
    return new


def read_vocab(path) -> dict[str, int]:
    """vocab.txt -> {token: line index}; ValueError naming the file and line for a corrupt file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"vocabulary file {p} does not exist")
    data = p.read_bytes()
    if not data.strip():
        raise ValueError(f"{p}: the vocabulary file is empty")
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    vocab: dict[str, int] = {}
    for n, raw in enumerate(lines):
        try:
            tok = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}, line {n + 1}: not valid UTF-8 ({e.reason}); the file is corrupt or truncated") from None
        if not tok or any(ch.isspace() for ch in tok):
            raise ValueError(f"{p}, line {n + 1}: {tok!r} is not a token (empty or with whitespace); "
                             "vocab.txt holds one token per line")
        if tok in vocab:
            raise ValueError(f"{p}, line {n + 1}: {tok!r} repeats line {vocab[tok] + 1}; a token may appear once")
        vocab[tok] = n
    return vocab


def _looks_uncased(vocab_txt) -> bool:
    with open(vocab_txt, encoding="utf-8") as f:
        for line in f:
            piece = line.rstrip("\n")
            if piece[:1] + piece[-1:] in ("[]", "<>"):
                continue  # [CLS], [unused0], <s>, ...
            if piece.lower() != piece:  # a piece lower-casing would change: a cased vocabulary
                return False
    return True
