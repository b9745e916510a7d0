"""BERT's basic tokenizer: text -> words, one character at a time (clean, CJK, accents and case, punctuation),
the step before WordPiece.

    >>> basic_tokenize("Héllo, 世界!", lowercase=True)
    [('hello', (0, 1, 2, 3, 4)), (',', (5,)), ('世', (7,)), ('界', (8,)), ('!', (9,))]

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
Lone surrogates (which the fast tokenizer refuses with a TypeError) are dropped like other category-C
characters. Known difference (offsets only, ids equal): with uncased NFD, Rust reorders a spacing mark
of nonzero combining class before a following lower-class non-spacing mark ("\u302f\u309a") and then
reports the second character's span; we normalise character by character and report the first.
"""
from __future__ import annotations

import unicodedata

# What the basic tokenizer does with one character of the input:
_KEEP, _DROP, _SPACE, _ALONE, _MIXED = 0, 1, 2, 3, 4  # word chars / removed / boundary / CJK word / may hold punct


def basic_tokenize(text: str, lowercase: bool, memo: dict | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The words of `text`, each with the index in `text` of the character each of its characters came from.

    As HF tokenizers' BertNormalizer + BertPreTokenizer, character by character: control characters are
    removed, whitespace ends a word, a CJK ideograph and a punctuation character are words of their own;
    `lowercase` (uncased BERT) also strips accents (NFD, then drops non-spacing marks) and lower-cases; a lone
    accent ("\u103a") is then nothing, and no word is ever empty (HF's trainer skips empty words).
    Special tokens are not looked for here (WordPiece.encode does that first). `memo`, a dict this call
    fills (for one value of `lowercase`), saves classifying a character twice."""
    memo = {} if memo is None else memo
    out, word, align = [], [], []
    for i, c in enumerate(text):
        r = memo.get(c)
        if r is None:
            r = memo[c] = _classify(c, lowercase)
        kind, norm = r
        if kind == _KEEP:
            word.append(norm)
            align.extend([i] * len(norm))
            continue
        if kind == _DROP:
            continue
        if word:
            out.append(("".join(word), tuple(align)))
            word, align = [], []
        if kind == _ALONE:
            out.append((norm, (i,) * len(norm)))
        elif kind == _MIXED:  # a character whose normalised form holds punctuation (or is one)
            for ch in norm:
                if _is_punct(ch) or ch.isspace():
                    if word:
                        out.append(("".join(word), tuple(align)))
                        word, align = [], []
                    if not ch.isspace():
                        out.append((ch, (i,)))
                else:
                    word.append(ch)
                    align.append(i)
    if word:
        out.append(("".join(word), tuple(align)))
    return out


def _classify(c: str, lowercase: bool) -> tuple[int, str]:
    """(kind, normalised chars) for one input character; order as HF: clean, CJK, accents, case."""
    if _is_removed(c):
        return _DROP, ""
    if c in "\t\n\r" or unicodedata.category(c)[0] == "Z":
        return _SPACE, ""
    out = c
    if lowercase:  # uncased BERT: strip accents (NFD, drop Mn), then lowercase
        if not (_HF_TABLE_PATCHES and ord(c) in _HF_NO_NFD):
            out = unicodedata.normalize("NFD", c)
        out = "".join(_lower(ch) for ch in out if not _is_mn(ch))
        if not out:  # a lone accent (U+103A): gone, as a control character is; never an empty word
            return _DROP, ""
    if _is_chinese(ord(c)):
        return _ALONE, out
    if any(_is_punct(ch) or ch.isspace() for ch in out):
        return _MIXED, out
    return _KEEP, out


# --- character classes ---------------------------------------------------------------------------------

# Whitespace: \t \n \r and category Z (equal to Unicode's White_Space minus the control chars,
# which are removed before whitespace is looked at).
WHITESPACE = "\t\n\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # a regex character set


def _is_chinese(cp: int) -> bool:
    # HF tokenizers' table, including its 0x2B920 (the Python/BERT table says 0x2B820).
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _ranges(spec: str) -> frozenset:
    out: set[int] = set()
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
