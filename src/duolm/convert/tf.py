"""TensorFlow checkpoints without TensorFlow: the tensor-bundle format, and the names of OpenAI's
GPT-2 and Google's BERT releases.

A checkpoint PREFIX (e.g. models/124M/model.ckpt) is two kinds of files:

  PREFIX.index                  a LevelDB-style sorted table (SSTable). Key "" holds the
                                BundleHeaderProto (number of shards, endianness); every other key
                                is a tensor name whose value is a BundleEntryProto: dtype, shape,
                                shard id, byte offset and size, and the masked CRC-32C of the bytes.
  PREFIX.data-0000i-of-0000N    the tensors' raw little-endian bytes, back to back.

The few protobuf fields needed are decoded by hand (varints, length-delimited fields); tensors
are read lazily from np.memmap views, and each one's checksum is verified when it is read, so a
1.5B checkpoint never needs twice its size in memory. Every malformed file gives a ValueError
naming the file (and the tensor); a missing shard gives FileNotFoundError. The checksums are computed
by google-crc32c (convert/crc32c.py), the extra `duolm[tf]`.

The name tables at the end map the releases' names onto our state dicts, in the style of
convert/hf.py: every tensor is used exactly once or is an optimizer slot, and every shape is
checked against the config (hparams.json / bert_config.json).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from duolm.convert.crc32c import crc32c, unmask
from duolm.convert.hf import _expand, _meta_state, bert_config_from_hf
from duolm.fileio import read_json
from duolm.models.bert import Bert, BertConfig, BertForPreTraining
from duolm.models.gpt2 import GPT2, GPT2Config

# ---------------------------------------------------------------------------------------------
# Protobuf wire format and the SSTable (both only as far as checkpoints use them)

def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError(f"{where}: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _fields(buf: bytes, where: str) -> dict[int, list]:
    """A protobuf message -> {field number: [values]}: ints for varint/fixed, bytes for messages."""
    out, pos = {}, 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, where)
        elif wire in (1, 5):   # fixed64 / fixed32, little-endian
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise ValueError(f"{where}: truncated fixed-width field {field}")
            value, pos = int.from_bytes(buf[pos:pos + size], "little"), pos + size
        elif wire == 2:        # length-delimited: a nested message here
            size, pos = _varint(buf, pos, where)
            if pos + size > len(buf):
                raise ValueError(f"{where}: field {field} runs past the end of its message")
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"{where}: unsupported protobuf wire type {wire} (field {field})")
        out.setdefault(field, []).append(value)
    return out


def _int64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v   # protobuf int64 is two's complement in a varint


_FOOTER = 48                        # two block handles (varints, zero-padded to 40) + magic
_MAGIC = 0xDB4775248B80FB57         # LevelDB's table magic, which TF's table keeps


def _block(buf: bytes, handle: bytes, where: str) -> bytes:
    """A block's contents, checked: each block is followed by a type byte (0 = not compressed) and
    the masked crc32c of contents + type byte."""
    offset, pos = _varint(handle, 0, where)
    size, _ = _varint(handle, pos, where)
    if offset + size + 5 > len(buf):
        raise ValueError(f"{where}: a block at offset {offset} of {size} bytes runs past the end of the file "
                         f"({len(buf)} bytes); the file is truncated")
    contents, kind = buf[offset:offset + size], buf[offset + size]
    stored = unmask(int.from_bytes(buf[offset + size + 1:offset + size + 5], "little"))
    if crc32c(buf[offset:offset + size + 1]) != stored:
        raise ValueError(f"{where}: block at offset {offset}: checksum mismatch; the file is corrupt")
    if kind != 0:
        raise ValueError(f"{where}: block at offset {offset} is compressed (type {kind}); not supported")
    return contents


def _entries(block: bytes, where: str):
    """(key, value) pairs of a block. Keys are prefix-compressed: each entry is varints shared,
    unshared, value length, then the unshared key bytes and the value; a trailing array of uint32
    restart offsets (and its length) follows the entries."""
    if len(block) < 4:
        raise ValueError(f"{where}: block of {len(block)} bytes is too short")
    n_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 - 4 * n_restarts
    if end < 0:
        raise ValueError(f"{where}: block restart array ({n_restarts} entries) is larger than the block")
    key, pos = b"", 0
    while pos < end:
        shared, pos = _varint(block, pos, where)
        unshared, pos = _varint(block, pos, where)
        value_len, pos = _varint(block, pos, where)
        if shared > len(key) or pos + unshared + value_len > end:
            raise ValueError(f"{where}: malformed block entry at byte {pos}")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + value_len]
        pos += value_len


def _read_table(file: Path) -> dict[bytes, bytes]:
    buf = file.read_bytes()
    where = str(file)
    if len(buf) < _FOOTER or int.from_bytes(buf[-8:], "little") != _MAGIC:
        raise ValueError(f"{where}: not a TensorFlow checkpoint index (no table footer); truncated or another format")
    footer = buf[-_FOOTER:-8]
    _, pos = _varint(footer, 0, where)            # metaindex handle: offset (unused by checkpoints)
    _, pos = _varint(footer, pos, where)          # ... and size
    table = {}
    for _, handle in _entries(_block(buf, footer[pos:], where), where):
        for key, value in _entries(_block(buf, handle, where), where):
            if key in table:
                raise ValueError(f"{where}: key {key!r} appears twice")
            table[key] = value
    return table


# ---------------------------------------------------------------------------------------------
# The tensor bundle: header, entries, lazily read tensors

# TF DataType enum -> numpy dtype (little-endian); bfloat16 (14), strings (7) and resources are absent
# from the releases and not read.
DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?", 17: "<u2",
          19: "<f2", 22: "<u4", 23: "<u8"}


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: shard number, byte range in it, and its masked crc32c."""
    dtype: np.dtype
    shape: tuple
    shard: int
    offset: int
    size: int
    crc: int


def _entry(name: str, value: bytes, where: str) -> Entry:
    where = f"{where}: tensor {name!r}"
    f = _fields(value, where)
    last = lambda n, default=0: f.get(n, [default])[-1]   # proto3: the last occurrence wins
    if 7 in f:
        raise ValueError(f"{where} is partitioned into slices; not supported")
    code = last(1)
    if code not in DTYPES:
        raise ValueError(f"{where}: TensorFlow dtype {code} is not supported (supported: float16/32/64, "
                         f"(u)int8-64, bool)")
    if not isinstance(last(2, b""), bytes):
        raise ValueError(f"{where}: malformed shape field")
    dims = _fields(last(2, b""), where).get(2, [])   # TensorShapeProto.dim, each Dim.size = field 1
    shape = tuple(_int64(_fields(d, where).get(1, [0])[-1]) if isinstance(d, bytes) else -1 for d in dims)
    e = Entry(np.dtype(DTYPES[code]), shape, last(3), _int64(last(4)), _int64(last(5)), last(6))
    if any(d < 0 for d in shape) or e.offset < 0:
        raise ValueError(f"{where}: negative dimension or offset (shape {list(shape)}, offset {e.offset})")
    if e.size != math.prod(shape) * e.dtype.itemsize:
        raise ValueError(f"{where}: {e.size} bytes do not hold a {np.dtype(e.dtype).name} tensor of shape "
                         f"{list(shape)}")
    return e


def data_file(prefix, shard: int, n_shards: int) -> Path:
    return Path(f"{prefix}.data-{shard:05d}-of-{n_shards:05d}")


class Checkpoint(Mapping):
    """name -> np.ndarray, read on access: a view of the memory-mapped shard, its crc32c verified.
    `entries` holds each tensor's dtype, shape and location without reading anything."""

    def __init__(self, prefix):
        self.prefix = Path(prefix)
        index = Path(f"{prefix}.index")
        table = _read_table(index)
        if b"" not in table:
            raise ValueError(f"{index}: no header entry; not a tensor bundle")
        header = _fields(table.pop(b""), f"{index}: header")
        n_shards, endian = header.get(1, [0])[-1], header.get(2, [0])[-1]
        if endian != 0:
            raise ValueError(f"{index}: big-endian checkpoints are not supported")
        if not 1 <= n_shards < 100000:
            raise ValueError(f"{index}: header says {n_shards} shards")
        self.n_shards = n_shards
        self.entries = {}
        for key, value in table.items():
            name = key.decode("utf-8", "backslashreplace")
            self.entries[name] = _entry(name, value, str(index))
        sizes = [self._shard_size(i) for i in range(n_shards)]
        for name, e in self.entries.items():
            if not 0 <= e.shard < n_shards:
                raise ValueError(f"{index}: tensor {name!r} is in shard {e.shard}, but there are {n_shards}")
            if e.offset + e.size > sizes[e.shard]:
                raise ValueError(
                    f"{data_file(prefix, e.shard, n_shards)}: tensor {name!r} (bytes {e.offset}..{e.offset + e.size}) "
                    f"runs past the end of the file ({sizes[e.shard]} bytes); the file is truncated")
        self._maps = {}

    def _shard_size(self, i: int) -> int:
        file = data_file(self.prefix, i, self.n_shards)
        if file.is_file():
            return file.stat().st_size
        others = sorted(p.name for p in self.prefix.parent.glob(f"{self.prefix.name}.data-*"))
        held = sorted(n for n, e in self.entries.items() if e.shard == i)
        if others:
            raise ValueError(f"{self.prefix}.index: says {self.n_shards} shards, but {file.name} is missing and "
                             f"the folder holds {others}: the index and data files are from different saves")
        raise FileNotFoundError(f"{file}: missing (an index without its data); it holds {len(held)} tensors, "
                                f"e.g. {held[:3]}")

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, name: str) -> np.ndarray:
        e = self.entries[name]
        file = data_file(self.prefix, e.shard, self.n_shards)
        if e.size == 0:
            raw = np.zeros(0, dtype=np.uint8)
        else:
            if e.shard not in self._maps:
                # copy-on-write: torch wants writable arrays; the file itself is never written
                self._maps[e.shard] = np.memmap(file, dtype=np.uint8, mode="c")
            raw = self._maps[e.shard][e.offset:e.offset + e.size]
        if crc32c(raw) != unmask(e.crc):
            raise ValueError(f"{file}: tensor {name!r}: checksum mismatch; the file is corrupt")
        if e.offset % e.dtype.itemsize:
            raw = raw.copy()   # numpy views need no alignment, but torch kernels prefer it
        return raw.view(e.dtype).reshape(e.shape)


def read_checkpoint(prefix) -> Checkpoint:
    """The tensors of checkpoint PREFIX (PREFIX.index + PREFIX.data-*), read lazily."""
    return Checkpoint(prefix)


# ---------------------------------------------------------------------------------------------
# Name tables: our key template ({i} = layer) -> the release's name, or a tuple of names that are
# concatenated along dim 0 (BERT's query/key/value -> our fused c_attn), as in convert/hf.py.

GPT2_TF_TABLE = {
    "wte.weight": "model/wte",
    "wpe.weight": "model/wpe",
    "h.{i}.ln_1.weight": "model/h{i}/ln_1/g",
    "h.{i}.ln_1.bias": "model/h{i}/ln_1/b",
    "h.{i}.attn.c_attn.weight": "model/h{i}/attn/c_attn/w",
    "h.{i}.attn.c_attn.bias": "model/h{i}/attn/c_attn/b",
    "h.{i}.attn.c_proj.weight": "model/h{i}/attn/c_proj/w",
    "h.{i}.attn.c_proj.bias": "model/h{i}/attn/c_proj/b",
    "h.{i}.ln_2.weight": "model/h{i}/ln_2/g",
    "h.{i}.ln_2.bias": "model/h{i}/ln_2/b",
    "h.{i}.mlp.c_fc.weight": "model/h{i}/mlp/c_fc/w",
    "h.{i}.mlp.c_fc.bias": "model/h{i}/mlp/c_fc/b",
    "h.{i}.mlp.c_proj.weight": "model/h{i}/mlp/c_proj/w",
    "h.{i}.mlp.c_proj.bias": "model/h{i}/mlp/c_proj/b",
    "ln_f.weight": "model/ln_f/g",
    "ln_f.bias": "model/ln_f/b",
}

_L = "bert/encoder/layer_{i}"
BERT_TF_TABLE = {
    "wte.weight": "bert/embeddings/word_embeddings",
    "wpe.weight": "bert/embeddings/position_embeddings",
    "wse.weight": "bert/embeddings/token_type_embeddings",
    "ln_e.weight": "bert/embeddings/LayerNorm/gamma",
    "ln_e.bias": "bert/embeddings/LayerNorm/beta",
    "h.{i}.attn.c_attn.weight": tuple(f"{_L}/attention/self/{n}/kernel" for n in ("query", "key", "value")),
    "h.{i}.attn.c_attn.bias": tuple(f"{_L}/attention/self/{n}/bias" for n in ("query", "key", "value")),
    "h.{i}.attn.c_proj.weight": f"{_L}/attention/output/dense/kernel",
    "h.{i}.attn.c_proj.bias": f"{_L}/attention/output/dense/bias",
    "h.{i}.ln_1.weight": f"{_L}/attention/output/LayerNorm/gamma",
    "h.{i}.ln_1.bias": f"{_L}/attention/output/LayerNorm/beta",
    "h.{i}.mlp.c_fc.weight": f"{_L}/intermediate/dense/kernel",
    "h.{i}.mlp.c_fc.bias": f"{_L}/intermediate/dense/bias",
    "h.{i}.mlp.c_proj.weight": f"{_L}/output/dense/kernel",
    "h.{i}.mlp.c_proj.bias": f"{_L}/output/dense/bias",
    "h.{i}.ln_2.weight": f"{_L}/output/LayerNorm/gamma",
    "h.{i}.ln_2.bias": f"{_L}/output/LayerNorm/beta",
    "pool.weight": "bert/pooler/dense/kernel",
    "pool.bias": "bert/pooler/dense/bias",
}
BERT_TF_HEADS_TABLE = {
    "mlm.dense.weight": "cls/predictions/transform/dense/kernel",
    "mlm.dense.bias": "cls/predictions/transform/dense/bias",
    "mlm.ln.weight": "cls/predictions/transform/LayerNorm/gamma",
    "mlm.ln.bias": "cls/predictions/transform/LayerNorm/beta",
    "mlm.bias": "cls/predictions/output_bias",
    "nsp.fc.weight": "cls/seq_relationship/output_weights",   # [2, hidden]: already (out, in)
    "nsp.fc.bias": "cls/seq_relationship/output_bias",
}
# Training state, not weights: the step counter and AdamWeightDecayOptimizer's slots (under either
# of the names google-research/bert versions gave them).
OPTIMIZER_STATE = re.compile(r"(^|/)(global_step|adam_m|adam_v|AdamWeightDecayOptimizer(_1)?)$")


def _layout(name: str, shape: tuple) -> tuple:
    """The release's shape of a tensor we hold as `shape`. OpenAI's conv1d weights `w` are
    [1, in, out] and tf.layers.dense kernels [in, out]; our nn.Linear weights are (out, in)."""
    if name.endswith("/w"):
        return (1, *shape[::-1])
    if name.endswith("/kernel"):
        return shape[::-1]
    return shape


def _n_layer(ckpt: Checkpoint, pattern: str, config_file: str, n_layer: int, where: str) -> None:
    found = {int(m.group(1)) for n in ckpt if (m := re.match(pattern, n))}
    if len(found) != n_layer:
        raise ValueError(f"{where}: holds {len(found)} layers, but {config_file} says {n_layer}")


def _convert(ckpt: Checkpoint, table: dict, n_layer: int, expected: dict, where: str) -> dict:
    """Rename and re-lay-out the checkpoint's tensors into our state dict (torch tensors that are
    views of the memory-mapped shards where no concatenation is needed)."""
    pairs = _expand(table, n_layer)
    wanted = {n for _, theirs in pairs for n in (theirs if isinstance(theirs, tuple) else (theirs,))}
    missing = sorted(wanted - set(ckpt))
    unused = sorted(n for n in ckpt if n not in wanted and not OPTIMIZER_STATE.search(n))
    if missing or unused:
        raise ValueError(f"{where}: the checkpoint does not match the name table: missing tensors "
                         f"{missing[:10]}{' ...' if len(missing) > 10 else ''}; unused tensors {unused[:10]}"
                         f"{' ...' if len(unused) > 10 else ''}")
    out = {}
    for ours, theirs in pairs:
        group = theirs if isinstance(theirs, tuple) else (theirs,)
        shape = tuple(expected[ours].shape)
        part = (shape[0] // len(group), *shape[1:])   # fused q, k, v: three equal row blocks
        parts = []
        for name in group:
            e = ckpt.entries[name]
            if e.dtype.kind != "f":
                raise ValueError(f"{where}: tensor {name!r} has dtype {e.dtype.name}; weights are floating point")
            if e.shape != _layout(name, part):
                raise ValueError(f"{where}: tensor {name!r} has shape {list(e.shape)}; the config needs "
                                 f"{list(_layout(name, part))}")
            a = ckpt[name]
            a = a[0].T if name.endswith("/w") else a.T if name.endswith("/kernel") else a
            parts.append(torch.from_numpy(a))
        out[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out


# ---------------------------------------------------------------------------------------------
# Release directories

def find_prefix(directory) -> Path:
    """The checkpoint prefix in a release folder: the one PREFIX.index there (the `checkpoint`
    file's model_checkpoint_path decides when there are several)."""
    d = Path(directory)
    indexes = sorted(d.glob("*.index"))
    if len(indexes) > 1 and (d / "checkpoint").is_file():
        m = re.search(r'^model_checkpoint_path:\s*"([^"]*)"', (d / "checkpoint").read_text("utf-8", "replace"), re.M)
        named = [p for p in indexes if m and p.name == Path(m.group(1)).name + ".index"]
        indexes = named or indexes
    if len(indexes) != 1:
        raise FileNotFoundError(f"{d}: expected one TensorFlow checkpoint (PREFIX.index + PREFIX.data-*), found "
                                f"{[p.name for p in indexes]}")
    return indexes[0].with_suffix("")


def is_tf_dir(directory) -> bool:
    """A folder as OpenAI / Google released them: hparams.json or bert_config.json + a .index file."""
    d = Path(directory)
    return ((d / "hparams.json").is_file() or (d / "bert_config.json").is_file()) and any(d.glob("*.index"))


HPARAMS = {"n_vocab": "vocab_size", "n_ctx": "block_size", "n_embd": "n_embd", "n_head": "n_head",
           "n_layer": "n_layer"}


def gpt2_config_from_hparams(d: dict) -> GPT2Config:
    """OpenAI's hparams.json -> GPT2Config, e.g. {"n_vocab": 50257, "n_ctx": 1024, "n_embd": 768,
    "n_head": 12, "n_layer": 12} -> GPT2Config() (the 124M model)."""
    if set(d) != set(HPARAMS):
        raise ValueError(f"expected exactly the keys {sorted(HPARAMS)}, got {sorted(d)}")
    return GPT2Config(**{HPARAMS[k]: v for k, v in d.items()})


def gpt2_from_tf(directory) -> tuple[GPT2Config, dict]:
    """OpenAI's release folder (hparams.json + model.ckpt.*) -> (GPT2Config, our state dict)."""
    d = Path(directory)
    try:
        config = gpt2_config_from_hparams(read_json(d / "hparams.json"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{d / 'hparams.json'}: {e}") from None
    prefix = find_prefix(d)
    ckpt = read_checkpoint(prefix)
    _n_layer(ckpt, r"model/h(\d+)/", "hparams.json", config.n_layer, f"{prefix}.index")
    sd = _convert(ckpt, GPT2_TF_TABLE, config.n_layer, _meta_state(GPT2, config), f"{prefix}.index")
    return config, sd


def bert_from_tf(directory) -> tuple[BertConfig, dict, bool]:
    """Google's release folder (bert_config.json + bert_model.ckpt.*) -> (BertConfig, our state
    dict, heads). heads is True when the MLM + NSP heads (cls/...) are present: the keys are then
    BertForPreTraining's (bert.*, mlm.*, nsp.*), else Bert's."""
    d = Path(directory)
    try:
        config = bert_config_from_hf({**read_json(d / "bert_config.json"), "model_type": "bert"})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{d / 'bert_config.json'}: {e}") from None
    prefix = find_prefix(d)
    ckpt = read_checkpoint(prefix)
    _n_layer(ckpt, r"bert/encoder/layer_(\d+)/", "bert_config.json", config.n_layer, f"{prefix}.index")
    heads = any(n.startswith("cls/") for n in ckpt)
    if heads:
        table = {**{"bert." + k: v for k, v in BERT_TF_TABLE.items()}, **BERT_TF_HEADS_TABLE}
        expected = _meta_state(BertForPreTraining, config)
    else:
        table, expected = BERT_TF_TABLE, _meta_state(Bert, config)
    return config, _convert(ckpt, table, config.n_layer, expected, f"{prefix}.index"), heads
