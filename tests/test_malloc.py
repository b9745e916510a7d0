"""duolm.malloc: after keep_freed_memory(), a freed 64 MB block is reused by the next one of its size, whose pages
are then already in memory; by glibc's default each such block is a fresh mapping whose every page faults in
again. After huge_pages(), a 64 MB tensor sits on 2 MB pages (where the kernel offers them). The `duolm` command
makes both settings before it runs a subcommand. Each case runs in a process of its own: the settings are the
whole process's."""
import os
import platform
import subprocess
import sys

import pytest

from duolm.malloc import THP_MODE

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

# page faults while a 64 MB block is allocated, written and freed, the second time
SECOND_ROUND_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults(n=64 << 20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""
PAGES = (64 << 20) // 4096


def _second_round_faults(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", setup + SECOND_ROUND_FAULTS], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    assert _second_round_faults("") > PAGES // 2                   # glibc's default: every page again
    kept = _second_round_faults("from duolm.malloc import keep_freed_memory\nassert keep_freed_memory()\n")
    assert kept < PAGES // 20


def test_the_duolm_command_keeps_freed_memory():
    run_command = ("from duolm.cli import main\n"
                   "try:\n    main(['generate', '/nonexistent-model', 'hi'])\n"
                   "except SystemExit as e:\n    assert e.code == 2\n")
    assert _second_round_faults(run_command) < PAGES // 20


# KB of the process's anonymous memory on huge pages after a 64 MB tensor is allocated and written
HUGE_KB = """
import torch
block = torch.ones(16 << 20)
print(next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")))
"""
COMMAND = ("from duolm.cli import main\n"
           "try:\n    main(['generate', '/nonexistent-model', 'hi'])\n"
           "except SystemExit as e:\n    assert e.code == 2\n")


def _huge_kb(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", setup + HUGE_KB], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"})
    return int(out.stdout.split()[-1])


def test_large_tensors_sit_on_huge_pages_and_the_duolm_command_puts_them_there():
    mode = THP_MODE.read_text()
    asked = _huge_kb("from duolm.malloc import huge_pages\nprint(huge_pages())\n")
    by_command = _huge_kb(COMMAND)
    if "[never]" in mode:                                # the kernel offers none: huge_pages() says so
        out = subprocess.run([sys.executable, "-c", "from duolm.malloc import huge_pages\nprint(huge_pages())"],
                             capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False"] and asked == by_command == 0
        return
    assert asked >= 32 << 10 and by_command >= 32 << 10                    # at least half the block
    if "[madvise]" in mode:                              # only the blocks asked for get them
        assert _huge_kb("") == 0
