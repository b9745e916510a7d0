"""Byte-level BPE, GPT-2's tokenizer: the merge, training, encode and decode (its files: files.py).

Text is first split into pieces by GPT-2's pattern (pieces.py), so merges never cross character
categories. Each piece is encoded as UTF-8 bytes and merged with tiktoken's rule: repeatedly join the
adjacent pair whose joined bytes have the lowest rank (leftmost on ties). For a vocabulary learned by BPE
the rank of a token is the order of the merge that made it, so this is the same as applying the merges
in order (as HF `tokenizers` does).

Reading order: the plain merge and training, the fast merge for long pieces, then the tokenizer.
Each fast path is checked against the plain function it replaces in tests/test_bpe.py.
"""
from __future__ import annotations

import heapq
from collections import Counter
from pathlib import Path
from typing import Callable, ClassVar, Iterable

import regex

from .files import (BYTE_TO_CHAR, ENDOFTEXT, SPECIALS_FILE, read_bpe, read_special_tokens, read_tiktoken, token_str,
                    write_bpe)
from .pieces import safe_chunks, split_pieces

_CACHE_SIZE = 200_000  # pieces remembered by encode; the cache is emptied when it grows past this
_LONG_PIECE = 64  # pieces with more bytes than this go to bpe_merge_long (faster from about here on)
_BASE_TOKENS = [bytes([b]) for b in BYTE_TO_CHAR]  # id i of a trained vocabulary is byte _BASE_TOKENS[i]


# --- the plain algorithm ------------------------------------------------------------------------------

def bpe_merge(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Split `piece` into tokens: start from single bytes and join, again and again, the adjacent pair
    whose joined bytes have the lowest rank in `ranks` (leftmost on ties) until no pair is in `ranks`.

    Worked example, ranks {aa: 0, ab: 1, aaab: 2}, piece "aaabdaaabac":
        a a a b d a a a b a c
        aa a b d aa a b a c      rank 0, leftmost first: the first "aaa" leaves its last a alone
        aa ab d aa ab a c        rank 1
        aaab d aaab a c          rank 2 (aa + ab); no adjacent pair is in ranks: done
    O(n^2) for n bytes; `bpe_merge_long` gives the same in O(n log n)."""
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


def learn_merges(word_counts: dict[bytes, int], num_merges: int, min_frequency: int = 2,
                 progress: Callable[[int, int], None] | None = None):
    """Greedy BPE on counted words: merge the most frequent adjacent pair, `num_merges` times at most
    (fewer when no pair occurs `min_frequency` times). Returns the merges as (left, right) bytes.
    Ties go to the pair with the smaller token ids (bytes in GPT-2's order, then merges in order).
    A pair whose joined bytes are already a token is skipped, so every token has exactly one merge.
    progress(done, total) is called after each merge with done = 1, 2, ... and total = num_merges; when
    the pairs run out first, one last call progress(done, done): the last call always has done == total.

    Plain: count all pairs, merge the best one everywhere with merge_word, count again. Here the counts
    are kept incrementally instead: pair -> count, pair -> words holding it, and a max-heap of
    (count, pair) checked lazily, so each merge only touches the words that contain its pair."""
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
    known = set(tokens)
    merges: list[tuple[bytes, bytes]] = []
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
        if progress is not None:
            progress(len(merges), num_merges)
    if progress is not None and len(merges) < num_merges:
        progress(len(merges), len(merges))     # stopped early: what was learned is the whole
    return merges


# --- fast path: the merge of long pieces ---------------------------------------------------------------

def bpe_merge_long(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """bpe_merge(piece, ranks) in O(n log n), for long pieces (runs like "=====" or "aaaa...", or text
    without spaces): the same merges in the same order, found without rescanning. Ranks must be distinct.

    Parts form a linked list: part i is piece[i:nxt[i]]; nxt[i] = m (past the end) once part i has
    joined its left neighbour. Pairs wait by rank: the starts of the pairs of one rank in a bucket, and
    the lowest rank's bucket is swept left to right. A merge never makes a pair of its own rank (the
    joined bytes are longer), so the pairs it makes wait in later buckets; one of a lower or equal rank
    (possible in a vocabulary not learned by BPE) goes to a heap of keys rank * m + start served first.
    A waiting pair is stale (skipped) once its parts have changed: the two parts now at its start no
    longer span its token's bytes. The sweep is what is fast: runs of one pair cost no heap work."""
    n = len(piece)
    m = n + 1
    nxt = list(range(1, n + 2))
    prv = list(range(-1, n))  # (a slot for the end, n, too)
    get = ranks.get
    buckets: dict[int, list[int]] = {}  # rank -> starts of its pairs (in any order)
    width: dict[int, int] = {}  # rank -> bytes of its token
    for i, r in enumerate(map(get, map(piece.__getitem__, map(slice, range(n - 1), range(2, n + 1))))):
        if r is not None:
            if r in buckets:
                buckets[r].append(i)
            else:
                buckets[r], width[r] = [i], 2
    levels = list(buckets)  # the ranks that have a bucket, a heap
    heapq.heapify(levels)
    heap: list[int] = []
    r = -1

    def wait(rank, start, end):
        if rank <= r:
            width[rank] = end - start
            heapq.heappush(heap, rank * m + start)
        elif rank in buckets:
            buckets[rank].append(start)
        else:
            buckets[rank], width[rank] = [start], end - start
            heapq.heappush(levels, rank)

    while levels:
        r = heapq.heappop(levels)
        todo = sorted(buckets.pop(r))
        rm, w, k, t = r * m, width[r], 0, len(todo)
        while True:
            if heap and (k == t or heap[0] < rm + todo[k]):
                r2, i = divmod(heapq.heappop(heap), m)
                w2 = width[r2]
            elif k < t:
                i, w2 = todo[k], w
                k += 1
            else:
                break
            j = nxt[i]
            if j >= n or nxt[j] - i != w2:
                continue  # stale
            e = nxt[i] = nxt[j]  # join part j into part i
            nxt[j] = m
            prv[e] = i
            if e < n and (q := get(piece[i:nxt[e]])) is not None:
                wait(q, i, nxt[e])
            if (h := prv[i]) >= 0 and (q := get(piece[h:e])) is not None:
                wait(q, h, e)
    out, i = [], 0
    while i < n:
        out.append(piece[i:nxt[i]])
        i = nxt[i]
    return out


# --- the tokenizer --------------------------------------------------------------------------------------

class ByteLevelBPE:
    """GPT-2's byte-level BPE. Ids of ordinary tokens come from `encoder` (bytes -> id); merges are ranked
    by `ranks` (bytes -> distinct ranks, lower merges first; the same dict as `encoder` when ids follow
    merge order). Special tokens are only produced by `encode` when allowed."""
    kind: ClassVar[str] = "bpe"

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
        if ranks is not None and len(set(ranks.values())) != len(ranks):
            raise ValueError("ranks are not distinct: two tokens share a rank")
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

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, special_tokens=(ENDOFTEXT,), min_frequency: int = 2,
              progress: Callable[[int, int], None] | None = None) -> "ByteLevelBPE":
        """Learn `vocab_size - 256 - len(special_tokens)` merges (fewer if pairs run out) from `texts`.
        Ids: the 256 bytes in GPT-2's order, then the merges in order, then the special tokens.
        progress(done, total) is called after each merge with done = 1, 2, ... and total = num_merges; when
    the pairs run out first, one last call progress(done, done): the last call always has done == total.
        ValueError when the texts give no merge at all (empty, or no pair occurs min_frequency times)."""
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
        if num_merges and not merges:
            raise ValueError(f"nothing was learned: the training text ({sum(words.values())} pieces) has no pair "
                             f"of bytes occurring {min_frequency} times (min_frequency); give more text")
        encoder = {t: i for i, t in enumerate(_BASE_TOKENS + [a + b for a, b in merges])}
        specials = {s: len(encoder) + i for i, s in enumerate(special_tokens)}
        return cls(encoder, specials, merges=merges)

    # --- encoding ---

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text`, all of it as text: a special token spelled in it is encoded as its characters."""
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
        b = piece.encode("utf-8")
        enc = self._encoder
        ids = [enc[t] for t in (bpe_merge if len(b) <= _LONG_PIECE else bpe_merge_long)(b, self._ranks)]
        if len(piece) < 100:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()  # bounded memory: start over from the vocabulary
                self._cache.update(self._base_cache)
            self._cache[piece] = ids
        return ids

    def encode(self, text: str, allowed_special=frozenset(), disallowed_special="all") -> list[int]:
        """Ids of `text`, with tiktoken's rules for special tokens spelled in it:
        - by default such a token raises ValueError, so it is never taken silently one way or the other;
        - text a user typed, all of it as text ("<|endoftext|>" as the ids of its 13 characters):
          `encode(text, disallowed_special=())`, the same as `encode_ordinary(text)`;
        - special tokens as their ids: `allowed_special={"<|endoftext|>"}` or "all".
        `disallowed_special` lists those that raise ("all": every special token not allowed)."""
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

    @staticmethod
    def safe_chunks(text: str, chunk_chars: int) -> list[str]:
        """`text` cut into chunks of about `chunk_chars` characters or more whose `encode_ordinary` ids,
        one chunk after the other, are the ids of the whole text (to encode a corpus in parallel).
        Cuts fall at newlines where GPT-2's pattern always ends a piece; see pieces.safe_chunks."""
        return safe_chunks(text, chunk_chars)

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

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Each id's token as vocab.json spells it (bytes as GPT-2's printable characters: " the" is "Ġthe")."""
        return [token_str(self.decode_bytes([i])) for i in ids]

    # --- files (files.py reads and writes them) ---

    @classmethod
    def from_files(cls, vocab_json, merges_txt, special_tokens: dict[str, int] | None = None) -> "ByteLevelBPE":
        """Load HF `vocab.json` + `merges.txt` (or OpenAI's `encoder.json` + `vocab.bpe`: the same format).
        `special_tokens` defaults to `<|endoftext|>` with its id in the vocab, if it is there."""
        encoder, special_tokens, ranks, merges = read_bpe(vocab_json, merges_txt, special_tokens)
        return cls(encoder, special_tokens, ranks=ranks, merges=merges)

    @classmethod
    def from_tiktoken(cls, path, special_tokens: dict[str, int] | None = None) -> "ByteLevelBPE":
        """Load a `.tiktoken` rank file (lines: base64 token, space, rank; the rank is the id).
        `special_tokens` defaults to `<|endoftext|>` right after the last rank (50256 for GPT-2)."""
        encoder = read_tiktoken(path)
        return cls(encoder, {ENDOFTEXT: max(encoder.values()) + 1} if special_tokens is None else special_tokens)

    @classmethod
    def load(cls, directory) -> "ByteLevelBPE":
        """Read what `save` wrote: vocab.json + merges.txt (+ special_tokens.json if present)."""
        d = Path(directory)
        for name in ("vocab.json", "merges.txt"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} not found: a byte-level BPE directory holds vocab.json "
                                        "and merges.txt")
        specials = read_special_tokens(d / SPECIALS_FILE) if (d / SPECIALS_FILE).is_file() else None
        return cls.from_files(d / "vocab.json", d / "merges.txt", specials)

    def save(self, directory) -> None:
        """Write vocab.json + merges.txt (GPT-2/HF format, loadable by HF `tokenizers` and, as ranks, by
        tiktoken) and special_tokens.json; a failed save leaves the old files as they were."""
        merges = self._merges if self._merges is not None else self._derive_merges()
        write_bpe(directory, self._encoder, self.special_tokens, merges)

    def _derive_merges(self) -> list[tuple[bytes, bytes]]:
        """The merge that makes each multi-byte token: BPE on its bytes with only the lower ranks gives two parts."""
        merges: list[tuple[bytes, bytes]] = []
        lower: dict[bytes, int] = {}
        for tok, rank in sorted(self._ranks.items(), key=lambda kv: kv[1]):
            if len(tok) > 1:
                parts = bpe_merge(tok, lower)
                if len(parts) != 2:
                    raise ValueError(f"token {token_str(tok)!r} (rank {rank}) cannot be made by one merge of lower "
                                     "ranks")
                merges.append((parts[0], parts[1]))
                lower[tok] = rank
        return merges


_WORKER: ByteLevelBPE | None = None


def _init_worker(tok):
    global _WORKER
    _WORKER = tok


def _encode_chunk(args):
    texts, allowed, disallowed = args
    return [_WORKER.encode(t, allowed, disallowed) for t in texts]
