"""The one owner of writing files safely and of reading JSON that names its file (stdlib only, L0).

Every file duolm writes goes through `atomic_write`: the content is written to a temporary file in
the target's folder, flushed to disk, and renamed over the target (os.replace is atomic on POSIX and
Windows), so a crash or a full disk leaves either the old file or the new one, never half of one,
and never a stray temporary file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def atomic_write(path, write: Callable[[str], None]) -> Path:
    """Run `write(tmp_name)` to fill a temporary file beside `path`, fsync it, rename it over `path`.

    On any failure (an exception in `write`, a full disk, Ctrl-C) the temporary file is removed and
    `path` is left as it was. Returns `path` as a Path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and str(path) not in str(e):
            raise OSError(f"could not write {path} ({e.strerror or e})") from None
        raise
    return path


def write_text(path, text: str) -> Path:
    """Atomically write `text` (UTF-8) to `path`."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return atomic_write(path, write)


def write_json(path, obj, indent: int = 2) -> Path:
    """Atomically write `obj` as JSON (UTF-8, one trailing newline)."""
    return write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def read_json(path, what: str = "file", kind: type = dict):
    """A JSON object (or, with kind=list, an array) from `path`; every error names the file (and, for bad JSON,
    line and column).

    `what` says what the file is for in the missing-file message, e.g. "model config"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing {what}")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(obj, kind):
        raise ValueError(f"{path}: expected a JSON {'object' if kind is dict else 'array'}, got {type(obj).__name__}")
    return obj
