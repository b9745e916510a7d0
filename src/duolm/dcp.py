"""Sharded checkpoints: torch.distributed.checkpoint (DCP) folders, written by every process of a run at once and
read back at any number of processes (DCP reshards at load), or in one process without a process group.

    FOLDER/.metadata          every tensor's name, shape and where its pieces lie (written last, by rank 0)
    FOLDER/__<rank>_0.distcp  each process's pieces

    write({"model": ..., "optimizer": ...}, folder)    every process, its own state (plain tensors or DTensor shards)
    read(state, folder, collective)                    fills `state` in place, each tensor with what it asks for

DCP pickles its metadata and the values that are not tensors (an optimizer's hyperparameters), and unpickles them
as they come. Pickles are never trusted here (duolm.checkpoint): the metadata is unpickled with an allow-list of
DCP's own records and checked against the files before DCP reads anything, the values with torch.load(weights_only=
True). A missing, cut or refused file is a ValueError that names it, before any tensor is read.
"""
from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, Metadata
from torch.distributed.checkpoint import metadata as _records

METADATA = ".metadata"
# what DCP's metadata is made of besides the record classes of torch.distributed.checkpoint.metadata
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib._local", "PosixPath")}


class _Refused(pickle.UnpicklingError):
    pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = super().find_class(module, name) if module.startswith(("torch", "pathlib")) else None
        if (module, name) in _ALLOWED or isinstance(found, torch.dtype) or (
                module == _records.__name__ and isinstance(found, type) and found.__module__ == module):
            return found
        raise _Refused(f"{module}.{name}")


def _check(folder: Path) -> None:
    """folder/.metadata unpickled with the allow-list, and every file it names there and long enough."""
    path = folder / METADATA
    if not path.is_file():
        raise ValueError(f"{folder}: not a sharded checkpoint (no {METADATA}; a run killed while writing it?)")
    try:
        with open(path, "rb") as f:
            metadata = _Unpickler(f).load()
    except _Refused as e:
        raise ValueError(f"{path}: refused as unsafe: it pickles {e}, which is not one of DCP's metadata records, "
                         f"and unpickling it could run code; duolm never loads such a file") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not readable DCP metadata ({e}); the file is cut short or corrupt") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = folder / name
        if Path(name).name != name:
            raise ValueError(f"{path}: shard name {name!r} points outside {folder}")
        if not shard.is_file():
            raise ValueError(f"{shard}: missing; the sharded checkpoint {folder} is incomplete")
        if shard.stat().st_size < end:
            raise ValueError(f"{shard}: cut short ({shard.stat().st_size} bytes, the metadata places data up to "
                             f"byte {end}); the sharded checkpoint {folder} is incomplete")


class _Planner(DefaultLoadPlanner):
    """DCP's load planner, the values that are not tensors first unpickled with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise ValueError(f"{read_item.dest_index.fqn}: refused as unsafe: the value holds more than plain data, "
                             f"and unpickling it could run code") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def _failure(e: CheckpointException) -> BaseException:
    """The error of the first process a DCP collective failed on."""
    failure = next(iter(e.failures.values()), None)
    return (failure[0] if isinstance(failure, tuple) else failure) or e


@contextlib.contextmanager
def _one_process_is_meant():
    with warnings.catch_warnings():        # "... assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def read(state: dict, folder, collective: bool = False) -> None:
    """Fills `state` (nested dicts of tensors and values, e.g. {"model": model.state_dict()}) from the sharded
    checkpoint in `folder`: each tensor, plain or a DTensor shard, gets its part of the saved one (keys the folder
    holds beyond `state`'s are not read). collective: every process of the process group calls it at once;
    otherwise this process reads alone. A key of `state` the folder lacks, a shape that differs, a file missing,
    cut short or refused is a ValueError that names the folder."""
    folder = Path(folder)
    _check(folder)
    try:
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=folder, planner=_Planner(), no_dist=not collective)
    except CheckpointException as e:
        raise ValueError(f"{folder}: the sharded checkpoint does not load ({_line(_failure(e))})") from None


def write(state: dict, folder) -> None:
    """Every process of the process group writes its part of `state` into `folder` at once (rank 0 the metadata,
    last); a tensor held whole by every process (a plain one) is written once. A failed write (a full disk) is the
    OSError of the process it happened on, raised on every process."""
    try:
        with _one_process_is_meant():
            dcp.save(state, checkpoint_id=Path(folder))
    except CheckpointException as e:
        error = _failure(e)
        if isinstance(error, OSError):
            raise error from None
        raise RuntimeError(f"{folder}: writing the sharded checkpoint failed ({_line(error)})") from None
