"""duolm: GPT-2 and BERT — tokenizers, models, checkpoints, training, generation.

    import duolm
    model, tok = duolm.load("path/to/dir")     # duolm or Hugging Face directory
    duolm.save(model, "out/", tokenizer=tok)   # format="hf" writes what transformers loads

Names are imported lazily (PEP 562), so `import duolm.tokenizers` does not pull in torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "load": "duolm.checkpoint",
    "save": "duolm.checkpoint",
    "GPT2": "duolm.models",
    "GPT2Config": "duolm.models",
    "KVCache": "duolm.models",
    "Bert": "duolm.models",
    "BertConfig": "duolm.models",
    "BertForPreTraining": "duolm.models",
    "ByteLevelBPE": "duolm.tokenizers",
    "WordPiece": "duolm.tokenizers",
    "generate": "duolm.generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'duolm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for editors and type checkers; never executed
    from duolm.checkpoint import load, save
    from duolm.generation import generate
    from duolm.models import GPT2, Bert, BertConfig, BertForPreTraining, GPT2Config, KVCache
    from duolm.tokenizers import ByteLevelBPE, WordPiece
