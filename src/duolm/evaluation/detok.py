"""Invertible de-tokenizers: undo a dataset's tokenization artifacts before a model scores it.

The GPT-2 paper scores WikiText, PTB and 1BW "after invertible de-tokenizers" (gains of 2.5 to 5
perplexity): tokenized text such as

    ' The role @-@ playing game ( released in 1 @,@ 000 copies ) was " good " . '
becomes
    'The role-playing game (released in 1,000 copies) was "good".'

and `retokenize` gives the original line back. A de-tokenized line is built from the line's tokens
(split on single spaces): a token is *glued* to its neighbour (the space between them dropped) where
the dataset's rules say so -- punctuation to the word before it, an opening bracket or quote to the
word after it, clitics ('s, n't) to their word, a connector (@-@, @,@, @.@) to both sides as its bare
character. `retokenize` splits every space-free chunk back into tokens with the inverse rules. A glue
is kept only if that split gives back exactly the glued tokens, so the line always round-trips,
whatever it holds (a token such as "U.S." or "America." stays apart from a following "." rather than
become ambiguous). Since the map is invertible, the probability of the de-tokenized text is a
probability of the original text: perplexities stay those of the dataset.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rules:
    """What a dataset's tokenizer split off, so what may be glued back (and split again)."""
    framed: bool                     # every line is " tok tok ... tok " (WikiText, PTB)
    closers: str = ""                # one-character tokens glued to the token before them
    openers: str = ""                # one-character tokens the next token is glued to
    quote: str = ""                  # a quote token, alternately opening and closing within a line
    open_close_quotes: tuple = ()    # ("``", "''"): tokens written as '"', opening / closing
    clitics: tuple = ()              # "'s", "n't", ...: glued to a word ending in a letter
    connectors: dict = field(default_factory=dict)   # "@-@" -> "-": glued to both neighbours
    period: bool = False             # "." glued to the word before it (see _period_splits)
    lowercased: bool = False         # lower-cased text: a sentence period may precede a lower-case word
    equals: bool = False             # runs of "=" tokens (WikiText headings) glued: "= = A = =" -> "== A =="


_CLITICS = ("'s", "'re", "'ve", "'m", "'ll", "'d", "n't", "'t")
# Words that end in "." when abbreviated: "No." keeps its period, so a period after "No" stays apart.
_ABBREVIATIONS = frozenset(
    "no nos st dr mr mrs ms jr sr col gen gov lt maj capt sgt co corp inc ltd bros ave vs v var al pp p mm "
    "lbs vol fig ft mt rev prof sen rep jan feb mar apr jun jul aug sep sept oct nov dec etc esq".split())

RULES = {
    "wikitext": Rules(framed=True, closers=",;:!?)]", openers="([", quote='"', clitics=_CLITICS,
                      connectors={"@-@": "-", "@,@": ",", "@.@": "."}, period=True, equals=True),
    "ptb": Rules(framed=True, clitics=_CLITICS),
    "1bw": Rules(framed=False, closers=",;:!?)]", openers="([", quote='"', clitics=_CLITICS, period=True),
    "books": Rules(framed=False, closers=",;:!?)]", openers="([", open_close_quotes=("``", "''"),
                   clitics=_CLITICS, period=True, lowercased=True),   # LAMBADA plain text, CBT
}


def _rules(dataset: str) -> Rules:
    if dataset not in RULES:
        raise ValueError(f"no de-tokenizer for {dataset!r}; choose one of {sorted(RULES)}")
    return RULES[dataset]


# --- splitting a chunk back into tokens ----------------------------------------------------------

def _period_splits(rest: str, after: str, r: Rules) -> bool:
    """Is "rest." the word `rest` plus a sentence period (not an abbreviation or a token such as
    "America." that kept its period)? No when `rest` holds a period (U.S., e.g., ...), is one letter
    (an initial), is a known abbreviation, or (cased text) the next character is a lower-case letter."""
    return (bool(rest) and "." not in rest and not (len(rest) == 1 and rest.isalpha())
            and rest.lower() not in _ABBREVIATIONS and (r.lowercased or not after[:1].islower()))


_HYPHEN = re.compile(r"(?<=[^-])-(?=[^-])")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)+")
_NUMBER_SEP = re.compile(r"([.,])")


def _split_middle(chunk: str, r: Rules) -> list[str]:
    if chunk in r.connectors:          # a connector left standing alone
        return [chunk]
    if r.equals and chunk and set(chunk) == {"="}:
        return list(chunk)
    parts = _HYPHEN.split(chunk) if "@-@" in r.connectors else [chunk]
    out = []
    for i, part in enumerate(parts):
        if i:
            out.append("@-@")
        if r.connectors and _NUMBER.fullmatch(part):
            for piece in _NUMBER_SEP.split(part):
                out.append({".": "@.@", ",": "@,@"}.get(piece, piece))
        else:
            out.append(part)
    return out


def split_chunk(chunk: str, after: str, r: Rules) -> list[str]:
    """Tokens of one space-free chunk of de-tokenized text; `after` is the text that follows it."""
    if not chunk or chunk.isalnum():   # nothing glued to a plain word
        return [chunk]
    left, right = [], []
    quotes = r.quote + ('"' if r.open_close_quotes else "")
    opening = r.openers + quotes
    while len(chunk) > 1 and chunk[0] in opening:
        left.append(r.open_close_quotes[0] if chunk[0] == '"' and r.open_close_quotes else chunk[0])
        chunk = chunk[1:]
    while len(chunk) > 1:
        nxt = right[0][:1] if right else after
        clitic = next((c for c in r.clitics if chunk.endswith(c) and len(chunk) > len(c)
                       and chunk[-len(c) - 1].isalpha()), None)
        if chunk[-1] in quotes or (chunk[-1] in r.closers and not set(chunk) <= set(r.closers)):
            right.insert(0, r.open_close_quotes[1] if chunk[-1] == '"' and r.open_close_quotes else chunk[-1])
            chunk = chunk[:-1]
        elif r.period and chunk[-1] == "." and _period_splits(chunk[:-1], nxt, r):
            right.insert(0, ".")
            chunk = chunk[:-1]
        elif clitic:
            right.insert(0, clitic)
            chunk = chunk[:-len(clitic)]
        else:
            break
    return left + _split_middle(chunk, r) + right


# --- gluing tokens into chunks -------------------------------------------------------------------

def _surfaces(toks: list[str], r: Rules) -> list[str]:
    """How each token of one chunk is written: a connector inside a chunk as its bare character,
    a `` or '' quote glued to a neighbour as '"'; everything else as itself."""
    n = len(toks)
    return [r.connectors[t] if t in r.connectors and 0 < k < n - 1
            else '"' if t in r.open_close_quotes and n > 1 else t
            for k, t in enumerate(toks)]


def _chunks(tokens: list[str], r: Rules) -> list[tuple[int, int]]:
    """Group tokens into chunks written without spaces -> [(first token index, end index)]."""
    n = len(tokens)
    closers, openers = set(r.closers), set(r.openers)          # one-character tokens
    quotes = [i for i, t in enumerate(tokens) if t == r.quote] if r.quote else []
    opens, closes = set(quotes[0::2]), set(quotes[1::2])
    if r.open_close_quotes:
        opens |= {i for i, t in enumerate(tokens) if t == r.open_close_quotes[0]}
        closes |= {i for i, t in enumerate(tokens) if t == r.open_close_quotes[1]}

    def ok(start, end):   # does the glued chunk split back into exactly tokens[start:end]?
        text = "".join(_surfaces(tokens[start:end], r))
        return split_chunk(text, tokens[end] if end < n else "", r) == tokens[start:end]

    out, i = [], 0
    while i < n:
        start = i
        i += 1
        while i < n:
            prev, tok = tokens[i - 1], tokens[i]
            if tok in r.connectors:          # glued to both sides or to neither
                if i + 1 < n and ok(start, i + 2):
                    i += 2
                    continue
                break
            want = (tok in closers or i in closes or (r.period and tok == ".") or tok in r.clitics
                    or prev in openers or (i - 1) in opens or (r.equals and tok == prev == "="))
            if not (want and tok and prev and ok(start, i + 1)):
                break
            i += 1
        out.append((start, i))
    return out


# --- the public pair -----------------------------------------------------------------------------

def _tokens(line: str, r: Rules) -> list[str]:
    if r.framed:
        if line == " ":
            return []
        if len(line) < 2 or line[0] != " " or line[-1] != " ":
            raise ValueError(f"expected a line framed by spaces (' tok tok '), got {line[:40]!r}")
        line = line[1:-1]
    return line.split(" ") if line else []


def detokenize_words(tokens: list[str], dataset: str) -> tuple[str, list[int]]:
    """De-tokenize a list of tokens -> (text, start offset of each token's text in it)."""
    r = _rules(dataset)
    tokens = list(tokens)
    parts, starts, pos = [], [], 0
    for start, end in _chunks(tokens, r):
        for surface in _surfaces(tokens[start:end], r):
            starts.append(pos)
            parts.append(surface)
            pos += len(surface)
        parts.append(" ")
        pos += 1
    return "".join(parts[:-1]), starts


def detokenize(line: str, dataset: str) -> str:
    """One line of the dataset (without its newline) -> natural text. Worked example (WikiText):

    >>> detokenize(' = = Early life = = ', 'wikitext')
    '== Early life =='
    >>> detokenize(' He won 1 @,@ 000 @-@ odd votes ( 52 @.@ 5 % ) ; " a record " . ', 'wikitext')
    'He won 1,000-odd votes (52.5 %); "a record".'
    """
    return detokenize_words(_tokens(line, _rules(dataset)), dataset)[0]


def retokenize(text: str, dataset: str) -> str:
    """The inverse of `detokenize`: retokenize(detokenize(line, d), d) == line for every line.

    >>> retokenize('He won 1,000-odd votes (52.5 %); "a record".', 'wikitext')
    ' He won 1 @,@ 000 @-@ odd votes ( 52 @.@ 5 % ) ; " a record " . '
    """
    r = _rules(dataset)
    chunks = text.split(" ") if text else []
    tokens = []
    for k, chunk in enumerate(chunks):
        tokens += split_chunk(chunk, chunks[k + 1] if k + 1 < len(chunks) else "", r)
    joined = " ".join(tokens)
    return (" " + joined + " " if tokens else " ") if r.framed else joined
