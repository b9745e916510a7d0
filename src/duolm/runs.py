"""The run directory, one owner: its manifest, its checkpoint folders, its metrics log (stdlib only).

    RUN/checkpoint.json    {"latest": "ckpt-00000100", "step": 100, "checkpoints": [...], "best": {...}}
    RUN/ckpt-00000100/     a model directory (config.json, model.safetensors, tokenizer) + train_state.pt; a
                           sharded run's holds shards/ instead of model.safetensors: its processes' parts of the
                           model and optimizer state, each written by its process into the same temp folder
    RUN/best/              the best model so far by a chosen metric (fine-tuning), when asked for
    RUN/metrics.jsonl      one JSON object per logged step
    RUN/tb/, RUN/loss.png  TensorBoard events and the loss curve (written by duolm.train.logs)
    RUN/.lock              held (an OS lock) by the one process that writes the run: hold()

A checkpoint is written into RUN/.tmp-ckpt-XXXXXXXX, renamed into place, and only then named by the
manifest (written atomically, last): a checkpoint the manifest does not name is never loaded, so a
run killed at any moment resumes from the last complete one.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Callable

from duolm.fileio import read_json, write_error, write_json, write_text

MANIFEST = "checkpoint.json"
METRICS = "metrics.jsonl"
LOCK = ".lock"


@contextlib.contextmanager
def hold(run_dir):
    """While inside, this process is the run directory's one writer: an exclusive OS lock (flock) on RUN/.lock,
    which names the holder (pid, host). Another process asking for it is refused at once with a ValueError that
    names the directory and the holder: two trainings in one directory would mix their checkpoints and logs. The
    OS drops the lock when its process ends, however it ends, so a killed run resumes without a stale lock."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise ValueError(f"{run_dir} is being written by {holder}; one run directory has one writer "
                             f"(wait for it, or choose another directory)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield run_dir
    finally:
        os.close(fd)                                   # releases the lock


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def staging(run_dir, step: int) -> Path:
    """RUN/.tmp-ckpt-<step>: where checkpoint `step` is written before save_checkpoint renames it into place (the
    other processes of a sharded run write their parts there while save_checkpoint's `write` runs)."""
    return Path(run_dir) / (".tmp-" + ckpt_name(step))


def is_run(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(run_dir) -> dict | None:
    """The run's manifest, or None when it has no complete checkpoint yet."""
    path = Path(run_dir) / MANIFEST
    return read_json(path) if path.exists() else None


def latest_checkpoint(run_dir, weights=("model.safetensors", "shards/.metadata")) -> Path:
    """The newest complete checkpoint folder named by RUN/checkpoint.json (config.json and one of `weights`).
    Should a named folder be gone or lack its files, the next newest listed one is taken."""
    run_dir = Path(run_dir)
    manifest = read_json(run_dir / MANIFEST, "run manifest")
    listed = manifest.get("checkpoints", [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise ValueError(f"{run_dir / MANIFEST}: \"checkpoints\" must be a list of folder names, got {listed!r}")
    names = ([manifest["latest"]] if isinstance(manifest.get("latest"), str) else []) + listed[::-1]
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts or "/" in name:
            raise ValueError(f"{run_dir / MANIFEST}: checkpoint name {name!r} points outside the run directory")
        d = run_dir / name
        if (d / "config.json").is_file() and any((d / w).is_file() for w in weights):
            return d
    raise FileNotFoundError(f"{run_dir / MANIFEST}: names no complete checkpoint (tried {names or 'none'}; "
                            f"each needs config.json and {' or '.join(weights)})")


def save_checkpoint(run_dir, step: int, write: Callable[[Path], None], keep_last: int = 3,
                    best: dict | None = None, info: dict | None = None) -> Path:
    """Writes RUN/ckpt-<step>/ with `write(folder)` through a temp folder, then the manifest, then prunes
    all but the newest `keep_last` checkpoints (and orphans of killed runs). `best` is recorded in the
    manifest as given (e.g. {"metric": "val_accuracy", "value": 0.91, "step": 300}), and so are the
    entries of `info` (facts of the whole run, e.g. {"precision": "bf16"}). On failure (a full
    disk, say) the temp folder is removed and the previous checkpoint stays the latest."""
    run_dir = Path(run_dir)
    name = ckpt_name(step)
    tmp, final = staging(run_dir, step), run_dir / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if final.exists():                                # left by a run killed before its manifest named it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (read_manifest(run_dir) or {}).get("latest")
        raise write_error(final, e, f"the last complete checkpoint is {last or 'none (nothing saved yet)'}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = read_manifest(run_dir) or {}
    kept = [c for c in old.get("checkpoints", []) if c != name and int(c.split("-")[1]) < step]
    kept = (kept + [name])[-keep_last:]
    manifest = {**(info or {}), "latest": name, "step": step, "checkpoints": kept}
    if best or old.get("best"):
        manifest["best"] = best or old["best"]
    write_manifest(run_dir, manifest)
    for p in run_dir.glob("ckpt-*"):                      # older ones past keep_last, and orphans
        if p.name not in kept:
            shutil.rmtree(p, ignore_errors=True)
    return final


def write_manifest(run_dir, manifest: dict) -> None:
    write_json(Path(run_dir) / MANIFEST, manifest)


def replace_folder(target, write: Callable[[Path], None]) -> Path:
    """Write a folder (e.g. RUN/best) whole: into a temp folder, then swapped in for the old one."""
    target = Path(target)
    tmp, old = target.with_name(".tmp-" + target.name), target.with_name(".old-" + target.name)
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


# --- metrics.jsonl -------------------------------------------------------------------------------

def read_metrics(run_dir) -> list[dict]:
    """Every complete row of RUN/metrics.jsonl (a last line cut short by a kill is skipped)."""
    path = Path(run_dir) / METRICS
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


class MetricsLog:
    """Appends one JSON row per logged step to RUN/metrics.jsonl, flushed at once.

    Opening it for a run that resumes at `resume_step` drops the rows a killed run wrote past its last
    checkpoint (they are computed again), so after any kill and resume every step is there once;
    `resume_step=None` (a fresh start) starts an empty log."""

    def __init__(self, run_dir, resume_step: int | None):
        self.path = Path(run_dir) / METRICS
        rows = [] if resume_step is None else [r for r in read_metrics(run_dir) if r.get("step", 0) <= resume_step]
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self.f = open(self.path, "a", encoding="utf-8")

    def __call__(self, row: dict) -> None:
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()
