"""CRC-32C (Castagnoli), the checksum TensorFlow and LevelDB put on table blocks and tensors,
in numpy: no compiled extension is needed, and a 500 MB checkpoint is checked in seconds.

The textbook loop feeds one byte at a time through a 256-entry table (_crc_plain, the reference).
crc32c() cuts long inputs into up to 16384 lanes that numpy steps through side by side, 4 bytes
per step, and joins the lanes' results with the algebra of CRCs (feeding zero bytes is linear).
"""
from __future__ import annotations

import functools

import numpy as np

_POLY = 0x82F63B78   # x^32 + x^28 + ... reflected: bytes are fed least significant bit first


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


_T8_LIST = _byte_table().tolist()


def _crc_plain(c: int, data) -> int:
    """The textbook byte loop on the raw register (no pre/post inversion)."""
    for b in bytes(data):
        c = _T8_LIST[(c ^ b) & 0xFF] ^ (c >> 8)
    return c


# Feeding zero bytes into the register is linear over GF(2): an operator is 32 columns, the images
# of the 32 one-bit registers. Feeding one zero byte is x -> T8[x & 0xff] ^ (x >> 8).
_ONE_BYTE = np.array([_T8_LIST[(1 << b) & 0xFF] ^ ((1 << b) >> 8) for b in range(32)], dtype=np.uint32)


def _span(cols) -> np.ndarray:
    """All XOR combinations of `cols`, indexed by the bits of the index (a lookup table)."""
    t = np.zeros(1, dtype=np.uint32)
    for c in cols:
        t = np.concatenate([t, t ^ c])
    return t


def _tables(op: np.ndarray) -> list:
    return [_span(op[8 * k:8 * k + 8]) for k in range(4)]


def _apply(tables, v: np.ndarray) -> np.ndarray:
    """An operator applied to each register in v, by one 256-entry table per byte (see _tables)."""
    return tables[0][v & 0xFF] ^ tables[1][(v >> 8) & 0xFF] ^ tables[2][(v >> 16) & 0xFF] ^ tables[3][v >> 24]


@functools.lru_cache(maxsize=256)
def _zeros(n: int) -> list:
    """Tables of the operator that feeds n zero bytes (square and multiply)."""
    result, power = np.array([1 << b for b in range(32)], dtype=np.uint32), _ONE_BYTE
    while n:
        if n & 1:
            result = _apply(_tables(power), result)
        power = _apply(_tables(power), power)
        n >>= 1
    return _tables(result)


@functools.cache
def _word_tables():
    # One 4-byte step is crc' = Z4(crc ^ word) with Z4 = feed 4 zero bytes, looked up in two halves.
    z4 = _apply(_zeros(4), np.array([1 << b for b in range(32)], dtype=np.uint32))
    return _span(z4[:16]), _span(z4[16:])


def _crc_raw(c: int, data) -> int:
    """The raw register after feeding `data` from state c. Long inputs are cut into K lanes that
    numpy steps through side by side, 4 bytes at a time; the lane results are then joined pairwise
    with crc(A + B) = Z_len(B)(crc(A)) ^ crc(B) (crc(B) started from 0), as zlib's crc32_combine."""
    data = memoryview(data).cast("B")
    n_words = len(data) // 4
    lanes = 1 << min(14, max(0, (n_words // 8).bit_length() - 1))   # a power of two, each >= 8 words
    if lanes < 16:
        return _crc_plain(c, data)
    L = n_words // lanes
    words = np.frombuffer(data[:lanes * L * 4], dtype="<u4").reshape(lanes, L)
    lo, hi = _word_tables()
    reg = np.zeros(lanes, dtype=np.uint32)
    reg[0] = c
    i_lo, i_hi, part = np.empty(lanes, np.intp), np.empty(lanes, np.intp), np.empty(lanes, np.uint32)
    for j0 in range(0, L, 64):
        block = np.ascontiguousarray(words[:, j0:j0 + 64].T)   # rows = one word of every lane
        for row in block:   # reg = lo[(reg ^ row) & 0xffff] ^ hi[(reg ^ row) >> 16], without temporaries
            np.bitwise_xor(reg, row, out=reg)
            np.bitwise_and(reg, 0xFFFF, out=i_lo)
            np.right_shift(reg, 16, out=i_hi)
            np.take(lo, i_lo, out=reg)
            np.take(hi, i_hi, out=part)
            np.bitwise_xor(reg, part, out=reg)
    span = 4 * L
    while len(reg) > 1:   # join neighbouring lanes; each joined lane is twice as long
        reg = _apply(_zeros(span), reg[0::2]) ^ reg[1::2]
        span *= 2
    return _crc_raw(int(reg[0]), data[lanes * L * 4:])


def crc32c(data) -> int:
    """CRC-32C of bytes. Worked example (RFC 3720 B.4): crc32c(b"123456789") == 0xE3069283."""
    return _crc_raw(0xFFFFFFFF, data) ^ 0xFFFFFFFF


def unmask(masked: int) -> int:
    """TF and LevelDB store crc32c masked, rot15(crc) + 0xa282ead8, so that a CRC of data holding
    CRCs is not degenerate; this undoes it."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF
