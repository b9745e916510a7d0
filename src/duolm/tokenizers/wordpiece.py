"""BERT's WordPiece tokenizer: the basic tokenizer (basic.py), then greedy longest-match-first WordPiece
with "##" continuation pieces; [CLS] A [SEP] (B [SEP]) encodings with segments and offsets; training.

Reading order: the plain algorithm (`wordpiece` here, `basic_tokenize` in basic.py), the encoding, the
tokenizer, its fast paths (tests/test_wordpiece.py checks them against the plain path), training.

Special tokens typed in the text: by default "[MASK]" written by a user becomes the [MASK] id, and so
do the other four, as in both HF tokenizers (the fast one matches them on the raw text, case-sensitively,
before normalisation; "[mask]" is plain text). Fill-mask relies on it: the user marks the blank by
typing [MASK]. To take every character as text (a prompt that must not smuggle in a [SEP]), pass
split_special_tokens=True, HF's flag of the same name.
"""
from __future__ import annotations

import heapq
import re
from collections import Counter
from itertools import accumulate, islice
from pathlib import Path
from typing import Callable, ClassVar, Iterable

from .basic import WHITESPACE, basic_tokenize
from .files import read_lowercase, read_vocab_txt, write_wordpiece

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_CHARS_PER_WORD = 100  # longer words become [UNK] (HF max_input_chars_per_word)
_CACHE_SIZE = 1 << 17     # words; the cache is emptied when full so memory stays bounded
_SPECIAL_SPLIT = re.compile(r"(\[(?:PAD|UNK|CLS|SEP|MASK)\])")


# --- the plain algorithm ---------------------------------------------------------------------------

def wordpiece(word: str, vocab: dict[str, int], unk_id: int, max_piece: int = 1 << 30
              ) -> tuple[tuple[int, int, int], ...]:
    """Greedy longest-match-first split of one word (a word of the basic tokenizer): the longest prefix
    of the word that is in `vocab`, then the longest "##" continuation from where it ends, and so on.

    Returns (id, start, end) per piece, start/end in characters of `word`. A word with a position where
    nothing matches, or longer than MAX_CHARS_PER_WORD characters, is one [UNK]. `max_piece` (the
    longest vocab entry) only bounds the search. Worked example, vocab {un, una, ##aff, ##ff, ##able}:
        "unaffable" from 0: unaffable, unaffabl, ..., una: in vocab  -> una
                    from 3: ##ffable, ##ffabl, ..., ##ff: in vocab   -> ##ff
                    from 5: ##able: in vocab                         -> ##able
    gives una ##ff ##able: greedy never goes back for the equally good un ##aff ##able.
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
    [tok.encode_with_offsets(line) for line in lines]).
    """
    __slots__ = ("_ids", "_offsets", "_n", "_m", "_segment_ids", "_special_mask")
    _ids: tuple[int, ...] | list[int]                             # a tuple until the first read
    _offsets: tuple[tuple[int, int], ...] | list[tuple[int, int]]
    _segment_ids: list[int] | None
    _special_mask: list[int] | None

    def __init__(self, ids: tuple, offsets: tuple, n_first: int):  # n_first: tokens of segment 0
        self._ids, self._offsets, self._n, self._m = ids, offsets, n_first, len(ids) - n_first
        self._segment_ids = self._special_mask = None

    @property
    def ids(self) -> list[int]:
        if isinstance(self._ids, tuple):
            self._ids = list(self._ids)
        return self._ids

    @property
    def offsets(self) -> list[tuple[int, int]]:
        if isinstance(self._offsets, tuple):
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

    __hash__ = None  # type: ignore[assignment]   # mutable lists: unhashable, as a list

    def __repr__(self):
        return "Encoding(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _ENCODING_FIELDS) + ")"


_ENCODING_FIELDS = ("ids", "segment_ids", "offsets", "special_mask")


class WordPiece:
    """BERT's WordPiece tokenizer over a vocab.txt vocabulary (token per line, id = line number).

    The word pieces of a text: special tokens typed in it become their ids (unless split_special_tokens),
    the rest goes through basic_tokenize, then wordpiece word by word."""
    kind: ClassVar[str] = "wordpiece"

    def __init__(self, vocab: dict[str, int], lowercase: bool = True):
        missing = [s for s in SPECIALS if s not in vocab]
        if missing:
            raise ValueError(f"vocabulary lacks the special token(s) {missing}; BERT needs {list(SPECIALS)}")
        self.vocab = dict(vocab)
        self.lowercase = bool(lowercase)
        self.inv = {i: t for t, i in self.vocab.items()}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self.vocab[s] for s in SPECIALS)
        self.special_tokens = {s: self.vocab[s] for s in SPECIALS}
        self.special_ids = frozenset(self.special_tokens.values())
        self._max_piece = max(len(t) for t in self.vocab)
        self._chars: dict[str, tuple[int, str]] = {}  # basic_tokenize's memo (bounded by the alphabet)
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

    # ---- encode / decode -------------------------------------------------------------------------------
    def encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        """[CLS] text's pieces [SEP], as HF's tokenizer.encode(text); a special token typed in the text is that
        token unless split_special_tokens (then it is text). encode_with_offsets gives pairs, offsets, cuts."""
        return [self.cls_id, *self._pieces(text, split_special_tokens)[0], self.sep_id]

    def encode_with_offsets(self, text: str, pair: str | None = None, max_length: int | None = None,
                            truncation: str = "longest_first", split_special_tokens: bool = False) -> Encoding:
        """[CLS] text [SEP] (pair [SEP]) with segment ids, offsets and special mask, as HF's
        tokenizer(text, pair, max_length=..., truncation=..., split_special_tokens=...).
        A special token typed in the text is that token unless split_special_tokens (then it is text)."""
        if truncation not in ("longest_first", "only_first", "only_second"):
            raise ValueError(f"truncation must be 'longest_first', 'only_first' or 'only_second', not {truncation!r}")
        a_ids, a_off = self._pieces(text, split_special_tokens)
        b_ids, b_off = self._pieces(pair, split_special_tokens) if pair is not None else ([], [])
        if max_length is not None:
            n_a, n_b = _truncated_lengths(len(a_ids), len(b_ids), pair is not None, max_length, truncation)
            a_ids, a_off, b_ids, b_off = a_ids[:n_a], a_off[:n_a], b_ids[:n_b], b_off[:n_b]
        cls, sep, none = self.cls_id, self.sep_id, (0, 0)
        if pair is None:
            return Encoding((cls, *a_ids, sep), (none, *a_off, none), len(a_ids) + 2)
        return Encoding((cls, *a_ids, sep, *b_ids, sep), (none, *a_off, none, *b_off, none), len(a_ids) + 2)

    def tokenize(self, text: str, split_special_tokens: bool = False) -> list[str]:
        """Word pieces of text as strings (no [CLS]/[SEP])."""
        return [self.inv[i] for i in self._pieces(text, split_special_tokens)[0]]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ids as HF's WordPiece decoder: pieces joined by spaces, "##" pieces glued on,
        " ." " ," " ?" " !" glued to the word before; specials left out when skip_special."""
        out: list[str] = []
        for t in self.pieces(ids):
            if skip_special and t in self.special_tokens:
                continue
            if out:
                t = t[2:] if t.startswith("##") else " " + t
                for dirty, clean in _CLEANUP:
                    t = t.replace(dirty, clean)
            out.append(t)
        return "".join(out)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Each id's token as vocab.txt spells it ("##s" for a continuation)."""
        out = []
        for i in ids:
            t = self.inv.get(int(i))
            if t is None:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self.inv) - 1})")
            out.append(t)
        return out

    @staticmethod
    def safe_chunks(text: str, chunk_chars: int) -> list[str]:
        """`text` cut after newlines into chunks of `chunk_chars` characters or more (the last may be
        shorter) whose word pieces, one chunk after the other, are the pieces of the whole (to encode a
        corpus in parallel): a word never spans whitespace, and no special token holds a newline.
        "".join(chunks) == text; a text without a newline past chunk_chars stays whole."""
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be at least 1, not {chunk_chars}")
        out, start = [], 0
        while len(text) - start > chunk_chars and (q := text.find("\n", start + chunk_chars - 1)) != -1:
            out.append(text[start:q + 1])
            start = q + 1
        return out + [text[start:]] if start < len(text) else out

    # ---- fast paths: the same pieces as the plain path, faster ------------------------------------------
    def _pieces(self, text: str, split_special_tokens: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """ids and original-text offsets of text's word pieces (no [CLS]/[SEP]). ASCII text without
        control characters or "[" (most text) is split by one regex with no per-character Python;
        words and whitespace-free chunks are cached."""
        cache = self._cache
        if text.isascii() and ("[" not in text or split_special_tokens) and not _ASCII_CONTROL.search(text):
            # split into [sep, word, sep, word, ..., sep]; a word starts where the text before it ends
            parts = _ASCII_SPLIT.split(text)
            words: list = parts[1::2]
            found: list = list(map(cache.get, words))
            if None in found:
                lower = self.lowercase
                found = [p if p is not None else self._lookup(w, w.lower() if lower else w)
                         for w, p in zip(words, found)]
            ids: list[int] = [i for p in found for i, _, _ in p]
            starts = islice(accumulate(map(len, parts)), 0, None, 2)
            offsets: list[tuple[int, int]] = [(s + a, s + b) for s, p in zip(starts, found) for _, a, b in p]
            return ids, offsets
        words = []
        parts = _SPECIAL_SPLIT.split(text) if "[" in text and not split_special_tokens else [text]
        pos = 0
        for k, part in enumerate(parts):
            if k % 2:  # a special token typed in the text
                words.append((part, pos, None))
            elif part:
                self._words(part, pos, words)
            pos += len(part)
        ids = []
        offsets = []
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

    def _words(self, text: str, base: int, out: list) -> None:
        """Append (word, start, align) for each word of basic_tokenize(text) (text begins at index base of
        the input): align is None when the word is the input at start.. up to case, else the index, counted
        from start, of each character's original character."""
        if text.isascii() and not _ASCII_CONTROL.search(text):  # no normalisation but case
            out.extend((w.group(), base + w.start(), None) for w in _ASCII_WORD.finditer(text))
            return
        chunks = self._chunks
        for m in _CHUNK.finditer(text):
            chunk = m.group()
            words = chunks.get(chunk)
            if words is None:
                if len(chunks) >= _CACHE_SIZE:
                    chunks.clear()
                if chunk.isascii() and _ASCII_SAFE.fullmatch(chunk):
                    words = tuple((w.group(), w.start(), None) for w in _ASCII_WORD.finditer(chunk))
                else:
                    words = tuple((w, 0, align) for w, align in basic_tokenize(chunk, self.lowercase, self._chars))
                chunks[chunk] = words
            start = base + m.start()
            for w, rel, align in words:
                out.append((w, start + rel, align))

    def _lookup(self, word: str, norm: str) -> tuple:
        """Cached wordpiece split of one word; the cache is keyed by the raw ASCII word or the normalised
        word (the two agree: a normalised uncased word holds no capitals)."""
        if len(self._cache) >= _CACHE_SIZE:
            self._seed_cache()
        pieces = self._cache[word] = wordpiece(norm, self.vocab, self.unk_id, self._max_piece)
        return pieces

    # ---- training and files --------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, lowercase: bool = True,
              progress: Callable[[int, int], None] | None = None, min_frequency: int = 2) -> "WordPiece":
        """Learn a WordPiece vocabulary the way HF tokenizers' WordPieceTrainer does: BPE merges of
        the most frequent adjacent pair over pre-tokenized words, non-initial symbols carrying "##".

        The vocabulary is the five specials, every character seen with and without "##" (so any
        word of seen characters splits without [UNK]), then merged pieces in merge order until
        vocab_size. Ties go to the lexicographically smallest pair (deterministic). ValueError when
        the texts hold no word, or no pair occurs min_frequency times (nothing would be learned).
        progress(done, total) is called after each new piece with done = 1, 2, ... and total = the pieces
        asked for; when the pairs run out first, one last call progress(done, done): the last call always
        has done == total.
        """
        base = cls({s: i for i, s in enumerate(SPECIALS)}, lowercase=lowercase)
        counts: Counter = Counter()
        for text in texts:
            words: list = []
            base._words(text, 0, words)
            counts.update(w.lower() if lowercase and a is None else w for w, _, a in words)
        if not counts:
            raise ValueError("nothing was learned: the training text holds no word")
        alphabet = sorted({c for w in counts for c in w})
        tokens = list(SPECIALS) + [t for c in alphabet for t in (c, "##" + c)]
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(SPECIALS)} special tokens + "
                             f"2 x {len(alphabet)} characters seen = {len(tokens)}; ask for at least that")
        merged = _learn_merges(counts, vocab_size - len(tokens), set(tokens), min_frequency, progress)
        if vocab_size > len(tokens) and not merged:
            raise ValueError(f"nothing was learned: no pair of characters in the training text ({sum(counts.values())} "
                             f"words) occurs {min_frequency} times (min_frequency); give more text")
        return cls({t: i for i, t in enumerate(tokens + merged)}, lowercase=lowercase)

    @classmethod
    def from_vocab(cls, vocab_txt, lowercase: bool = True) -> "WordPiece":
        return cls(read_vocab_txt(vocab_txt), lowercase=lowercase)

    @classmethod
    def load(cls, directory) -> "WordPiece":
        """vocab.txt + tokenizer_config.json's do_lower_case; without it, lower-case only when the
        vocabulary has no piece that lower-casing would change (an uncased vocabulary)."""
        vocab = read_vocab_txt(Path(directory) / "vocab.txt")
        return cls(vocab, lowercase=read_lowercase(directory, vocab))

    def save(self, directory) -> None:
        """vocab.txt + tokenizer_config.json (HF's BertTokenizerFast loads them); a failed save leaves the
        old files as they were."""
        names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS))
        write_wordpiece(directory, [self.inv[i] for i in range(len(self.inv))], self.lowercase, names)


# The fast paths' character classes (basic.py has the full ones): whitespace-free chunks; ASCII letters,
# digits and punctuation with no control characters, where the basic tokenizer only splits and lower-cases.
_CHUNK = re.compile(f"[^{WHITESPACE}]+")
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
_ASCII_SAFE = re.compile(f"[A-Za-z0-9{_ASCII_PUNCT}]*")
_ASCII_WORD = re.compile(f"[A-Za-z0-9]+|[{_ASCII_PUNCT}]")
_ASCII_SPLIT = re.compile(f"([A-Za-z0-9]+|[{_ASCII_PUNCT}])")
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


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


def _learn_merges(counts: Counter, n_merges: int, known: set, min_frequency: int,
                  progress: Callable[[int, int], None] | None = None) -> list[str]:
    """BPE merges with "##" continuation symbols; returns the new tokens in order (at most n_merges),
    calling progress(done, total) as WordPiece.train says.

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
            if progress is not None:
                progress(len(new), n_merges)
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
    if progress is not None and len(new) < n_merges:
        progress(len(new), len(new))     # stopped early: what was learned is the whole
    return new


