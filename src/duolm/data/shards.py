"""Token shards: the files `duolm prepare` writes and the training loop memory-maps.

A shard is a 32-byte header then the token ids, little-endian:

    magic b"DUOLMTOK" (8) | version u32 | dtype code u32 (2 = uint16, 4 = uint32) | token count u64 | 8 zero bytes

uint16 holds any vocabulary of at most 65,536 ids (GPT-2's 50,257, BERT's 30,522); bigger ones use uint32.

A prepared data directory holds `meta.json` (written last, so a directory without it is incomplete),
`tokenizer/` (the tokenizer, saved), `train_000000.bin ...` and `val_000000.bin ...`. Byte-level BPE
corpora are one token stream: every input file is a document, followed by the end-of-text id. WordPiece
(BERT) corpora keep the document/sentence structure BERT's pair building needs: a sentence is a line, a
blank line ends a document; the ids are stored without [CLS]/[SEP], and each shard has two index arrays
beside it: `<shard>.sent.npy` (start of every sentence in the shard's ids, plus the end) and
`<shard>.doc.npy` (first sentence of every document, plus the sentence count).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from duolm.fileio import atomic_write, read_json

MAGIC = b"DUOLMTOK"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")  # 32 bytes
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
FORMAT = "duolm-data"


# --- one shard --------------------------------------------------------------------------------

def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
    if vocab_size <= 1 << 16:
        return _DTYPES[2]
    if vocab_size <= 1 << 32:
        return _DTYPES[4]
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token shards")


def write_shard(path, tokens, vocab_size: int | None = None) -> Path:
    """Write `tokens` (ints) as a shard; the dtype comes from `vocab_size` (default: the largest id + 1).

    The file is written to `path.tmp` and renamed, so a reader never sees half a shard."""
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    lo = int(arr.min()) if arr.size else 0
    hi = int(arr.max()) if arr.size else -1
    if vocab_size is None:
        vocab_size = hi + 1
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}), got min {lo} max {hi}")
    dtype = dtype_for_vocab(max(vocab_size, 1))
    data = arr.astype(dtype, copy=False)

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, data.size))
            f.write(data.tobytes())

    atomic_write(path, write)
    return path


def read_shard(path) -> np.ndarray:
    """Memory-map a shard read-only: a 1-D uint16/uint32 array. A bad header or size -> ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token shard {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise ValueError(f"{path}: not a duolm token shard (file of {size} bytes is shorter than the "
                         f"{HEADER.size}-byte header); re-run `duolm prepare`")
    magic, version, code, count = HEADER.unpack(head)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a duolm token shard (magic {magic!r}, expected {MAGIC!r}); re-run `duolm prepare`")
    if version != VERSION:
        raise ValueError(f"{path}: token shard version {version}, this duolm reads version {VERSION}")
    if code not in _DTYPES:
        raise ValueError(f"{path}: unknown dtype code {code} in token shard header (expected 2 or 4)")
    dtype = _DTYPES[code]
    expected = HEADER.size + count * dtype.itemsize
    if size != expected:
        raise ValueError(f"{path}: header says {count} tokens of {dtype.itemsize} bytes ({expected} bytes in all) "
                         f"but the file has {size} bytes; the shard is truncated or corrupt, re-run `duolm prepare`")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))


# --- a prepared directory -----------------------------------------------------------------------

def load_meta(data_dir) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared data directory "
                                f"(run `duolm prepare FILES --tokenizer TOK -o {data_dir}`)")
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _split_meta(data_dir, split: str) -> dict:
    meta = load_meta(data_dir)
    if split not in meta["splits"]:
        raise ValueError(f"{data_dir}: no split {split!r} (has {sorted(meta['splits'])})")
    return meta["splits"][split]


def open_split(data_dir, split: str = "train") -> list[np.ndarray]:
    """The shards of a split, each a read-only memmap (empty shards are left out)."""
    shards = [read_shard(Path(data_dir) / name) for name in _split_meta(data_dir, split)["shards"]]
    return [s for s in shards if len(s)]


def load_documents(data_dir, split: str = "train") -> list[list[list[int]]]:
    """WordPiece corpora: documents -> sentences -> token ids (no [CLS]/[SEP])."""
    meta = load_meta(data_dir)
    if meta["kind"] != "wordpiece":
        raise ValueError(f"{data_dir} holds a {meta['kind']} token stream; documents of sentences exist only "
                         f"for WordPiece (BERT) data")
    docs: list[list[list[int]]] = []
    for name in _split_meta(data_dir, split)["shards"]:
        path = Path(data_dir) / name
        ids = np.asarray(read_shard(path)).tolist()
        sent = np.load(path.with_suffix(".sent.npy"))
        doc = np.load(path.with_suffix(".doc.npy"))
        if len(sent) < 1 or sent[-1] != len(ids) or len(doc) < 1 or doc[-1] != len(sent) - 1:
            raise ValueError(f"{path}: sentence/document index does not match the shard; re-run `duolm prepare`")
        sent = sent.tolist()
        doc = doc.tolist()
        for d in range(len(doc) - 1):
            docs.append([ids[sent[s]:sent[s + 1]] for s in range(doc[d], doc[d + 1])])
    return docs
