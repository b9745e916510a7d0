"""Model directories on disk: duolm's own format, Hugging Face directories, training runs.

A duolm model directory is self-describing (DESIGN.md, "Checkpoints describe themselves"):

    config.json         {"format": "duolm", "format_version": 1, "family": "gpt2" | "bert",
                         "config": {...dataclass fields...}, "heads": true | false (bert only)}
    model.safetensors   the unwrapped module's state dict; a tied tensor is stored once
    vocab.json + merges.txt (+ special tokens json)   byte-level BPE, or
    vocab.txt + tokenizer_config.json                  WordPiece

`load` also reads Hugging Face directories (config.json with "model_type" gpt2 or bert, weights in
model.safetensors, sharded safetensors, or pytorch_model.bin) and training runs (a folder holding
checkpoint.json, which names the newest complete checkpoint folder). `save` writes either format.

Pickles are never trusted: a pytorch_model.bin is read with torch.load(weights_only=True), which
only rebuilds tensors and plain containers; a file that needs anything else is refused, never
retried unsafely. Every file is written to a temporary name in its destination folder, flushed and
renamed over the target (os.replace), so a crash leaves either the old file or the new one.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as _st_load_file
from safetensors.torch import save_file as _st_save_file

from duolm.convert import hf as _hf
from duolm.models import Bert, BertConfig, BertForPreTraining, GPT2, GPT2Config
from duolm.tokenizers import ByteLevelBPE, WordPiece, load_tokenizer

FORMAT = "duolm"
FORMAT_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_BIN = "pytorch_model.bin"
HF_BIN_INDEX = "pytorch_model.bin.index.json"
MANIFEST = "checkpoint.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# HF architectures we read, per model_type, and what they become.
HF_ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "bert": ("BertModel", "BertForPreTraining", "BertForMaskedLM"),
}
# The only tensors that may be absent from a BERT checkpoint: HF's BertForMaskedLM (and BertModel
# saved with add_pooling_layer=False) has no pooler and no NSP head. They are initialised fresh.
_BERT_OPTIONAL = re.compile(r"^(bert\.)?pool\.|^nsp\.")


# --- load --------------------------------------------------------------------------------------

def load(path, device="cpu"):
    """Load a model directory -> (model, tokenizer or None). The model is in eval mode on `device`.

    `path` is one of:
      * a duolm directory (config.json with "format": "duolm" + model.safetensors);
      * a Hugging Face directory: config.json with "model_type" "gpt2" (GPT2LMHeadModel or
        GPT2Model -> GPT2) or "bert" (BertModel -> Bert; BertForPreTraining or BertForMaskedLM ->
        BertForPreTraining), weights in model.safetensors, sharded safetensors, or
        pytorch_model.bin (read with torch.load(weights_only=True); never unsafely);
      * a training run directory holding checkpoint.json -> its newest complete checkpoint.
    A BertForMaskedLM directory has no pooler and no NSP head: those are initialised fresh (from a
    fixed seed, without touching the global RNG), so MLM logits and hidden states match the
    checkpoint while pooled / NSP outputs mean nothing until trained.

    The tokenizer is read from the same directory: vocab.json + merges.txt -> ByteLevelBPE,
    vocab.txt -> WordPiece, lower-casing as tokenizer_config.json's "do_lower_case" says; without
    that key, lower-casing is on exactly when the vocabulary holds no upper-case word piece (an
    uncased vocab such as bert-base-uncased's), off otherwise (a cased vocab).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model directory")
    if not path.is_dir():
        raise ValueError(f"{path}: is a file; duolm.load expects a model directory (config.json + weights)")
    if not (path / CONFIG).is_file() and (path / MANIFEST).is_file():
        path = latest_checkpoint(path)
    cfg = _read_json(path / CONFIG)
    if cfg.get("format") == FORMAT:
        model = _load_native(path, cfg)
    elif "model_type" in cfg:
        model = _load_hf(path, cfg)
    else:
        raise ValueError(
            f"{path / CONFIG}: neither a duolm config (\"format\": \"duolm\") nor a Hugging Face config "
            f"(\"model_type\"); supported: duolm directories and HF model_type "
            + ", ".join(sorted(HF_ARCHITECTURES)))
    model.to(torch.device(device)).eval()
    return model, load_tokenizer(path)


def latest_checkpoint(run_dir) -> Path:
    """The newest complete checkpoint folder of a training run, as named by RUN/checkpoint.json.

    checkpoint.json is {"latest": "ckpt-00000100", "step": 100, "checkpoints": [folder names, oldest
    first]}. It is written last, so what it names is complete; should a named folder be gone or lack
    its files, the next newest listed one is taken.
    """
    run_dir = Path(run_dir)
    manifest = _read_json(run_dir / MANIFEST)
    listed = manifest.get("checkpoints", [])
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise ValueError(f"{run_dir / MANIFEST}: \"checkpoints\" must be a list of folder names, got {listed!r}")
    names = ([manifest["latest"]] if manifest.get("latest") else []) + listed[::-1]
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{run_dir / MANIFEST}: checkpoint name {name!r} points outside the run directory")
        d = run_dir / name
        if (d / CONFIG).is_file() and (d / WEIGHTS).is_file():
            return d
    raise FileNotFoundError(
        f"{run_dir / MANIFEST}: names no complete checkpoint (tried {names or 'none'}; each needs "
        f"{CONFIG} and {WEIGHTS})")


def _load_native(path: Path, cfg: dict):
    version = cfg.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path / CONFIG}: format_version {version!r} is not supported; this duolm reads "
            f"format_version {FORMAT_VERSION} (upgrade duolm to read newer checkpoints)")
    family = cfg.get("family")
    params = cfg.get("config")
    if not isinstance(params, dict):
        raise ValueError(f"{path / CONFIG}: \"config\" must be an object of model config fields")
    if family == "gpt2":
        model = _build(GPT2, _make_config(GPT2Config, params, path / CONFIG))
    elif family == "bert":
        config = _make_config(BertConfig, params, path / CONFIG)
        model = _build(BertForPreTraining if cfg.get("heads", False) else Bert, config)
    else:
        raise ValueError(f"{path / CONFIG}: family {family!r} is not supported; supported: 'gpt2', 'bert'")
    weights = path / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: missing {WEIGHTS} (a duolm model directory holds {CONFIG} + {WEIGHTS})")
    _load_state(model, _read_safetensors(weights), str(weights), optional=None)
    return model


def _load_hf(path: Path, cfg: dict):
    model_type = cfg.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ValueError(
            f"{path / CONFIG}: Hugging Face model_type {model_type!r} is not supported; supported: "
            + "; ".join(f"{t} ({', '.join(a)})" for t, a in HF_ARCHITECTURES.items()))
    archs = cfg.get("architectures") or []
    unsupported = [a for a in archs if a not in HF_ARCHITECTURES[model_type]]
    if unsupported:
        raise ValueError(
            f"{path / CONFIG}: architecture {', '.join(unsupported)} is not supported for model_type "
            f"{model_type!r}; supported: {', '.join(HF_ARCHITECTURES[model_type])}")
    sd, source = _read_hf_weights(path)
    # The name tables drop HF's stale buffers (position_ids, causal-mask "attn.bias") and check
    # that the tied output tensors (lm_head, MLM decoder) equal the embedding they are tied to.
    if model_type == "gpt2":
        config = _config_from_hf(_hf.gpt2_config_from_hf, cfg, path)
        model = _build(GPT2, config)
        _load_state(model, _from_hf(_hf.gpt2_from_hf, sd, source), source, optional=None)
    else:
        config = _config_from_hf(_hf.bert_config_from_hf, cfg, path)
        ours, heads = _from_hf(_hf.bert_from_hf, sd, source)
        heads = heads or any(a in ("BertForPreTraining", "BertForMaskedLM") for a in archs)
        model = _build(BertForPreTraining if heads else Bert, config)
        _load_state(model, ours, source, optional=_BERT_OPTIONAL)
    return model


def _config_from_hf(fn, cfg: dict, path: Path):
    try:
        return fn(cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / CONFIG}: {e}") from None


def _from_hf(fn, sd: dict, source: str):
    try:
        return fn(sd)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _read_hf_weights(path: Path):
    """-> (HF state dict, name of the file(s) it came from)."""
    if (path / WEIGHTS).is_file():
        return _read_safetensors(path / WEIGHTS), str(path / WEIGHTS)
    if (path / HF_WEIGHTS_INDEX).is_file():
        return _read_sharded(path, HF_WEIGHTS_INDEX, _read_safetensors)
    if (path / HF_BIN).is_file():
        return _read_bin(path / HF_BIN), str(path / HF_BIN)
    if (path / HF_BIN_INDEX).is_file():
        return _read_sharded(path, HF_BIN_INDEX, _read_bin)
    present = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(
        f"{path}: no weights found; looked for {WEIGHTS}, {HF_WEIGHTS_INDEX}, {HF_BIN}, {HF_BIN_INDEX} "
        f"(TensorFlow/Flax weights are not supported); the folder holds: {', '.join(present)}")


def _read_sharded(path: Path, index_name: str, read):
    index = _read_json(path / index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / index_name}: no \"weight_map\" object")
    sd = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(f"{path / index_name}: shard name {shard!r} points outside the directory")
        if not shard_path.is_file():
            raise FileNotFoundError(f"{path / index_name}: lists shard {shard}, which is missing")
        sd.update(read(shard_path))
    return sd, str(path / index_name)


def _read_safetensors(file: Path) -> dict:
    try:
        return _st_load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"{file}: not a readable safetensors file ({e}); it may be truncated or corrupt — "
            "re-download or re-save it") from None


def _read_bin(file: Path) -> dict:
    """A pytorch_model.bin, read with weights_only=True: tensors and plain containers only."""
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is long advice on how to load unsafely; keep just its reason line
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in str(e).splitlines()]
        reason = next((ln for ln in lines if "Unpickler error" in ln or "Unsupported" in ln), None)
        reason = (reason or next((ln for ln in lines if ln), type(e).__name__)).split("Unpickler error:")[-1]
        reason = reason.split(". Please")[0].strip().rstrip(".")
        raise ValueError(
            f"{file}: refused — this pickle holds more than tensors, and unpickling it could run code "
            f"({reason}). duolm never unpickles untrusted objects; if you trust the file, convert it "
            "to model.safetensors with the tool that wrote it") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{file}: not a readable PyTorch weights file ({e}); it may be truncated or corrupt") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"{file}: expected a dict of name -> tensor, got {type(sd).__name__}")
    return sd


def _make_config(cls, params: dict, where: Path):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: invalid {cls.__name__}: {e}") from None


def _build(cls, config):
    # Parameters get overwritten by the checkpoint; a fixed seed makes the few that may be
    # initialised (BERT pooler / NSP) reproducible, and fork_rng leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config)


def _load_state(model, sd: dict, source: str, optional):
    """Copy `sd` into `model`, checking names and shapes. Keys that alias one tensor in the model
    (tied weights) may appear once; keys matching `optional` may be absent (they keep their init)."""
    expected = model.state_dict()
    aliases = _alias_groups(expected)
    unknown = sorted(set(sd) - set(expected))
    if unknown:
        raise ValueError(f"{source}: unexpected tensor(s) {unknown[:10]}{' ...' if len(unknown) > 10 else ''} "
                         f"for {type(model).__name__}")
    full = dict(sd)
    missing = []
    for k in expected:
        if k in full:
            continue
        present = [a for a in aliases.get(k, ()) if a in sd]
        if present:
            full[k] = sd[present[0]]
        elif optional is not None and optional.search(k):
            full[k] = expected[k]
        else:
            missing.append(k)
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                         f"for {type(model).__name__}")
    for k, v in full.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, the config needs "
                             f"{tuple(expected[k].shape)}")
        if not (v.is_floating_point() or v.dtype == expected[k].dtype):
            raise ValueError(f"{source}: tensor {k} has dtype {v.dtype}, expected {expected[k].dtype}")
    model.load_state_dict(full, strict=True)


def _alias_groups(sd: dict) -> dict:
    """name -> other names that are the very same tensor (same storage, offset, shape, stride)."""
    by_view = {}
    for k, v in sd.items():
        by_view.setdefault(_view_key(v), []).append(k)
    groups = {}
    for names in by_view.values():
        if len(names) > 1:
            for k in names:
                groups[k] = [n for n in names if n != k]
    return groups


def _view_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


# --- save --------------------------------------------------------------------------------------

def save(model, path, tokenizer=None, format="duolm"):
    """Save `model` (GPT2, Bert or BertForPreTraining) and optionally its tokenizer into directory `path`.

    format="duolm": config.json + model.safetensors + the tokenizer's files (see the module doc).
    format="hf": a directory transformers loads: config.json (GPT2LMHeadModel, BertModel, or
    BertForPreTraining when the model has heads), model.safetensors with HF tensor names (tied
    output weights stored once, as transformers does), and the tokenizer's files plus a
    tokenizer_config.json that names the HF tokenizer class.
    Each file is written atomically; config.json is written last. Returns the directory's Path.
    """
    if format not in ("duolm", "hf"):
        raise ValueError(f"format must be 'duolm' or 'hf', got {format!r}")
    model = _unwrap(model)
    family, heads = _family(model)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach() for k, v in model.state_dict().items()}  # to CPU only after ties are found
    if format == "duolm":
        config = {"format": FORMAT, "format_version": FORMAT_VERSION, "family": family,
                  "config": asdict(model.config)}
        if family == "bert":
            config["heads"] = heads
        _save_safetensors(sd, path / WEIGHTS)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, path)
        _write_json(path / CONFIG, config)
        return path
    if family == "gpt2":
        hf_sd = _hf.gpt2_to_hf(sd)
        config = _hf.gpt2_config_to_hf(model.config)
    else:
        hf_sd = _hf.bert_to_hf(sd)
        config = _hf.bert_config_to_hf(model.config, heads)
    _save_safetensors(hf_sd, path / WEIGHTS)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)
        _write_json(path / TOKENIZER_CONFIG, _hf_tokenizer_config(tokenizer, path, model.config))
    _write_json(path / CONFIG, config)
    return path


def _unwrap(model):
    # DDP / FSDP(use_orig_params) wrap in .module; torch.compile in ._orig_mod.
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _family(model):
    if isinstance(model, GPT2):
        return "gpt2", False
    if isinstance(model, BertForPreTraining):
        return "bert", True
    if isinstance(model, Bert):
        return "bert", False
    raise ValueError(f"cannot save a {type(model).__name__}; duolm.save takes GPT2, Bert or BertForPreTraining")


def _save_safetensors(sd: dict, file: Path):
    """Tied tensors are stored once (safetensors refuses shared storage): of each group of names for
    one tensor, the first that is not HF's tied output name (lm_head.weight, the MLM decoder's) is
    kept, as transformers itself writes them. Other storage sharing is cloned."""
    groups = {}
    for k, v in sd.items():
        groups.setdefault(_view_key(v), []).append(k)
    out = {}
    for names in groups.values():
        keep = min(names, key=lambda n: (n in _hf.HF_TIED_KEYS, names.index(n)))
        out[keep] = sd[keep]
    storages = {}
    for k, v in out.items():
        storages.setdefault((v.device, v.untyped_storage().data_ptr()), []).append(k)
    for names in storages.values():
        for k in names[1:] if len(names) > 1 else ():
            out[k] = out[k].clone()
    out = {k: v.to("cpu").contiguous() for k, v in out.items()}
    out = {k: out[k] for k in sorted(out)}
    _atomic(file, lambda tmp: _st_save_file(out, tmp, metadata={"format": "pt"}))


def _save_tokenizer(tokenizer, path: Path):
    if not isinstance(tokenizer, (ByteLevelBPE, WordPiece)):
        raise ValueError(f"cannot save a {type(tokenizer).__name__} tokenizer; expected ByteLevelBPE or WordPiece")
    # The tokenizer writes into a scratch folder beside the target; each file is then renamed in.
    with tempfile.TemporaryDirectory(dir=path, prefix=".tok-") as tmp:
        tokenizer.save(tmp)
        for f in sorted(Path(tmp).iterdir()):
            os.replace(f, path / f.name)


def _hf_tokenizer_config(tokenizer, path: Path, config) -> dict:
    """tokenizer_config.json that transformers' AutoTokenizer understands, keeping what the
    tokenizer itself wrote there (e.g. WordPiece's do_lower_case)."""
    d = _read_json(path / TOKENIZER_CONFIG) if (path / TOKENIZER_CONFIG).is_file() else {}
    d["model_max_length"] = config.block_size
    if isinstance(tokenizer, WordPiece):
        d.update(tokenizer_class="BertTokenizer", do_lower_case=bool(tokenizer.lowercase),
                 unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    else:
        d["tokenizer_class"] = "GPT2Tokenizer"
        d.setdefault("add_prefix_space", False)
        if tokenizer.eot_id is not None:
            d.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    return d


# --- small file helpers ------------------------------------------------------------------------

def _atomic(file: Path, write):
    """Run write(tmp_name) for a temp file in file's folder, fsync it, rename it over `file`."""
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()


def _write_json(file: Path, obj):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    _atomic(file, write)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing (a model directory holds {CONFIG} and its weights)")
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(obj).__name__}")
    return obj
