"""Models by name from the local Hugging Face cache, offline: "gpt2" -> the folder of its files.

The hub's cache (as huggingface_hub lays it out, and as `huggingface-cli download` fills it):

    CACHE/models--openai-community--gpt2/
        blobs/<sha256>                     the files' contents
        refs/main                          a commit hash, e.g. 607a30d783dfa663caf39e06633721c8d4cfcd7e
        snapshots/<commit>/config.json     symlinks into ../../blobs
        snapshots/<commit>/model.safetensors ...

Nothing here touches the network. The environment is passed in (the caller hands os.environ).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

# Short names the hub moved under an organisation ("gpt2" -> "openai-community/gpt2",
# "bert-base-uncased" -> "google-bert/bert-base-uncased"); either may be in a cache.
ORGS = ("openai-community", "google-bert")
# A repo id: "name" or "org/name"; ASCII letters, digits, "-", "_", "."; no "--" or ".." (the hub's rules).
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_repo_id(name: str) -> bool:
    """"gpt2", "openai-community/gpt2-medium" -> True; "./x", "a/b/c", "../x" -> False."""
    return bool(_REPO_ID.fullmatch(name))


def cache_dir(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps its cache, in its own order: HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def candidates(name: str) -> list[str]:
    """Repo ids to try for `name`: "gpt2" -> ["gpt2", "openai-community/gpt2", "google-bert/gpt2"]."""
    return [name] if "/" in name else [name] + [f"{org}/{name}" for org in ORGS]


def resolve(name: str, env: Mapping[str, str], revision: str = "main") -> Path:
    """The snapshot folder of model `name` at `revision` (a branch or tag in refs/, or a commit hash)
    in the local cache. Raises FileNotFoundError naming every path tried and how to fill the cache."""
    if not is_repo_id(name):
        raise ValueError(f"{name!r} is not a Hugging Face model name (\"name\" or \"org/name\")")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", revision) or ".." in revision:
        raise ValueError(f"revision {revision!r} is not a branch, tag or commit hash")
    cache = cache_dir(env)
    tried = []
    for repo_id in candidates(name):
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        ref = repo / "refs" / revision
        if ref.is_file():            # a branch or tag: the file holds the commit hash
            commit = ref.read_text(encoding="utf-8", errors="replace").strip()
            if not _COMMIT.fullmatch(commit):
                raise ValueError(f"{ref}: expected a 40-digit commit hash, got {commit[:60]!r}; the cache is corrupt")
            snapshot = repo / "snapshots" / commit
        elif _COMMIT.fullmatch(revision):
            snapshot = repo / "snapshots" / revision
        else:
            tried.append(str(repo if not repo.is_dir() else ref))
            continue
        if snapshot.is_dir():
            return snapshot
        tried.append(str(snapshot))
    folder = "models--" + name.replace("/", "--")
    raise FileNotFoundError(
        f"{name!r} (revision {revision!r}) is not in the local Hugging Face cache {cache}; looked for "
        f"{', '.join(tried)}. duolm never downloads: on a machine with internet run "
        f"`huggingface-cli download {name}`, then copy its cache folder {folder} into {cache}, or set "
        f"HF_HUB_CACHE (or HF_HOME) to a cache that holds it")
