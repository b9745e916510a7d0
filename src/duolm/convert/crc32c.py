"""CRC-32C (Castagnoli), the checksum TensorFlow and LevelDB put on table blocks and tensors, from
google-crc32c (Google's C library, with hardware CRC instructions where the CPU has them): the optional
extra `duolm[tf]`, imported on first use so that nothing else in duolm needs it.
"""
from __future__ import annotations

import numpy as np


def crc32c(data) -> int:
    """CRC-32C of a bytes-like object (bytes, a contiguous numpy array or memory map, a memoryview).
    Worked example (RFC 3720 B.4): crc32c(b"123456789") == 0xE3069283."""
    try:
        import google_crc32c
    except ImportError:
        raise ImportError("reading TensorFlow checkpoints needs google-crc32c for their checksums: "
                          "pip install 'duolm[tf]'") from None
    # The C extension takes bytes or numpy arrays; memoryviews and bytearrays are viewed as an array.
    return google_crc32c.value(data if isinstance(data, (bytes, np.ndarray)) else np.frombuffer(data, np.uint8))


def unmask(masked: int) -> int:
    """TF and LevelDB store crc32c masked, rot15(crc) + 0xa282ead8, so that a CRC of data holding
    CRCs is not degenerate; this undoes it."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF
