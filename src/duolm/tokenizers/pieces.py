"""GPT-2's pre-split: text -> pieces, the units byte-level BPE merges within; and where text may be cut.

The plain rule is one regular expression: a piece is an English contraction ('s 't 're 've 'm 'll 'd),
a run of letters, of digits or of other visible characters, each with an optional leading space, or
a run of whitespace (ending before the last space when a visible character follows it):

    >>> pre_split("I'm   fine, 2024!\\n")
    ['I', "'m", '  ', ' fine', ',', ' 2024', '!', '\\n']

`split_pieces` is the fast path byte-level BPE uses (tests/test_bpe.py checks it against `pre_split`).
"""
from __future__ import annotations

import re

import regex

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# `regex` knows a newer Unicode than tiktoken and HF tokenizers: these code points (hex ranges) are letters or
# numbers to it but unassigned to them (Unicode 17 additions and later, found by comparing every code point).
# Our copy of the pattern leaves them out of \p{L} and \p{N}, so all three split text the same way.
_NEWER_UNICODE = """
    558 58B-58C 88F C5C CDC 208F 209D-209F A7CE-A7CF A7D2 A7D4 A7DD A7E2 A7F1 AB6C-AB6D 107BB-107BF 10940-10959
    10EC5-10EC7 10ED9-10EEE 11B0A 11DB0-11DDB 11DE0-11DE9 11DF1 1246F 12475-1247F 12550-12686 16EA0-16EB8
    16EBB-16ED3 16FF2-16FF6 187F8-187FF 18CD6-18CDA 18D09-18D20 18D80-18DF2 18E00-19191 191A0-191D2 1B123-1B128
    1B168 1D6A6 1DF1F-1DF24 1DF2B-1DF81 1DF90-1DF96 1DFCD-1DFFF 1E6C0-1E6DE 1E6E0-1E6E2 1E6E4-1E6E5 1E6E7-1E6ED
    1E6F0-1E6F4 1E6FE-1E6FF 2B73A-2B73F 2B81E 2CEA2-2CEAD 323B0-33479 3D000-3FC3F"""
_NEWER = "".join("-".join(f"\\U{int(h, 16):08x}" for h in r.split("-")) for r in _NEWER_UNICODE.split())
_L, _N = rf"[\p{{L}}--[{_NEWER}]]", rf"[\p{{N}}--[{_NEWER}]]"
_PAT = regex.compile(rf"""(?V1)'(?:[sdmt]|ll|ve|re)| ?{_L}+| ?{_N}+| ?[^\s{_L}{_N}]+|\s+(?!\S)|\s+""")


def pre_split(text: str) -> list[str]:
    """GPT-2's pieces of `text`: the plain rule, as tiktoken and HF tokenizers apply it."""
    return _PAT.findall(text)


# --- where a text may be cut --------------------------------------------------------------------------

# After a newline where a piece ends whatever comes before or after it: between two non-space characters
# (the newline is a piece of its own), or before a space and a non-space character (the whitespace run
# ends at the newline and " x" starts the next piece). No pattern reaches across it: the only lookahead,
# (?!\S), is answered before it. \S here is `regex`'s, the pattern's own (stdlib `re` also counts
# \x1c-\x1f as space). The second kind is what lets PTB and WikiText (lines start with a space) be cut. The
# third, before the last newline of a run that ends at a non-space character, lets text whose paragraphs are one
# line each, separated by blank lines, be cut: the run but its last newline is one piece, that newline another.
_SAFE_CUT = regex.compile(r"(?<=\S)\n(?=\S)|\n(?= \S)|\n(?=\n\S)")


def safe_chunks(text: str, chunk_chars: int) -> list[str]:
    """`text` cut where the pieces do not change: the pieces of the chunks, one chunk after the other, are
    the pieces of `text`, so their BPE ids are too (`encode_ordinary`). Each chunk is cut at the first
    safe newline `chunk_chars` characters or more after its start; a text without one stays whole.
    "".join(chunks) == text, and no chunk is empty.

        >>> safe_chunks("one\\ntwo\\n  three\\n four", 3)
        ['one\\n', 'two\\n  three\\n', ' four']
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be at least 1, not {chunk_chars}")
    out, start = [], 0
    while len(text) - start > chunk_chars and (m := _SAFE_CUT.search(text, start + chunk_chars - 1)):
        out.append(text[start:m.end()])
        start = m.end()
    return out + [text[start:]] if start < len(text) else out


# --- fast path --------------------------------------------------------------------------------------------

_PAT_FAST = regex.compile(GPT2_PATTERN)  # = _PAT on text without the newer code points, and twice as fast
_HAS_NEWER = re.compile(f"[{_NEWER}]")
# The same pattern for ASCII text, for the stdlib `re` (about twice as fast as `regex` with \p{..}).
# On ASCII, \p{L} = [A-Za-z], \p{N} = [0-9] and \s (Unicode White_Space) = [\t\n\v\f\r ].
_W = r"\t\n\x0b\x0c\r "
_ASCII_PAT = re.compile(rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_W}A-Za-z0-9]+|[{_W}]+(?![^{_W}])|[{_W}]+""")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def split_pieces(text: str) -> list[str]:
    """pre_split(text), about twice as fast: ASCII stretches go to the stdlib `re` copy of the pattern, the
    others to `regex` (without the newer-Unicode exclusion when no such code point occurs). Stretches are
    cut only at safe newlines (_SAFE_CUT), so they split as the whole text does."""
    if text.isascii():
        return _ASCII_PAT.findall(text)
    out, pos, n = [], 0, len(text)
    while pos < n:
        m = _NON_ASCII.search(text, pos)
        if m is None:
            out += _ASCII_PAT.findall(text[pos:])
            break
        q = m.start()  # the stretch starts after the last safe newline before the non-ASCII character ...
        while (q := text.rfind("\n", pos, q)) != -1 and not _SAFE_CUT.match(text, q):
            pass
        a = pos if q == -1 else q + 1
        b = m.start()  # ... and ends at the first safe newline with no non-ASCII character close behind it
        while (cut := _SAFE_CUT.search(text, b)) and (m := _NON_ASCII.search(text, cut.end(), cut.end() + 512)):
            b = m.start()
        b = cut.end() if cut else n
        if a > pos:
            out += _ASCII_PAT.findall(text[pos:a])
        chunk = text[a:b]
        out += (_PAT if max(chunk) >= "\u0558" and _HAS_NEWER.search(chunk) else _PAT_FAST).findall(chunk)
        pos = b
    return out
