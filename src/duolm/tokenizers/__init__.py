"""Tokenizers in pure Python (+ `regex`): GPT-2's byte-level BPE and BERT's WordPiece. Never imports torch."""
from .bpe import ByteLevelBPE
from .wordpiece import WordPiece

__all__ = ["ByteLevelBPE", "WordPiece"]
