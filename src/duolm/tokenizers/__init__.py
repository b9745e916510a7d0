"""Tokenizers in pure Python (+ `regex`): GPT-2's byte-level BPE and BERT's WordPiece. Never imports torch."""
from pathlib import Path

from .bpe import ByteLevelBPE
from .wordpiece import WordPiece

__all__ = ["ByteLevelBPE", "WordPiece", "load_tokenizer"]


def load_tokenizer(directory):
    """The tokenizer saved in `directory`: vocab.json + merges.txt (or OpenAI's encoder.json +
    vocab.bpe, the same format) -> ByteLevelBPE, vocab.txt -> WordPiece; None when the directory
    holds neither."""
    d = Path(directory)
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return ByteLevelBPE.load(d)
    if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
        return ByteLevelBPE.from_files(d / "encoder.json", d / "vocab.bpe")
    if (d / "vocab.txt").is_file():
        return WordPiece.load(d)
    return None
