"""duolm.malloc: after keep_freed_memory(), a freed 64 MB block is reused by the next one of its size, whose pages
are then already in memory; by glibc's default each such block is a fresh mapping whose every page faults in
again. The `duolm` command makes the setting before it runs a subcommand. Each case runs in a process of its
own: the setting is the whole process's."""
import platform
import subprocess
import sys

import pytest

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
