"""Models by name from the local Hugging Face cache, offline: resolution in a cache tree laid out as the
hub lays it out (blobs, symlinked snapshots, refs), checked against huggingface_hub itself."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import duolm
from duolm import cli, hub

huggingface_hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

COMMIT = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
OTHER = "11c5a3d5811f50298f278a704980280950aedb10"


def _put(cache: Path, repo_id: str, files: dict, commit=COMMIT, ref="main") -> Path:
    """Store `files` (name -> bytes) as huggingface_hub does: content in blobs/, the snapshot
    folder of symlinks into it, and refs/<ref> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _reference(cache: Path, repo_id: str, revision="main") -> Path:
    return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))


@pytest.mark.parametrize("repo_id,name", [("openai-community/gpt2", "gpt2"), ("gpt2", "gpt2"),
                                          ("google-bert/bert-base-uncased", "bert-base-uncased"),
                                          ("openai-community/gpt2-medium", "openai-community/gpt2-medium")])
def test_resolve_finds_the_snapshot_huggingface_hub_finds(tmp_path, repo_id, name):
    snapshot = _put(tmp_path, repo_id, {"config.json": b"{}"})
    got = hub.resolve(name, {"HF_HUB_CACHE": str(tmp_path)})
    assert got == snapshot == _reference(tmp_path, repo_id)
    assert (got / "config.json").is_symlink() and (got / "config.json").read_bytes() == b"{}"


def test_revision_by_tag_or_commit(tmp_path):
    _put(tmp_path, "openai-community/gpt2", {"config.json": b"{}"})
    old = _put(tmp_path, "openai-community/gpt2", {"config.json": b"{\"old\": 1}"}, commit=OTHER, ref="v1.0")
    env = {"HF_HUB_CACHE": str(tmp_path)}
    assert hub.resolve("gpt2", env, revision="v1.0") == old == _reference(tmp_path, "openai-community/gpt2", "v1.0")
    assert hub.resolve("gpt2", env, revision=OTHER) == old == _reference(tmp_path, "openai-community/gpt2", OTHER)


ENVS = [{}, {"HF_HOME": "{t}/home"}, {"XDG_CACHE_HOME": "{t}/xdg"}, {"HF_HOME": "{t}/home", "XDG_CACHE_HOME": "{t}/x"},
        {"HUGGINGFACE_HUB_CACHE": "{t}/legacy", "HF_HOME": "{t}/home"},
        {"HF_HUB_CACHE": "{t}/new", "HUGGINGFACE_HUB_CACHE": "{t}/legacy", "HF_HOME": "{t}/home"}]


@pytest.mark.parametrize("env", ENVS)
def test_cache_dir_follows_huggingface_hubs_order(tmp_path, env):
    env = {k: v.format(t=tmp_path) for k, v in env.items()}
    base = {k: v for k, v in os.environ.items()
            if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    run_env = {**base, **env}
    out = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                         env=run_env, capture_output=True, text=True, check=True).stdout.strip()
    assert hub.cache_dir(run_env) == Path(out)


def test_a_miss_names_every_path_tried_and_how_to_fill_the_cache(tmp_path):
    _put(tmp_path, "openai-community/gpt2", {"config.json": b"{}"}, ref=None)   # no refs/main
    env = {"HF_HUB_CACHE": str(tmp_path)}
    with pytest.raises(FileNotFoundError) as e:
        hub.resolve("gpt2", env)
    msg = str(e.value)
    for tried in (tmp_path / "models--gpt2", tmp_path / "models--openai-community--gpt2" / "refs" / "main",
                  tmp_path / "models--google-bert--gpt2"):
        assert str(tried) in msg
    assert "huggingface-cli download gpt2" in msg and "models--gpt2" in msg and "HF_HUB_CACHE" in msg
    with pytest.raises(FileNotFoundError, match="local_files_only|outgoing traffic|cannot find"):
        _reference(tmp_path, "openai-community/gpt2")   # huggingface_hub does not find it either


def test_a_ref_to_a_missing_snapshot_and_a_corrupt_ref(tmp_path):
    snapshot = _put(tmp_path, "openai-community/gpt2", {"config.json": b"{}"})
    (snapshot / "config.json").unlink()
    snapshot.rmdir()
    with pytest.raises(FileNotFoundError, match=str(snapshot)):
        hub.resolve("openai-community/gpt2", {"HF_HUB_CACHE": str(tmp_path)})
    (tmp_path / "models--openai-community--gpt2" / "refs" / "main").write_text("../../../../etc")
    with pytest.raises(ValueError, match=r"refs/main: expected a 40-digit commit hash"):
        hub.resolve("openai-community/gpt2", {"HF_HUB_CACHE": str(tmp_path)})


@pytest.mark.parametrize("name", ["../gpt2", "a/b/c", "/abs", "gpt2--x", "", "x" * 200, "ok name", "gpt2\n", "gpt2é"])
def test_names_that_are_not_repo_ids(name):
    assert not hub.is_repo_id(name)
    with pytest.raises(ValueError, match="not a Hugging Face model name"):
        hub.resolve(name, {})


def test_bad_revision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="revision"):
        hub.resolve("gpt2", {"HF_HUB_CACHE": str(tmp_path)}, revision="../../x")


# --- duolm.load and the CLI by name -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cached_gpt2(tmp_path_factory):
    """A tiny random GPT-2 saved by transformers, stored in a hub-layout cache as openai-community/gpt2."""
    tmp = tmp_path_factory.mktemp("hub")
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp / "saved")
    files = {f.name: f.read_bytes() for f in (tmp / "saved").iterdir()}
    _put(tmp / "cache", "openai-community/gpt2", files)
    return tmp / "cache", model


def test_load_by_name_from_the_cache(cached_gpt2):
    cache, ref = cached_gpt2
    model, tok = duolm.load("gpt2", env={"HF_HUB_CACHE": str(cache)})
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx).logits, atol=1e-5, rtol=0)
    assert tok is None   # the snapshot holds no tokenizer files


def test_load_of_a_name_in_no_cache_says_both(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"gpt2-xl: no such model directory; as a model name: .*"
                                                r"huggingface-cli download gpt2-xl"):
        duolm.load("gpt2-xl", env={"HF_HUB_CACHE": str(tmp_path)})


def test_cli_takes_names(cached_gpt2, tmp_path, monkeypatch):
    cache, _ = cached_gpt2
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert cli.main(["convert", "openai-community/gpt2", str(tmp_path / "out")]) in (0, None)
    assert (tmp_path / "out" / "model.safetensors").is_file()
