"""Options from config dataclasses (one set of defaults, help text from the fields), the training progress bar
every training command shows, and bars opened on demand."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing


def _flagged(cls, default=None, pick=None):
    """(name, type, default, metadata) of every field of dataclass `cls` that gets a flag: fields with metadata
    cli=False are left out; a field holding a dataclass gives the flags of that dataclass's fields (those its
    metadata "fields" names, with their help where given), defaulting to the field's default instance."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if not meta.get("cli", True) or (pick is not None and f.name not in pick):
            continue
        if pick and pick[f.name]:
            meta["help"] = pick[f.name]
        value = getattr(default, f.name) if default is not None else f.default
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _flagged(hints[f.name], f.default_factory(), meta.get("fields"))
            continue
        kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        yield f.name, kind, value, meta


def add_options(parser, cls, pick: dict | None = None) -> None:
    """One --flag per field of dataclass `cls` (see _flagged), defaults and help from the fields; `pick`: only the
    fields it names, each with its own help where the value is not None."""
    for name, kind, default, meta in _flagged(cls, pick=pick):
        flag = "--" + name.replace("_", "-")
        if kind is bool and default is None:                   # unset = decided later: --flag / --no-flag
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=meta.get("help"))
        elif kind is bool:
            flag = flag if not default else "--no-" + flag[2:]
            parser.add_argument(flag, dest=name, action="store_false" if default else "store_true",
                                help=meta.get("help"))
        elif typing.get_origin(kind) is list:                  # a repeated flag, each one adds an item
            parser.add_argument(flag, dest=name, action="append", type=typing.get_args(kind)[0], default=None,
                                help=meta.get("help"))
        else:
            parser.add_argument(flag, dest=name, type=kind, default=default, choices=meta.get("choices"),
                                help=meta.get("help", "") + ("" if default is None else f" (default: {default})"))


def add_precision(parser) -> None:
    """--precision of an inference command (prediction, evaluation, generation)."""
    from duolm.precision import PRECISIONS

    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="matmul arithmetic: fp32 exact (auto), or bf16 / int8 matmuls on CPU (faster, "
                             "slightly different numbers)")


def for_inference(model, args, device="cpu"):
    """`model` with its linears swapped for the precision --precision resolves to (once, here:
    duolm.precision.resolve and quantize)."""
    from duolm.precision import quantize, resolve

    return quantize(model, resolve(args.precision, device, training=False))


def report_compile(model) -> None:
    """Prints (stderr) the seconds `model`'s static decode steps took to compile (--compile), where any was built."""
    from duolm.generation.static import decoder_of

    if decoder_of(model).built:
        print(f"duolm: compiled the decode step in {decoder_of(model).compile_s:.1f} s", file=sys.stderr)


def options(cls, args):
    """The dataclass `cls` filled from parsed arguments (fields without a flag keep their defaults; a field holding
    a dataclass is its default instance with the flagged fields replaced)."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            inner, pick = f.default_factory(), f.metadata.get("fields")
            kw[f.name] = dataclasses.replace(inner, **{g.name: getattr(args, g.name) for g in dataclasses.fields(inner)
                                                       if hasattr(args, g.name) and (pick is None or g.name in pick)})
        elif hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
    return cls(**kw)


class Progress:
    """A tqdm bar of training steps fed with metrics rows (`on_log`); validation rows and skipped updates are
    printed as lines above it. `start` (the library's on_start) prints what is trained where and opens the bar."""

    def __init__(self, name: str, total: int, quiet: bool, perplexity: bool = False):
        self.name, self.total, self.quiet, self.perplexity, self.bar = name, total, quiet, perplexity, None

    def start(self, model, device, step, precision, layout):
        from tqdm import tqdm

        print(f"{self.name}: {model.num_params():,} parameters on {device} in {precision}"
              + (f"; resuming at step {step}" if step else ""))
        print(layout)
        self.bar = tqdm(total=self.total, initial=step, unit="step", dynamic_ncols=True, disable=self.quiet)

    def __call__(self, row):
        import math

        if "loss" in row:
            self.bar.update(row["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_s']:,.0f}")
        val = {k[4:]: v for k, v in row.items() if k.startswith("val_")}
        if val:
            ppl = f" (perplexity {math.exp(min(val['loss'], 50)):.2f})" if self.perplexity and "loss" in val else ""
            self.bar.write(f"step {row['step']}: validation " + " ".join(f"{k} {v:.4f}" for k, v in val.items()) + ppl)
        if row.get("nonfinite"):
            self.bar.write(f"step {row['step']}: non-finite loss or gradient, update skipped ({row['skipped']} so far)")

    def close(self):
        if self.bar is not None:
            self.bar.close()


class Bars:
    """tqdm bars opened on demand, one per key (a task, a run), all closed when the with-block ends."""

    def __init__(self, disable: bool):
        self.disable, self.bars = disable, {}

    def __enter__(self):
        return self

    def __call__(self, key, total: int, **kw):
        from tqdm import tqdm

        if key not in self.bars:
            self.bars[key] = tqdm(total=total, disable=self.disable, dynamic_ncols=True, **kw)
        return self.bars[key]

    def __exit__(self, *exc):
        for bar in self.bars.values():
            bar.close()
