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


# the `duolm` command, failing at once on a missing model after it made its settings
COMMAND = ("from duolm.cli import main\n"
           "try:\n    main(['generate', '/nonexistent-model', 'hi'])\n"
           "except SystemExit as e:\n    assert e.code == 2\n")


def test_the_duolm_command_keeps_freed_memory():
    assert _second_round_faults(COMMAND) < PAGES // 20


# the KB of the process's anonymous memory on huge pages once a 64 MB tensor is allocated and written
HUGE_KB = """
import torch
block = torch.ones(16 << 20)
print(next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")))
"""


def _huge_kb(setup: str) -> list[str]:
    """What `setup` then HUGE_KB print, in a process without THP_MEM_ALLOC_ENABLE of its own."""
    out = subprocess.run([sys.executable, "-c", setup + HUGE_KB], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"})
    return out.stdout.split()


def test_large_tensors_sit_on_huge_pages_and_the_duolm_command_puts_them_there():
    said, asked = _huge_kb("from duolm.malloc import huge_pages\nprint(huge_pages())\n")[-2:]
    by_command = int(_huge_kb(COMMAND)[-1])
    mode = THP_MODE.read_text()
    if "[never]" in mode:                                # the kernel offers none: huge_pages() says so
        assert said == "False" and int(asked) == by_command == 0
        return
    assert said == "True" and int(asked) >= 32 << 10 and by_command >= 32 << 10          # at least half the block
    if "[madvise]" in mode:                              # only the blocks asked for get them
        assert int(_huge_kb("")[-1]) == 0
