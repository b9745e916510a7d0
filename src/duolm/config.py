"""Config dataclass fields that carry their command-line help: one set of defaults for the library and the CLI
(duolm.cli.options derives a flag from every field).

    @dataclass
    class TrainConfig:
        lr: float = opt(6e-4, "peak learning rate")
        betas: tuple = opt((0.9, 0.95), "AdamW betas", cli=False)     # no flag
"""
from __future__ import annotations

from dataclasses import field, is_dataclass, replace


def opt(default, help: str, **meta):
    """A dataclass field with `default` and metadata {"help": help, **meta} (cli=False: no flag; choices=...).
    A mutable default (a dataclass instance) is given as a factory of copies."""
    if is_dataclass(default):
        return field(default_factory=lambda: replace(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})
