"""What duolm asks of a tokenizer, whichever family it serves: the `Tokenizer` protocol that ByteLevelBPE
(GPT-2) and WordPiece (BERT) implement. Code past the tokenizers (data preparation, serving, the CLI)
types its tokenizer as `Tokenizer`; what only one family has (BPE's rules for special tokens typed in a
text, WordPiece's pairs and offsets) stays a method of that class."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Iterable, Protocol


class Tokenizer(Protocol):
    kind: ClassVar[str]              # the files' format: "bpe" (vocab.json + merges.txt) or "wordpiece" (vocab.txt)
    special_tokens: dict[str, int]   # name -> id of each special token ("<|endoftext|>"; "[CLS]", "[SEP]", ...)

    @property
    def vocab_size(self) -> int:
        """Ids are 0 .. vocab_size - 1."""
        ...

    def encode(self, text: str) -> list[int]:
        """The ids a model reads for `text`: byte-level BPE the text's own ids, WordPiece [CLS] pieces [SEP]."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included; an id outside the vocabulary is a ValueError."""
        ...

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Each id's token as the vocabulary file spells it (vocab.json's "Ġthe", vocab.txt's "##s")."""
        ...

    @staticmethod
    def safe_chunks(text: str, chunk_chars: int) -> list[str]:
        """`text` cut into chunks whose ids, one after the other, are the ids of the whole text."""
        ...

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer's files into `directory` (each atomically)."""
        ...
