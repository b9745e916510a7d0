"""Model directories on disk: duolm's own format, Hugging Face directories, training runs.

A duolm model directory is self-describing (DESIGN.md, "Checkpoints describe themselves"):

    config.json         {"format": "duolm", "format_version": 1, "family": "gpt2" | "bert",
                         "config": {...dataclass fields...}, "heads": true | false (bert only),
                         "head": {...HeadConfig: kind, labels, ...} (fine-tuned models only)}
    model.safetensors   the unwrapped module's state dict; a tied tensor is stored once
    or shards/          the same, sharded (torch.distributed.checkpoint, as every process of an FSDP run writes its
                        part; duolm.dcp), beside the optimizer's state; read here whole in one process
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
import struct
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as _st_load_file
from safetensors.torch import save_file as _st_save_file

from duolm import hub, runs
from duolm.convert import hf as _hf
from duolm.convert import tf as _tf
from duolm.convert.st import Pooling, write_pooling
from duolm.fileio import atomic_write, read_json, write_json
from duolm.models import Bert, BertConfig, BertForPreTraining, GPT2, GPT2Config
from duolm.models.heads import HEAD_MODELS, MAX_LENGTH, SPAN_MAX_LENGTH, BertForEmbedding, HeadConfig, head_model
from duolm.precision import SWAPPED
from duolm.tokenizers import ByteLevelBPE, WordPiece, load_tokenizer
from duolm.tokenizers.files import ENDOFTEXT

FORMAT = "duolm"
FORMAT_VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SHARDS = "shards"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_BIN = "pytorch_model.bin"
HF_BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Keys of a BERT checkpoint that may be absent: HF's BertForMaskedLM (and BertModel saved with
# add_pooling_layer=False) has no pooler and no NSP head. They are initialised fresh.
_BERT_OPTIONAL = ("pool.", "bert.pool.", "nsp.")
# Bounds on what a file may declare before anything is allocated.
MAX_HEADER_BYTES = 100 << 20
MAX_TENSORS = 100_000


# --- load --------------------------------------------------------------------------------------

def load(path, device="cpu", env=os.environ):
    """Load a model directory -> (model, tokenizer or None). The model is in eval mode on `device`.

    `path` is one of:
      * a duolm directory (config.json with "format": "duolm" + model.safetensors);
      * a Hugging Face directory: config.json with "model_type" "gpt2" (GPT2LMHeadModel or
        GPT2Model -> GPT2) or "bert" (BertModel -> Bert; BertForPreTraining or BertForMaskedLM ->
        BertForPreTraining), weights in model.safetensors, sharded safetensors, or
        pytorch_model.bin (read with torch.load(weights_only=True); never unsafely); a fine-tuned
        BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering or
        GPT2ForSequenceClassification -> the head model of duolm.models.heads, labels from id2label;
      * a training run directory holding checkpoint.json -> its best/ model when it keeps one (fine-tuning
        selects on dev), else its newest complete checkpoint; a folder of fine-tuning runs -> its best/;
      * an original TensorFlow release folder: OpenAI's GPT-2 (hparams.json + model.ckpt.*) or
        Google's BERT (bert_config.json + bert_model.ckpt.*), read without TensorFlow;
      * a model name ("gpt2", "openai-community/gpt2-medium", "bert-base-uncased") already in the
        local Hugging Face cache that `env` points to (HF_HUB_CACHE / HF_HOME); never downloaded.
    A BertForMaskedLM directory has no pooler and no NSP head: those are initialised fresh (from a
    fixed seed, without touching the global RNG), so MLM logits and hidden states match the
    checkpoint while pooled / NSP outputs mean nothing until trained.

    The tokenizer is read from the same directory: vocab.json + merges.txt (or OpenAI's
    encoder.json + vocab.bpe) -> ByteLevelBPE, vocab.txt -> WordPiece, lower-casing as
    tokenizer_config.json's "do_lower_case" says; without that key, lower-casing is on exactly when
    the vocabulary holds no upper-case word piece (an uncased vocab such as bert-base-uncased's),
    off otherwise (a cased vocab).
    """
    path = Path(path)
    if not path.exists() and hub.is_repo_id(str(path)):
        try:
            path = hub.resolve(str(path), env)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{path}: no such model directory; as a model name: {e}") from None
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model directory")
    if not path.is_dir():
        raise ValueError(f"{path}: is a file; duolm.load expects a model directory (config.json + weights)")
    if not (path / CONFIG).is_file() and (path / "best" / CONFIG).is_file():
        path = path / "best"
    elif not (path / CONFIG).is_file() and runs.is_run(path):
        path = runs.latest_checkpoint(path)
    tf = not (path / CONFIG).is_file() and _tf.is_tf_dir(path)
    cfg = {} if tf else read_json(path / CONFIG, f"{CONFIG} (a model directory holds {CONFIG} and its weights)")
    if tf:
        model = _load_tf(path)
    elif cfg.get("format") == FORMAT:
        model = _load_native(path, cfg)
    elif "model_type" in cfg:
        model = _load_hf(path, cfg)
    else:
        raise ValueError(f"{path / CONFIG}: neither a duolm config (\"format\": \"duolm\") nor a Hugging Face "
                         f"config (\"model_type\"); duolm reads duolm directories and HF {_hf.SUPPORTED}")
    model.to(torch.device(device)).eval()
    return model, load_tokenizer(path, required=False)


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
    if "head" in cfg and family in ("gpt2", "bert"):
        head = _make_config(HeadConfig, cfg["head"] if isinstance(cfg["head"], dict) else {}, path / CONFIG)
        config = _make_config(GPT2Config if family == "gpt2" else BertConfig, params, path / CONFIG)
        make = lambda c: head_model(family, c, head)                                  # noqa: E731
    elif family == "gpt2":
        make, config = GPT2, _make_config(GPT2Config, params, path / CONFIG)
    elif family == "bert":
        config = _make_config(BertConfig, params, path / CONFIG)
        make = BertForPreTraining if cfg.get("heads", False) else Bert
    else:
        raise ValueError(f"{path / CONFIG}: family {family!r} is not supported; supported: 'gpt2', 'bert'")
    weights = path / WEIGHTS
    if weights.is_file():
        sd = _read_safetensors(weights)
        model = _build(make, config, sd)
        _load_state(model, sd, str(weights))
    elif (path / SHARDS).is_dir():
        model = _build(make, config)
        from duolm import dcp                         # torch.distributed.checkpoint: ~1 s to import, paid here only
        state = {"model": model.state_dict()}          # the model's own tensors, filled in place
        dcp.read(state, path / SHARDS)
    else:
        raise FileNotFoundError(f"{path}: missing {WEIGHTS} (a duolm model directory holds {CONFIG} + {WEIGHTS}, "
                                f"or {SHARDS}/)")
    return model


def _load_hf(path: Path, cfg: dict):
    # The configs are checked first (model_type, architectures, unsupported options); the name tables
    # drop HF's stale buffers and check that tied output tensors equal the embedding they are tied to.
    sd, source = None, None
    arch = (cfg.get("architectures") or [""])[0]
    if arch in _hf.HEAD_LAYERS:
        return _load_hf_head(path, cfg, arch)
    if cfg.get("model_type") == "gpt2":
        config = _config_from_hf(_hf.gpt2_config_from_hf, cfg, path)
        sd, source = _read_hf_weights(path)
        ours = _from_hf(_hf.gpt2_from_hf, sd, source)
        model = _build(GPT2, config, ours)
        _load_state(model, ours, source)
        return model
    config = _config_from_hf(_hf.bert_config_from_hf, cfg, path)
    sd, source = _read_hf_weights(path)
    ours, heads = _from_hf(_hf.bert_from_hf, sd, source)
    heads = heads or any(a in ("BertForPreTraining", "BertForMaskedLM") for a in cfg.get("architectures") or [])
    model = _build(BertForPreTraining if heads else Bert, config, ours)
    _load_state(model, ours, source, optional=_BERT_OPTIONAL)
    return model


def _load_hf_head(path: Path, cfg: dict, arch: str):
    """A transformers *ForSequenceClassification / *ForTokenClassification / BertForQuestionAnswering directory."""
    family = "gpt2" if arch.startswith("GPT2") else "bert"
    config = _config_from_hf(_hf.gpt2_config_from_hf if family == "gpt2" else _hf.bert_config_from_hf, cfg, path)
    kind, labels = _hf.head_kind_from_hf(cfg)
    length = SPAN_MAX_LENGTH if kind == "span" else MAX_LENGTH
    head = HeadConfig(kind, labels, max_length=min(config.block_size, length))
    sd, source = _read_hf_weights(path)
    ours = _from_hf(lambda d: _hf.head_from_hf(arch, d), sd, source)
    model = _build(lambda c: head_model(family, c, head), config, ours)
    _load_state(model, ours, source, optional=("bert.pool.",))
    return model


def _load_tf(path: Path):
    """OpenAI's GPT-2 or Google's BERT release folder (see duolm.convert.tf)."""
    if (path / "hparams.json").is_file():
        config, sd = _tf.gpt2_from_tf(path)
        model = _build(GPT2, config, sd)
    else:
        config, sd, heads = _tf.bert_from_tf(path)
        model = _build(BertForPreTraining if heads else Bert, config, sd)
    _load_state(model, sd, f"{_tf.find_prefix(path)}.index")
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
    index = read_json(path / index_name)
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


def check_safetensors_header(file: Path) -> None:
    """Reject what the safetensors format forbids before the library reads it: a header longer than the
    file or than MAX_HEADER_BYTES, more than MAX_TENSORS entries, and duplicate keys (safetensors keeps
    the last, another reader the first: one file would mean two models)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: truncated or corrupt safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{file}: safetensors header length {n} runs past the file ({size} bytes) "
                             f"or the {MAX_HEADER_BYTES}-byte limit; the file is truncated or corrupt")
        raw = f.read(n)

    def no_duplicates(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"{file}: safetensors header names tensor {k!r} twice; refusing an ambiguous file")
            seen.add(k)
        if len(pairs) > MAX_TENSORS:
            raise ValueError(f"{file}: safetensors header lists {len(pairs)} entries, over the limit {MAX_TENSORS}")
        return dict(pairs)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: safetensors header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: safetensors header is not a JSON object; the file is corrupt")


def _read_safetensors(file: Path) -> dict:
    check_safetensors_header(file)
    try:
        return _st_load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); it may be truncated or corrupt — "
                         "re-download or re-save it") from None


def _read_bin(file: Path) -> dict:
    """A pytorch_model.bin, read with weights_only=True: tensors and plain containers only."""
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{file}: refused as unsafe: this pickle holds more than tensors, and unpickling it "
                         "could run code. duolm never unpickles untrusted objects; if you trust the file, "
                         "convert it to model.safetensors with the tool that wrote it") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{file}: not a readable PyTorch weights file ({type(e).__name__}); "
                         "it may be truncated or corrupt") from None
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


def _build(cls, config, keys=()):
    """cls(config), to be filled from a checkpoint holding the tensors named `keys`. When those are all of the
    model's, it is built without initialising anything (on the meta device, then allocated: random init of
    weights that are overwritten costs a noticeable share of loading a model); otherwise initialised from a fixed
    seed, so that the few tensors a checkpoint may lack (BERT's pooler / NSP) are reproducible, fork_rng leaving
    the caller's RNG untouched."""
    with torch.device("meta"):
        model = cls(config)
    if set(model.state_dict()) <= set(keys):
        return model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config)


def _load_state(model, sd: dict, source: str, optional=()):
    """Copy `sd` into `model`, checking names, shapes and dtypes; keys starting with one of `optional`
    may be absent (they keep their init)."""
    expected = model.state_dict()
    unknown = sorted(set(sd) - set(expected))
    missing = [k for k in expected if k not in sd and not k.startswith(tuple(optional))]
    for what, keys in (("unexpected", unknown), ("missing", missing)):
        if keys:
            raise ValueError(f"{source}: {what} tensor(s) {keys[:10]}{' ...' if len(keys) > 10 else ''} "
                             f"for {type(model).__name__}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, the config needs "
                             f"{tuple(expected[k].shape)}")
        if not (v.is_floating_point() or v.dtype == expected[k].dtype):
            raise ValueError(f"{source}: tensor {k} has dtype {v.dtype}, expected {expected[k].dtype}")
    model.load_state_dict({**expected, **sd}, strict=True)


# --- save --------------------------------------------------------------------------------------

def save(model, path, tokenizer=None, format="duolm", state: dict | None = None, weights: bool = True,
         cache: bool = True):
    """Save `model` (GPT2, Bert, BertForPreTraining or a head model of duolm.models.heads) and optionally its
    tokenizer into directory `path`; `state`: the state dict to write instead of model.state_dict() (a sharded
    model's, gathered whole: duolm.train.parallel.model_state); weights=False: all but the weights (a sharded
    checkpoint's, whose processes write them into SHARDS/: duolm.train.parallel.save_shards).

    format="duolm": config.json + model.safetensors + the tokenizer's files (see the module doc).
    format="hf": a directory transformers loads: config.json (GPT2LMHeadModel, BertModel, or
    BertForPreTraining when the model has heads; a head model as BertForSequenceClassification,
    GPT2ForSequenceClassification, ... with id2label / label2id; an embedding model as BertModel with
    sentence-transformers' modules.json and pooling files), model.safetensors with HF tensor names (tied
    output weights stored once, as transformers does), and the tokenizer's files plus a
    tokenizer_config.json that names the HF tokenizer class.
    format="onnx": the HF directory with onnx/model.onnx (duolm.convert.onnx: graphs named as optimum's, checked in
    ONNX Runtime against the model; cache: a GPT2's graph takes and returns the KV cache) in place of the weights.
    Each file is written atomically; config.json is written last. Returns the directory's Path.
    """
    if format not in ("duolm", "hf", "onnx"):
        raise ValueError(f"format must be 'duolm', 'hf' or 'onnx', got {format!r}")
    if not weights and format != "duolm":
        raise ValueError("weights=False writes a sharded checkpoint's files, in the duolm format only")
    model = _unwrap(model)
    if any(isinstance(m, SWAPPED) for m in model.modules()):
        raise ValueError("the model is quantized for inference (duolm.precision.quantize): its linears hold the "
                         "weights in the form they run in; save the model before quantizing it")
    family, heads = _family(model)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach() for k, v in (model.state_dict() if state is None else state).items()} if weights else {}
    # (to CPU only after ties are found)
    if format == "duolm":
        config = {"format": FORMAT, "format_version": FORMAT_VERSION, "family": family,
                  "config": asdict(model.config)}
        if family == "bert":
            config["heads"] = heads
        if isinstance(model, HEAD_MODELS):
            config["head"] = asdict(model.head)
        if weights:
            _save_safetensors(sd, path / WEIGHTS)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, path)
        write_json(path / CONFIG, config)
        return path
    embedding = isinstance(model, BertForEmbedding)         # a BertModel with sentence-transformers' pooling files
    if embedding:
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
    if isinstance(model, HEAD_MODELS) and not embedding:
        arch = _hf.HEAD_ARCHITECTURES[family, model.head.kind]
        hf_sd = _hf.head_to_hf(arch, sd)
        config = _hf.gpt2_config_to_hf(model.config) if family == "gpt2" else _hf.bert_config_to_hf(model.config, False)
        # GPT-2 pads with <|endoftext|>
        pad = tokenizer.special_tokens.get(ENDOFTEXT) if family == "gpt2" and tokenizer is not None else None
        config.update(architectures=[arch], **_hf.head_config_to_hf(model.head, pad))
    elif family == "gpt2":
        hf_sd = _hf.gpt2_to_hf(sd)
        config = _hf.gpt2_config_to_hf(model.config)
    else:
        hf_sd = _hf.bert_to_hf(sd)
        config = _hf.bert_config_to_hf(model.config, heads)
    if format == "onnx":
        from duolm.convert import onnx                         # onnx, onnxruntime: the `onnx` extra, this path only
        onnx.export(model, path, cache)
    else:
        _save_safetensors(hf_sd, path / WEIGHTS)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)
        written = read_json(path / TOKENIZER_CONFIG) if (path / TOKENIZER_CONFIG).is_file() else {}
        write_json(path / TOKENIZER_CONFIG, hf_tokenizer_config(tokenizer, model.config.block_size, written))
    if embedding:
        write_pooling(path, Pooling(model.head.pooling, model.head.normalize, model.head.max_length), model.config.n_embd)
    write_json(path / CONFIG, config)
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


def _family(model) -> tuple[str, bool]:
    """(the family, whether the MLM and NSP heads are saved) of a model save() takes."""
    if not isinstance(model, (GPT2, Bert, BertForPreTraining, *HEAD_MODELS)):
        raise ValueError(f"cannot save a {type(model).__name__}; duolm.save takes GPT2, Bert, BertForPreTraining or a "
                         f"fine-tuned head model ({', '.join(c.__name__ for c in HEAD_MODELS)})")
    return model.config.family, isinstance(model, BertForPreTraining)


def _save_safetensors(sd: dict, file: Path):
    """HF's tied output names (lm_head.weight, the MLM decoder's) are left out, as transformers writes
    them: it re-ties them on load, and safetensors refuses two names for one tensor."""
    out = {k: sd[k].to("cpu").contiguous() for k in sorted(sd) if k not in _hf.HF_TIED_KEYS}

    # a full disk raises safetensors' own SafetensorError; atomic_write finds the OS's reason in it
    atomic_write(file, lambda tmp: _st_save_file(out, tmp, metadata={"format": "pt"}))


def _save_tokenizer(tokenizer, path: Path):
    if not isinstance(tokenizer, (ByteLevelBPE, WordPiece)):
        raise ValueError(f"cannot save a {type(tokenizer).__name__} tokenizer; expected ByteLevelBPE or WordPiece")
    tokenizer.save(path)      # every file written atomically, all of them before any is replaced


def hf_tokenizer_config(tokenizer, block_size: int, written: dict | None = None) -> dict:
    """tokenizer_config.json that transformers' AutoTokenizer understands (its class, special tokens and
    model_max_length = block_size), keeping what the tokenizer itself wrote there (`written`, e.g.
    WordPiece's do_lower_case). The HF export writes it; `duolm serve` answers it at GET /tokenizer_info."""
    d = dict(written or {})
    d["model_max_length"] = block_size
    if isinstance(tokenizer, WordPiece):
        d.update(tokenizer_class="BertTokenizer", do_lower_case=bool(tokenizer.lowercase),
                 unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    else:
        d["tokenizer_class"] = "GPT2Tokenizer"
        d.setdefault("add_prefix_space", False)
        if tokenizer.eot_id is not None:
            d.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    return d


