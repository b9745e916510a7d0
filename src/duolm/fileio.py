"""The one owner of writing files safely and of reading JSON that names its file (stdlib only, L0).

Every file duolm writes goes through `atomic_write`: the content is written to a temporary file in
the target's folder, flushed to disk, and renamed over the target (os.replace is atomic on POSIX and
Windows), so a crash or a full disk leaves either the old file or the new one, never half of one,
and never a stray temporary file. A write that fails raises a WriteError: the path and the operating
system's reason ("No space left on device", "Permission denied", "Read-only file system", ...) in one line.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


class WriteError(OSError):
    """A write that failed, said in one line: `filename` (the path) could not be written, `strerror` is the
    operating system's reason and `errno` its number (None when no OS reason was found); `note` adds what the
    caller knows (e.g. which checkpoint is still the latest)."""

    def __init__(self, errno: int | None, reason: str, path, note: str = ""):
        super().__init__(errno, reason, str(path))
        self.note = note

    def __str__(self):
        return f"could not write {self.filename} ({self.strerror})" + (f"; {self.note}" if self.note else "")


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")   # how Rust's std::io::Error shows an errno (safetensors)


def _os_reason(e: BaseException) -> tuple[int | None, str] | None:
    """(errno, reason) of the OS error behind `e`, or None. Libraries wrap I/O errors in their own types:
    torch.save raises a RuntimeError whose context is the file's OSError, safetensors a SafetensorError whose
    message ends in Rust's "(os error N)"; so the chain of causes is walked, then the message read."""
    seen = set()
    x = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.strerror:
            return x.errno, x.strerror
        x = x.__cause__ or x.__context__
    m = _RUST_OS_ERROR.search(str(e))
    return (int(m[1]), os.strerror(int(m[1]))) if m else None


def write_error(path, e: BaseException, note: str = "") -> WriteError:
    """The WriteError for a failed write of `path` that raised `e`: the OS's reason when one is found in `e`
    or its causes, else the message of `e` itself."""
    errno, reason = _os_reason(e) or (None, str(e))
    return WriteError(errno, reason, path, note)


def atomic_write(path, write: Callable[[str], None]) -> Path:
    """Run `write(tmp_name)` to fill a temporary file beside `path`, fsync it, rename it over `path`.

    On any failure (an exception in `write`, a full disk, Ctrl-C) the temporary file is removed and
    `path` is left as it was; an I/O error (an OSError, or a library's error with one behind it) is raised
    as a WriteError naming `path` and the OS's reason. Returns `path` as a Path."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, Exception) and not isinstance(e, WriteError) and (isinstance(e, OSError) or _os_reason(e)):
            raise write_error(path, e) from e
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
