"""The memory of a process that moves large tensors: glibc's malloc keeps what it frees (keep_freed_memory()),
PyTorch's CPU allocator backs large blocks with huge pages (huge_pages()), oneDNN keeps a bounded number of the
kernels it builds for each shape (onednn_caches()). Standard library only; settings of the
whole process, made by the `duolm` command before its first tensor, never by the library itself."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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


def huge_pages() -> bool:
    """Have PyTorch's CPU allocator back every block of 2 MB and more with the kernel's 2 MB transparent huge pages
    (torch's THP_MEM_ALLOC_ENABLE=1, read at its first block of that size: call this before any). A decoding step
    streams every weight once: with 4 KB pages it misses the TLB on each page, ~120,000 a token for GPT-2 124M's
    494 MB of fp32 matrices, with 2 MB pages ~240 (benchmarks/cpu_engines.py decodes under it). Such a block starts
    on a 2 MB boundary; smaller blocks, and the memory of other libraries, are left as they are (where the kernel's
    THP mode is "madvise", the common default).

    Returns whether the kernel offers huge pages (Linux, THP not "never") and the variable is 1 (a value already
    set, 0 or 1, is kept)."""
    try:
        if "[never]" in THP_MODE.read_text():
            return False
    except OSError:                                         # not Linux, or no THP
        return False
    return os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1") == "1"


def onednn_caches(entries: int = 64) -> None:
    """Bound the kernels oneDNN keeps to `entries` of each of its two caches (oneDNN's primitive cache,
    ONEDNN_PRIMITIVE_CACHE_CAPACITY, and the one PyTorch's oneDNN bindings keep, LRU_CACHE_CAPACITY; 1024 each by
    default; read at oneDNN's first kernel: call this before it). oneDNN builds a kernel for every distinct shape it
    runs, a few hundred KB of code and state each, and keeps it: a server or an evaluation meeting inputs of many
    lengths adds one per length and weight (tests/test_serve_soak.py: 20% more memory over 600 BERT requests at
    oneDNN's default). Past `entries` the least recently used kernel is dropped, and built again (~1 ms) when its
    shape comes back; decoding at a few batch sizes runs a few dozen. A value already set is kept."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))
