"""Tokenizer files, read and written in one place: GPT-2's vocab.json + merges.txt (HF's, and OpenAI's
encoder.json + vocab.bpe, are the same format), tiktoken rank files, BERT's vocab.txt + tokenizer_config.json.

Reading: every error names the file, and the line where there is one; ids are bounded before they are used.
Writing: each file atomically, and all of a tokenizer's files before any of them replaces its old one, so
a save that fails (a full disk) leaves the old tokenizer whole.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from duolm.fileio import atomic_write, read_json

ENDOFTEXT = "<|endoftext|>"
SPECIALS_FILE = "special_tokens.json"
MAX_ID = 1 << 24  # token ids read from files are below this (the largest published vocabularies hold ~260k)


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


BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def token_str(token: bytes) -> str:
    """A token as vocab.json spells it."""
    return "".join(BYTE_TO_CHAR[b] for b in token)


def _check_id(i, where: str) -> None:
    if type(i) is not int or not 0 <= i < MAX_ID:
        raise ValueError(f"{where}: id {i!r} is not an integer from 0 to {MAX_ID - 1}")


def write_texts(files: dict) -> None:
    """Write {path: text} (UTF-8), each file atomically, all of them before any replaces its old file."""
    (path, text), *rest = files.items()

    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if rest:  # the next files are written (and renamed) before this one is renamed
            write_texts(dict(rest))

    atomic_write(path, write)


# --- byte-level BPE ----------------------------------------------------------------------------------------

def read_bpe(vocab_json, merges_txt, special_tokens: dict[str, int] | None):
    """(encoder, special_tokens, ranks, merges) from vocab.json + merges.txt. `special_tokens` None:
    `<|endoftext|>` with its id in the vocab, if it is there. ranks is None when the ids follow the merge
    order (then the encoder ranks the merges), else {token bytes: merge line}."""
    vocab_json, merges_txt = Path(vocab_json), Path(merges_txt)
    vocab = read_json(vocab_json, "byte-level BPE vocabulary")
    if special_tokens is None:
        special_tokens = {ENDOFTEXT: vocab[ENDOFTEXT]} if ENDOFTEXT in vocab else {}
    encoder = {}
    for tok, i in vocab.items():
        _check_id(i, f"{vocab_json}: token {tok!r}")
        if tok in special_tokens:
            if special_tokens[tok] != i:
                raise ValueError(f"{vocab_json}: special token {tok!r} has id {i}, not {special_tokens[tok]}")
            continue
        try:
            encoder[bytes(_CHAR_TO_BYTE[c] for c in tok)] = i
        except KeyError:
            raise ValueError(f"{vocab_json}: token {tok!r} (id {i}) is not in GPT-2's byte alphabet; pass it "
                             "in special_tokens if it is a special token") from None
    merges: list[tuple[bytes, bytes]] = []
    ranks: dict[bytes, int] = {}
    with open(merges_txt, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{merges_txt}: line {lineno}: not valid UTF-8 ({e.reason}); the file is corrupt") \
                    from None
            if (lineno == 1 and line.startswith("#version")) or not line:
                continue
            try:
                a, b = (bytes(_CHAR_TO_BYTE[c] for c in p) for p in line.split(" "))
            except (KeyError, ValueError):
                raise ValueError(f"{merges_txt}: line {lineno}: expected two tokens in GPT-2's byte alphabet "
                                 f"separated by one space, got {line[:80]!r}; the file is corrupt") from None
            if a + b not in encoder or a not in encoder or b not in encoder:
                raise ValueError(f"{merges_txt}: line {lineno}: merge {line!r} uses or makes a token that is not "
                                 f"in {vocab_json}; the files do not belong together")
            if a + b not in ranks:  # a second merge to the same bytes can never apply
                ranks[a + b] = len(ranks)
                merges.append((a, b))
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in encoder]
    if missing:
        raise ValueError(f"{vocab_json}: {len(missing)} of the 256 byte tokens are missing, e.g. "
                         f"{token_str(missing[0])!r}; the file is truncated or not a byte-level vocab")
    orphans = [t for t in encoder if len(t) > 1 and t not in ranks]
    if orphans:
        raise ValueError(f"{vocab_json}: {len(orphans)} tokens are made by no merge in {merges_txt}, e.g. "
                         f"{token_str(orphans[0])!r}; is {merges_txt.name} truncated? (added tokens must be "
                         "passed in special_tokens)")
    in_order = all(encoder[t] < encoder[u] for t, u in zip(ranks, list(ranks)[1:]))
    return encoder, special_tokens, None if in_order else ranks, merges


def read_tiktoken(path) -> dict[bytes, int]:
    """{token bytes: rank} from a `.tiktoken` file (lines: base64 token, space, rank)."""
    encoder: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, number = line.split()
                rank = int(number)
                encoder[base64.b64decode(tok, validate=True)] = rank
            except ValueError:
                raise ValueError(f"{path}: line {lineno}: expected '<base64 token> <rank>', got "
                                 f"{line[:80]!r}; the file is corrupt or truncated") from None
            _check_id(rank, f"{path}: line {lineno}")
    missing = [b for b in range(256) if bytes([b]) not in encoder]
    if missing:
        raise ValueError(f"{path}: {len(missing)} of the 256 single-byte tokens are missing (e.g. byte "
                         f"{missing[0]}); the file is truncated or not a byte-level BPE")
    if len(set(encoder.values())) != len(encoder):
        raise ValueError(f"{path}: two tokens share a rank; the file is corrupt")
    return encoder


def read_special_tokens(path) -> dict[str, int]:
    """special_tokens.json: {"special_tokens": {token: id}}."""
    specials = read_json(path).get("special_tokens")
    if not isinstance(specials, dict):
        raise ValueError(f"{path}: expected {{\"special_tokens\": {{token: id}}}}")
    for s, i in specials.items():
        _check_id(i, f"{path}: special token {s!r}")
    return specials


def write_bpe(directory, encoder: dict[bytes, int], special_tokens: dict[str, int], merges) -> None:
    """vocab.json + merges.txt (GPT-2/HF format, loadable by HF `tokenizers` and, as ranks, by tiktoken)
    and special_tokens.json."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab = {token_str(t): i for t, i in sorted(encoder.items(), key=lambda kv: kv[1])}
    vocab.update(special_tokens)
    write_texts({
        d / "vocab.json": json.dumps(vocab, ensure_ascii=False),
        d / "merges.txt": "#version: 0.2\n" + "".join(f"{token_str(a)} {token_str(b)}\n" for a, b in merges),
        d / SPECIALS_FILE: json.dumps({"special_tokens": special_tokens}, ensure_ascii=False, indent=1),
    })


# --- WordPiece ------------------------------------------------------------------------------------------------

def read_vocab_txt(path) -> dict[str, int]:
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
            raise ValueError(f"{p}, line {n + 1}: not valid UTF-8 ({e.reason}); the file is corrupt or truncated") \
                from None
        if not tok or any(ch.isspace() for ch in tok):
            raise ValueError(f"{p}, line {n + 1}: {tok!r} is not a token (empty or with whitespace); "
                             "vocab.txt holds one token per line")
        if tok in vocab:
            raise ValueError(f"{p}, line {n + 1}: {tok!r} repeats line {vocab[tok] + 1}; a token may appear once")
        vocab[tok] = n
    return vocab


def read_lowercase(directory, vocab: dict[str, int]) -> bool:
    """tokenizer_config.json's do_lower_case; without one, True when no piece of `vocab` changes when
    lower-cased (an uncased vocabulary; [CLS], [unused0], <s> ... are not looked at)."""
    cfg = Path(directory) / "tokenizer_config.json"
    if cfg.is_file():
        lowercase = read_json(cfg, "tokenizer config").get("do_lower_case")
        if not isinstance(lowercase, (bool, type(None))):
            raise ValueError(f"{cfg}: do_lower_case is {lowercase!r}; expected true or false")
        if lowercase is not None:
            return lowercase
    return all(t.lower() == t for t in vocab if t[:1] + t[-1:] not in ("[]", "<>"))


def write_wordpiece(directory, tokens: list[str], lowercase: bool, specials: dict[str, str]) -> None:
    """vocab.txt (a token per line, id = line) + tokenizer_config.json (do_lower_case and the special
    tokens, which HF's BertTokenizerFast.from_pretrained reads)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"do_lower_case": lowercase, "tokenizer_class": "BertTokenizer", **specials}
    write_texts({d / "vocab.txt": "".join(t + "\n" for t in tokens),
                 d / "tokenizer_config.json": json.dumps(cfg, indent=2) + "\n"})
