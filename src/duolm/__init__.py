"""duolm: GPT-2 and BERT, exact and small.

The public names are loaded lazily, so `import duolm.tokenizers` does not pull in torch.
"""
import importlib

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
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'duolm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
