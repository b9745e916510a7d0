"""The `duolm` command. Each subcommand wires library calls together; printing happens here only."""
from __future__ import annotations

import argparse
import sys


# --- tokenizer --------------------------------------------------------------------------------

def cmd_tokenizer_train(args):
    raise NotImplementedError


def cmd_tokenizer_encode(args):
    raise NotImplementedError


def _add_tokenizer(sub):
    p = sub.add_parser("tokenizer", help="train or use a tokenizer")
    tsub = p.add_subparsers(dest="tokenizer_cmd", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE or WordPiece tokenizer on text files")
    t.add_argument("--kind", choices=["bpe", "wordpiece"], required=True)
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--min-frequency", type=int, default=2)
    t.add_argument("--cased", action="store_true", help="WordPiece: keep case and accents")
    t.add_argument("files", nargs="+")
    t.add_argument("-o", "--out", required=True, help="output directory")
    t.set_defaults(func=cmd_tokenizer_train)
    e = tsub.add_parser("encode", help="print the ids and pieces of a text")
    e.add_argument("dir")
    e.add_argument("text")
    e.set_defaults(func=cmd_tokenizer_encode)


# --- end of subcommands ------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duolm", description="GPT-2 and BERT: tokenizers, models, training, generation")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in (_add_tokenizer,):
        add(sub)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"duolm: error: {e}", file=sys.stderr)
        sys.exit(2)
