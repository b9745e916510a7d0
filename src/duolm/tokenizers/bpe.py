"""Byte-level BPE, GPT-2's tokenizer: train, encode, decode, and the GPT-2 / HF / tiktoken file formats.

Text is first split by GPT-2's pattern into pieces (letters, numbers, punctuation, whitespace, with an
optional leading space), so merges never cross character categories. Each piece is encoded as UTF-8
bytes and merged with tiktoken's rule: repeatedly join the adjacent pair whose joined bytes have the
lowest rank (leftmost on ties). For a vocabulary learned by BPE the rank of a token is the order of
the merge that made it, so this is the same as applying the merges in order (as HF `tokenizers` does).
"""
from __future__ import annotations

import base64
import heapq
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable

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
_PAT_FAST = regex.compile(GPT2_PATTERN)  # = _PAT on text without those code points, and twice as fast
_HAS_NEWER = re.compile(f"[{_NEWER}]")
# The same pattern for ASCII text, for the stdlib `re` (about twice as fast as `regex` with \p{..}).
# On ASCII, \p{L} = [A-Za-z], \p{N} = [0-9] and \s (Unicode White_Space) = [\t\n\v\f\r ].
_W = r"\t\n\x0b\x0c\r "
_ASCII_PAT = re.compile(rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_W}A-Za-z0-9]+|[{_W}]+(?![^{_W}])|[{_W}]+""")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
ENDOFTEXT = "<|endoftext|>"
SPECIALS_FILE = "special_tokens.json"
_CACHE_SIZE = 200_000  # pieces remembered by encode; the cache is emptied when it grows past this
_LONG_PIECE = 64  # pieces with more bytes than this merge with a heap, O(n log n) instead of O(n^2)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (how vocab.json / merges.txt spell bytes).

    Printable latin-1 bytes map to themselves; the other 68 (control chars, space, ...) to chr(256 + i).
    Its order is also the order of GPT-2's first 256 token ids."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes come first
    return dict(zip(bs, map(chr, cs)))


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BASE_TOKENS = [bytes([b]) for b in _BYTE_TO_CHAR]  # id i of a trained vocabulary is byte _BASE_TOKENS[i]


def _safe_cut(text: str, q: int) -> bool:
    """Can `text` be cut after the newline at q without changing GPT-2's pieces? Yes when a piece ends there
    whatever follows: before " X" (the whitespace run up to q is one piece, " X" starts the next), or
    between two visible characters (the newline is a piece of its own). Visible = ASCII "!".."~"."""
    if q + 2 < len(text) and text[q + 1] == " ":
        return "!" <= text[q + 2] <= "~"
    return 0 < q < len(text) - 1 and "!" <= text[q - 1] <= "~" and "!" <= text[q + 1] <= "~"


def _findall(text: str) -> list[str]:
    """_PAT.findall(text), by the fast pattern unless `text` holds a code point newer than the references know."""
    if max(text) >= "\u0558" and _HAS_NEWER.search(text):
        return _PAT.findall(text)
    return _PAT_FAST.findall(text)


def split_pieces(text: str) -> list[str]:
    """GPT-2's pre-split of `text` (= _PAT.findall(text)), running the fast ASCII pattern on ASCII stretches.
    Text is cut only at newlines where _safe_cut holds; stretches holding non-ASCII go to the full pattern."""
    if text.isascii():
        return _ASCII_PAT.findall(text)
    out, pos, n = [], 0, len(text)
    while pos < n:
        m = _NON_ASCII.search(text, pos)
        if m is None:
            out += _ASCII_PAT.findall(text[pos:])
            break
        q = m.start()  # cut before the non-ASCII char at the nearest safe newline (or at pos)
        while (q := text.rfind("\n", pos, q)) != -1 and not _safe_cut(text, q):
            pass
        a = pos if q == -1 else q + 1
        b = m.start()  # ... and after it, at the next safe newline with no non-ASCII char close behind it
        while True:
            while (b := text.find("\n", b + 1)) != -1 and not _safe_cut(text, b):
                pass
            if b == -1 or (m := _NON_ASCII.search(text, b, b + 512)) is None:
                break
            b = m.start()
        b = n if b == -1 else b + 1
        if a > pos:
            out += _ASCII_PAT.findall(text[pos:a])
        out += _findall(text[a:b])
        pos = b
    return out


def _to_str(token: bytes) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in token)


# --- the merge step (pure functions) -------------------------------------------------------------

def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Split `piece` into tokens: start from single bytes and join, again and again, the adjacent pair
    whose joined bytes have the lowest rank in `ranks` (leftmost on ties) until no pair is in `ranks`."""
    if len(piece) > _LONG_PIECE:
        return _bpe_merge_long(piece, ranks)
    parts = [piece[i:i + 1] for i in range(len(piece))]
    none = 1 << 62
    get = ranks.get
    pair_ranks = [get(a + b, none) for a, b in zip(parts, parts[1:])]  # pair_ranks[i]: parts i and i+1
    while pair_ranks:
        best = min(pair_ranks)
        if best == none:
            break
        i = pair_ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i < len(pair_ranks):
            pair_ranks[i] = get(parts[i] + parts[i + 1], none)
        if i:
            pair_ranks[i - 1] = get(parts[i - 1] + parts[i], none)
    return parts


def _bpe_merge_long(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """bpe_merge for long pieces, O(n log n). Parts form a linked list: part i is piece[i:nxt[i]], and
    nxt[i] > n marks a part joined into its left neighbour. Pairs are keyed rank * (n + 1) + start and
    taken smallest first from two queues: the sorted initial pairs and a heap of pairs made by merges.
    A key is stale (skipped) when its two parts changed since: their joined bytes then have another rank."""
    n = len(piece)
    m, done = n + 1, 1 << 62
    nxt = list(range(1, n + 2))
    prv = list(range(-1, n))
    get = ranks.get
    initial = sorted([r * m + i for i in range(n - 1) if (r := get(piece[i:i + 2])) is not None]) + [done]
    heap, k = [done], 0
    pop, push = heapq.heappop, heapq.heappush
    while True:
        if initial[k] < heap[0]:
            key, k = initial[k], k + 1
        elif (key := pop(heap)) == done:
            break
        r, i = divmod(key, m)
        j = nxt[i]
        if j >= n or get(piece[i:nxt[j]]) != r:
            continue
        e = nxt[i] = nxt[j]  # join part j into part i
        nxt[j] = m
        prv[e] = i  # (prv has a slot for e == n)
        if e < n and (r2 := get(piece[i:nxt[e]])) is not None:
            push(heap, r2 * m + i)
        if (h := prv[i]) >= 0 and (r2 := get(piece[h:e])) is not None:
            push(heap, r2 * m + h)
    out, i = [], 0
    while i < n:
        out.append(piece[i:nxt[i]])
        i = nxt[i]
    return out


def merge_word(word: list[int], pair: tuple[int, int], new: int) -> list[int]:
    """Replace each occurrence of `pair` in `word` (left to right, not overlapping) by `new`."""
    a, b = pair
    out, i, n = [], 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_merges(word_counts: dict[bytes, int], num_merges: int, min_frequency: int = 2, progress=False):
    """Greedy BPE on counted words: merge the most frequent adjacent pair, `num_merges` times at most
    (fewer when no pair occurs `min_frequency` times). Returns the merges as (left, right) bytes.

    Pair counts are kept incrementally: pair -> count, pair -> words holding it, and a max-heap of
    (count, pair) checked lazily, so each merge only touches the words that contain its pair.
    Ties go to the pair with the smaller token ids (bytes in GPT-2's order, then merges in order).
    A pair whose joined bytes are already a token is skipped, so every token has exactly one merge."""
    tokens = list(_BASE_TOKENS)
    byte_id = {t[0]: i for i, t in enumerate(tokens)}
    words = [[byte_id[b] for b in w] for w in word_counts]
    counts = list(word_counts.values())
    pair_count: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += counts[wi]
            where.setdefault(p, set()).add(wi)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    known, merges = set(tokens), []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=num_merges, desc="bpe merges", unit="merge")
    while heap and len(merges) < num_merges:
        c, pair = heapq.heappop(heap)
        if -c != pair_count.get(pair, 0):  # stale entry: the count dropped since it was pushed
            if pair_count.get(pair, 0) > 0:
                heapq.heappush(heap, (-pair_count[pair], pair))
            continue
        if -c < min_frequency:
            break
        joined = tokens[pair[0]] + tokens[pair[1]]
        if joined in known:  # another merge made these bytes already
            del pair_count[pair]
            continue
        new = len(tokens)
        tokens.append(joined)
        known.add(joined)
        merges.append((tokens[pair[0]], tokens[pair[1]]))
        delta: Counter = Counter()
        for wi in where.pop(pair):
            w = words[wi]
            nw = merge_word(w, pair, new)
            if len(nw) == len(w):
                continue  # the pair left this word in an earlier merge
            c = counts[wi]
            for p in zip(w, w[1:]):
                delta[p] -= c
            for p in zip(nw, nw[1:]):
                delta[p] += c
                where.setdefault(p, set()).add(wi)
            words[wi] = nw
        for p, d in delta.items():
            if d:
                pair_count[p] += d
                if d > 0:
                    heapq.heappush(heap, (-pair_count[p], p))
        pair_count.pop(pair, None)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return merges


# --- the tokenizer --------------------------------------------------------------------------------

class ByteLevelBPE:
    """GPT-2's byte-level BPE. Ids of ordinary tokens come from `encoder` (bytes -> id); merges are ranked
    by `ranks` (bytes -> rank, lower merges first; the same dict as `encoder` when ids follow merge order).
    Special tokens are only produced by `encode` when allowed."""

    def __init__(self, encoder: dict[bytes, int], special_tokens: dict[str, int],
                 ranks: dict[bytes, int] | None = None, merges: list[tuple[bytes, bytes]] | None = None):
        self._encoder = encoder
        self._ranks = encoder if ranks is None else ranks
        self._merges = merges  # None: derived from the ranks when saving
        self.special_tokens = dict(special_tokens)
        self._decoder = {i: t for t, i in encoder.items()}
        self._decoder.update({i: s.encode() for s, i in self.special_tokens.items()})
        if len(self._decoder) != len(encoder) + len(self.special_tokens):
            raise ValueError("token ids are not unique: two tokens (or a token and a special token) share an id")
        self.vocab_size = max(self._decoder) + 1
        self.eot_id = self.special_tokens.get(ENDOFTEXT)
        self._base_cache = {}  # every token that is valid UTF-8, as text: tiktoken's "whole piece is a token" shortcut
        for t, i in encoder.items():
            try:
                self._base_cache[t.decode()] = [i]
            except UnicodeDecodeError:
                pass
        self._cache = dict(self._base_cache)

    def __getstate__(self):  # pickled for encode_batch workers: leave the caches behind
        return {"encoder": self._encoder, "special_tokens": self.special_tokens,
                "ranks": None if self._ranks is self._encoder else self._ranks, "merges": self._merges}

    def __setstate__(self, state):
        self.__init__(**state)

    # --- training and files ---

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, special_tokens=(ENDOFTEXT,), min_frequency: int = 2,
              progress: bool = False) -> "ByteLevelBPE":
        """Learn `vocab_size - 256 - len(special_tokens)` merges (fewer if pairs run out) from `texts`.
        Ids: the 256 bytes in GPT-2's order, then the merges in order, then the special tokens."""
        special_tokens = list(dict.fromkeys(special_tokens))
        num_merges = vocab_size - 256 - len(special_tokens)
        if num_merges < 0:
            raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} special "
                             f"tokens = {256 + len(special_tokens)}; ask for a larger vocab_size")
        words: Counter = Counter()
        for text in texts:
            words.update(split_pieces(text))
        word_counts: Counter = Counter()
        for w, c in words.items():
            word_counts[w.encode("utf-8", "surrogatepass")] += c
        merges = learn_merges(word_counts, num_merges, min_frequency, progress)
        encoder = {t: i for i, t in enumerate(_BASE_TOKENS + [a + b for a, b in merges])}
        specials = {s: len(encoder) + i for i, s in enumerate(special_tokens)}
        return cls(encoder, specials, merges=merges)

    @classmethod
    def from_files(cls, vocab_json, merges_txt, special_tokens: dict[str, int] | None = None) -> "ByteLevelBPE":
        """Load HF `vocab.json` + `merges.txt` (or OpenAI's `encoder.json` + `vocab.bpe`: the same format).
        `special_tokens` defaults to `<|endoftext|>` with its id in the vocab, if it is there."""
        vocab_json, merges_txt = Path(vocab_json), Path(merges_txt)
        try:
            vocab = json.loads(vocab_json.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{vocab_json}: line {e.lineno}: not valid JSON ({e.msg}); the file is corrupt "
                             "or truncated") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
            raise ValueError(f"{vocab_json}: expected a JSON object of token -> integer id")
        if special_tokens is None:
            special_tokens = {ENDOFTEXT: vocab[ENDOFTEXT]} if ENDOFTEXT in vocab else {}
        encoder = {}
        for tok, i in vocab.items():
            if tok in special_tokens:
                if special_tokens[tok] != i:
                    raise ValueError(f"{vocab_json}: special token {tok!r} has id {i}, not {special_tokens[tok]}")
                continue
            try:
                encoder[bytes(_CHAR_TO_BYTE[c] for c in tok)] = i
            except KeyError:
                raise ValueError(f"{vocab_json}: token {tok!r} (id {i}) is not in GPT-2's byte alphabet; pass it "
                                 "in special_tokens if it is a special token") from None
        merges, ranks = [], {}
        with open(merges_txt, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if (lineno == 1 and line.startswith("#version")) or not line:
                    continue
                parts = line.split(" ")
                try:
                    a, b = (bytes(_CHAR_TO_BYTE[c] for c in p) for p in parts)
                except (KeyError, ValueError):
                    raise ValueError(f"{merges_txt}: line {lineno}: expected two tokens in GPT-2's byte alphabet "
                                     f"separated by one space, got {line!r}; the file is corrupt") from None
                if a + b not in encoder or a not in encoder or b not in encoder:
                    raise ValueError(f"{merges_txt}: line {lineno}: merge {line!r} uses or makes a token that is not "
                                     f"in {vocab_json}; the files do not belong together")
                if a + b not in ranks:  # a second merge to the same bytes can never apply
                    ranks[a + b] = len(ranks)
                    merges.append((a, b))
        missing = [bytes([b]) for b in range(256) if bytes([b]) not in encoder]
        if missing:
            raise ValueError(f"{vocab_json}: {len(missing)} of the 256 byte tokens are missing, e.g. "
                             f"{_to_str(missing[0])!r}; the file is truncated or not a byte-level vocab")
        orphans = [t for t in encoder if len(t) > 1 and t not in ranks]
        if orphans:
            raise ValueError(f"{vocab_json}: {len(orphans)} tokens are made by no merge in {merges_txt}, e.g. "
                             f"{_to_str(orphans[0])!r}; is {merges_txt.name} truncated? (added tokens must be "
                             "passed in special_tokens)")
        in_order = all(encoder[t] < encoder[u] for t, u in zip(ranks, list(ranks)[1:]))
        return cls(encoder, special_tokens, ranks=None if in_order else ranks, merges=merges)

    @classmethod
    def from_tiktoken(cls, path, special_tokens: dict[str, int] | None = None) -> "ByteLevelBPE":
        """Load a `.tiktoken` rank file (lines: base64 token, space, rank; the rank is the id).
        `special_tokens` defaults to `<|endoftext|>` right after the last rank (50256 for GPT-2)."""
        encoder = {}
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    tok, rank = line.split()
                    encoder[base64.b64decode(tok, validate=True)] = int(rank)
                except ValueError:
                    raise ValueError(f"{path}: line {lineno}: expected '<base64 token> <rank>', got "
                                     f"{line[:80]!r}; the file is corrupt or truncated") from None
        missing = [b for b in range(256) if bytes([b]) not in encoder]
        if missing:
            raise ValueError(f"{path}: {len(missing)} of the 256 single-byte tokens are missing (e.g. byte "
                             f"{missing[0]}); the file is truncated or not a byte-level BPE")
        if len(set(encoder.values())) != len(encoder):
            raise ValueError(f"{path}: two tokens share a rank; the file is corrupt")
        if special_tokens is None:
            special_tokens = {ENDOFTEXT: max(encoder.values()) + 1}
        return cls(encoder, special_tokens)

    @classmethod
    def load(cls, dir) -> "ByteLevelBPE":
        """Read what `save` wrote: vocab.json + merges.txt (+ special_tokens.json if present)."""
        dir = Path(dir)
        for name in ("vocab.json", "merges.txt"):
            if not (dir / name).is_file():
                raise FileNotFoundError(f"{dir / name} not found: a byte-level BPE directory holds vocab.json "
                                        "and merges.txt")
        specials = None
        if (dir / SPECIALS_FILE).is_file():
            try:
                specials = json.loads((dir / SPECIALS_FILE).read_text(encoding="utf-8"))["special_tokens"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{dir / SPECIALS_FILE}: expected {{\"special_tokens\": {{token: id}}}}") from None
        return cls.from_files(dir / "vocab.json", dir / "merges.txt", specials)

    def save(self, dir) -> None:
        """Write vocab.json + merges.txt (GPT-2/HF format, loadable by HF `tokenizers` and, as ranks, by
        tiktoken) and special_tokens.json."""
        dir = Path(dir)
        dir.mkdir(parents=True, exist_ok=True)
        vocab = {_to_str(t): i for t, i in sorted(self._encoder.items(), key=lambda kv: kv[1])}
        vocab.update(self.special_tokens)
        merges = self._merges if self._merges is not None else self._derive_merges()
        files = {
            "vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "".join(f"{_to_str(a)} {_to_str(b)}\n" for a, b in merges),
            SPECIALS_FILE: json.dumps({"special_tokens": self.special_tokens}, ensure_ascii=False, indent=1),
        }
        for name, text in files.items():
            tmp = dir / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, dir / name)

    def _derive_merges(self) -> list[tuple[bytes, bytes]]:
        """The merge that makes each multi-byte token: BPE on its bytes with only the lower ranks gives two parts."""
        merges, lower = [], {}
        for tok, rank in sorted(self._ranks.items(), key=lambda kv: kv[1]):
            if len(tok) > 1:
                parts = bpe_merge(tok, lower)
                if len(parts) != 2:
                    raise ValueError(f"token {_to_str(tok)!r} (rank {rank}) cannot be made by one merge of lower ranks")
                merges.append((parts[0], parts[1]))
                lower[tok] = rank
        return merges

    # --- encoding ---

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text`, special tokens spelled in it encoded as plain text."""
        try:
            return self._encode_ordinary(text)
        except UnicodeEncodeError:  # lone surrogates: replaced by U+FFFD, as tiktoken does
            return self._encode_ordinary(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

    def _encode_ordinary(self, text: str) -> list[int]:
        out = []
        get = self._cache.get
        for piece in split_pieces(text):
            ids = get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
            out += ids
        return out

    def _encode_piece(self, piece: str) -> list[int]:
        enc = self._encoder
        ids = [enc[t] for t in bpe_merge(piece.encode("utf-8"), self._ranks)]
        if len(piece) < 100:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()  # bounded memory: start over from the vocabulary
                self._cache.update(self._base_cache)
            self._cache[piece] = ids
        return ids

    def encode(self, text: str, allowed_special=frozenset(), disallowed_special="all") -> list[int]:
        """Ids of `text` with tiktoken's rules: special tokens in `allowed_special` ("all" or a set) become their
        ids; one in `disallowed_special` ("all" = every special token not allowed) raises ValueError; the
        rest are encoded as plain text."""
        if allowed_special == "all":
            allowed_special = self.special_tokens.keys()
        elif not set(allowed_special) <= self.special_tokens.keys():
            raise ValueError(f"allowed_special names {sorted(set(allowed_special) - self.special_tokens.keys())}, "
                             f"which are not special tokens of this tokenizer ({sorted(self.special_tokens)})")
        if disallowed_special == "all":
            disallowed_special = self.special_tokens.keys() - allowed_special
        for s in disallowed_special:
            if s in text:
                raise ValueError(
                    f"the text contains the special token {s!r}. To encode it as the special token pass "
                    f"allowed_special={{{s!r}}} (or 'all'); to encode it as plain text pass disallowed_special=() "
                    "or use encode_ordinary")
        if not any(s in text for s in allowed_special):
            return self.encode_ordinary(text)
        pat = regex.compile("|".join(regex.escape(s) for s in sorted(allowed_special, key=len, reverse=True)))
        out, start = [], 0
        for m in pat.finditer(text):
            out += self.encode_ordinary(text[start:m.start()])
            out.append(self.special_tokens[m.group()])
            start = m.end()
        return out + self.encode_ordinary(text[start:])

    def encode_batch(self, texts: list[str], workers: int = 1, allowed_special=frozenset(),
                     disallowed_special="all") -> list[list[int]]:
        """encode() of each text; `workers` > 1 spreads the texts over that many processes."""
        texts = list(texts)
        if workers <= 1 or len(texts) < 2:
            return [self.encode(t, allowed_special, disallowed_special) for t in texts]
        from concurrent.futures import ProcessPoolExecutor
        size = max(1, -(-len(texts) // (workers * 4)))
        chunks = [texts[i:i + size] for i in range(0, len(texts), size)]
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(self,)) as ex:
            done = ex.map(_encode_chunk, [(c, allowed_special, disallowed_special) for c in chunks])
            return [ids for chunk in done for ids in chunk]

    # --- decoding ---

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes of `ids` (special tokens as their text). Any ints: a list, numpy array or tensor."""
        ids = ids if isinstance(ids, list) else list(ids)
        try:
            return b"".join(map(self._decoder.__getitem__, ids))
        except KeyError:  # numpy/torch scalars, or an id out of range
            ids = [int(i) for i in ids]
            bad = [i for i in ids if i not in self._decoder]
            if bad:
                raise ValueError(f"token id {bad[0]} is not in the vocabulary (ids are 0..{self.vocab_size - 1})") from None
            return b"".join(map(self._decoder.__getitem__, ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (a token sequence cut mid-character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


_WORKER: ByteLevelBPE | None = None


def _init_worker(tok):
    global _WORKER
    _WORKER = tok


def _encode_chunk(args):
    texts, allowed, disallowed = args
    return [_WORKER.encode(t, allowed, disallowed) for t in texts]
