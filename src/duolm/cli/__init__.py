"""The `duolm` command. Each subcommand parses its arguments and wires library calls; printing happens
here only. Options that configure a library call are the fields of its config dataclass (one set of
defaults, help text from the fields: duolm.cli.options). The process keeps the memory it frees for its next
tensors and backs large ones with huge pages (duolm.malloc). Expected failures print one line naming the file or
the argument; `--debug` shows the traceback."""
from __future__ import annotations

import argparse
import sys

from duolm.cli import models, tasks
from duolm.malloc import huge_pages, keep_freed_memory, onednn_caches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duolm", description="GPT-2 and BERT: tokenizers, models, training, generation")
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in (models.add_tokenizer, models.add_convert, models.add_prepare, models.add_pretrain,
                tasks.add_finetune, tasks.add_predict, tasks.add_evaluate, models.add_generate,
                models.add_fill_mask, tasks.add_eval, tasks.add_score, models.add_serve, models.add_demo, models.add_env):
        add(sub)
    return parser


def _message(e: Exception) -> str:
    """The error's one line. Python's own OSErrors read "[Errno 20] Not a directory: '/x'"; they are said the way
    duolm's errors are, path first: "/x: Not a directory"."""
    if isinstance(e, OSError) and type(e).__str__ is OSError.__str__ and e.strerror and e.filename:
        where = f"{e.filename} -> {e.filename2}" if e.filename2 else f"{e.filename}"
        return f"{where}: {e.strerror}"
    return str(e)


def main(argv=None):
    args = build_parser().parse_args(argv)
    keep_freed_memory()                  # before any tensor: every command moves large ones (duolm.malloc)
    huge_pages()
    onednn_caches()
    try:
        args.func(args)
    except (ValueError, OSError, ImportError) as e:   # expected: bad input, missing files, a full disk, an extra
        if args.debug:
            raise
        print(f"duolm: error: {_message(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("duolm: interrupted", file=sys.stderr)
        sys.exit(130)
