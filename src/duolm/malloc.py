"""The C library's allocator, set for a process that moves large tensors: keep_freed_memory(). Standard library
only (the `duolm` command calls it before it imports torch)."""
from __future__ import annotations

import ctypes


def keep_freed_memory(threshold: int = 1 << 29) -> bool:
    """Have glibc's malloc keep freed blocks of up to `threshold` bytes for the next allocation. By default glibc
    maps each block over 128 KB (a limit that rises with the blocks freed, to at most 32 MB) from the system and
    returns it when freed, so the next block of that size faults in fresh zeroed pages: a BERT-base forward at
    32 x 128 does that with 50 MB activations in every layer, and runs faster with this (benchmarks/cpu_engines.py,
    and with --default-malloc for the other side). Here blocks are mapped from `threshold` on and free memory is
    returned above 2 x threshold, so the resident memory stays near its peak instead of falling after each step.

    A setting of the whole process, so the library never makes it by itself: the `duolm` command does at its
    start, a program of your own may. Returns whether glibc took both values (False where the C library has no
    mallopt: not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3                     # glibc's malloc.h
    return mallopt(m_mmap_threshold, threshold) == 1 and mallopt(m_trim_threshold, 2 * threshold) == 1
