"""Tokenizers in pure Python (+ `regex`): GPT-2's byte-level BPE and BERT's WordPiece. Never imports torch."""
from pathlib import Path
from typing import Callable

from .base import Tokenizer
from .bpe import ByteLevelBPE
from .wordpiece import WordPiece

__all__ = ["Tokenizer", "ByteLevelBPE", "WordPiece", "load_tokenizer", "train_tokenizer", "show_pieces"]


def load_tokenizer(directory, required: bool = True) -> Tokenizer | None:
    """The tokenizer saved in `directory`: vocab.json + merges.txt (or OpenAI's encoder.json +
    vocab.bpe, the same format) -> ByteLevelBPE, vocab.txt -> WordPiece. When the directory holds
    neither: an error, or None if not `required`."""
    d = Path(directory)
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return ByteLevelBPE.load(d)
    if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
        return ByteLevelBPE.from_files(d / "encoder.json", d / "vocab.bpe")
    if (d / "vocab.txt").is_file():
        return WordPiece.load(d)
    if not required:
        return None
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such tokenizer directory")
    raise ValueError(f"{d}: no tokenizer files (vocab.json + merges.txt or encoder.json + vocab.bpe for byte-level "
                     f"BPE, or vocab.txt for WordPiece); train one with `duolm tokenizer train`")


def train_tokenizer(kind: str, files, vocab_size: int, min_frequency: int = 2, lowercase: bool = True,
                    progress: Callable[[int, int], None] | None = None) -> Tokenizer:
    """Train a "bpe" (byte-level BPE) or "wordpiece" tokenizer on text files, streamed line by line.
    progress(done, total) reports the tokens learned (merges), as ByteLevelBPE.train / WordPiece.train say;
    the library prints nothing (the CLI draws the bar)."""
    if kind not in ("bpe", "wordpiece"):
        raise ValueError(f"kind {kind!r} is not 'bpe' or 'wordpiece'")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"no such file: {', '.join(missing)}")

    def lines():
        for f in files:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield from fh

    if kind == "bpe":
        return ByteLevelBPE.train(lines(), vocab_size, min_frequency=min_frequency, progress=progress)
    return WordPiece.train(lines(), vocab_size, lowercase=lowercase, min_frequency=min_frequency, progress=progress)


def show_pieces(tok, text: str, allow_special: bool = False) -> tuple[list[int], list[str]]:
    """(ids, pieces) of `text`, a piece per id: its text, or the repr of its bytes when it holds part of
    a character. Special tokens typed in the text are plain text unless `allow_special`."""
    if isinstance(tok, ByteLevelBPE):
        ids = tok.encode(text, allowed_special="all" if allow_special else set(), disallowed_special=())
        raw = [tok.decode_bytes([i]) for i in ids]
        return ids, [b.decode() if b.decode(errors="replace") == b.decode(errors="ignore") else str(b) for b in raw]
    ids = tok.encode(text, split_special_tokens=not allow_special)
    return ids, tok.pieces(ids)
