"""A minimal TensorFlow tensor-bundle writer for tests and benchmarks: checkpoints TensorFlow did not
write (an extra or missing tensor, another dtype, a 124M-sized model). One data shard, one table
block, no key prefix compression: valid for any bundle reader, if not TensorFlow's own block sizes.
The fixtures in fixtures/tf/ are TensorFlow's own; this writer is tested against them."""
from pathlib import Path

import numpy as np

from duolm.convert import tf
from duolm.convert.crc32c import crc32c

MAGIC = 0xDB4775248B80FB57


def mask(crc: int) -> int:
    """TF's crc32c::Mask (lib/hash/crc32c.h): rotate right by 15 bits and add a constant."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def field(num: int, value) -> bytes:
    """A protobuf field: bytes as length-delimited (wire type 2), ints as varints (wire type 0)."""
    if isinstance(value, bytes):
        return varint(num << 3 | 2) + varint(len(value)) + value
    return varint(num << 3) + varint(value)


def _block(items) -> bytes:
    body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in items)
    body += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")   # one restart point, at 0
    return body + b"\x00" + mask(crc32c(body + b"\x00")).to_bytes(4, "little")


def write_bundle(prefix, tensors: dict) -> None:
    """Write name -> np.ndarray as PREFIX.index + PREFIX.data-00000-of-00001."""
    prefix = Path(prefix)
    codes = {np.dtype(v): k for k, v in tf.DTYPES.items()}
    entries, offset = [(b"", field(1, 1))], 0       # the header: num_shards = 1
    with open(f"{prefix}.data-00000-of-00001", "wb") as f:
        for name in sorted(tensors):
            raw = np.ascontiguousarray(tensors[name])
            shape = b"".join(field(2, field(1, d)) for d in raw.shape)
            entries.append((name.encode(), field(1, codes[raw.dtype]) + field(2, shape) + field(4, offset)
                            + field(5, raw.nbytes) + varint(6 << 3 | 5)
                            + mask(crc32c(raw.reshape(-1).view(np.uint8))).to_bytes(4, "little")))
            f.write(raw.tobytes())
            offset += raw.nbytes
    data_block, meta = _block(entries), _block([])
    index_block = _block([(entries[-1][0] + b"\xff", varint(0) + varint(len(data_block) - 5))])
    handles = (varint(len(data_block)) + varint(len(meta) - 5)
               + varint(len(data_block) + len(meta)) + varint(len(index_block) - 5))
    footer = handles.ljust(40, b"\x00") + MAGIC.to_bytes(8, "little")
    Path(f"{prefix}.index").write_bytes(data_block + meta + index_block + footer)
