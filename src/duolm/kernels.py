"""duolm's CPU kernels for decoding, kernels.cpp: products of the few rows decoding multiplies (a token of each
sequence), each weight packed once so that one pass over it serves every row, its next lines prefetched, and one
query's attention over a KV cache. One source, written with ATen's portable vectors, built for the instruction set
torch dispatches here (isa(): AVX-512 or AVX2; layout(): the packs' blocks); where it builds (available(); ready()
on this CPU) duolm.precision's KernelLinear and Int8Linear may run the products (duolm.engines times them against
the libraries), its KernelAttention GPT-2's decoding attention (swapped in by quantize). Each is an operator
(duolm_cpu::...) with a shape function, which compiled graphs call as it is.

The build: the first process that needs the kernels on a machine compiles kernels.cpp into a shared library with one
run of the C++ compiler (~15 s; a line on stderr says what was built, where and in how long), into a cache folder
(~/.cache/duolm/kernels unless told), under a name that hashes what the library depends on: the source, torch's
version, the compiler's flags and its `--version`; a changed one builds anew, every later process loads the file
silently. There is no lock, so a killed build (SIGKILL, the OOM killer) can leave nobody waiting on it: each build
writes a temporary file of its own and moves it into place with os.replace, atomically, so two processes building at
once each end with a complete library, and a killed build leaves a temporary file that nobody reads (removed by a later
process after an hour). The compiler's run is bounded (TIMEOUT). Where the kernels cannot be had (no compiler, a
failed or overlong build, a cache folder that cannot be written) a warning says why, once, and duolm.precision runs
torch's kernels instead.

fp32_linear(x, pack_fp32(W), b) = x W^T + b in fp32 (the sums in k's order: F.linear's numbers to float rounding).

int8_linear (int8_supported(): AVX2, or AVX-512 with VNNI): for x (M, K) fp32 and W ~= q * scale (int8 rows with a
scale each, duolm.precision.int8_rows), each row of x is mapped onto 0..255 by its own min lo and span = max - min (at
least 1e-30: a constant row's u8 are all 0), and the int8 sums come back through the same affine map:

    u8[m, k] = round((x[m, k] - lo[m]) * (255 / span[m]))
    y[m, n]  = (sum_k u8[m, k] q[n, k]) * (span[m] / 255) * scale[n] + lo[m] * row_sums[n] + b[n]

with row_sums[n] = sum_k q[n, k] scale[n]. Every row gets all 256 steps whatever the other rows hold, and a row's
result is the same bits alone as in any batch (the sums are exact integers). int8_reference() is the formula in
torch ops.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import secrets
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import include_paths

SOURCE = Path(__file__).with_suffix(".cpp")
CACHE = Path.home() / ".cache" / "duolm" / "kernels"
COMPILERS = ("g++", "c++")                              # the first of these on PATH builds the kernels
TIMEOUT = 300.0                                         # seconds a compiler's run may take (~20 s on 2 cores)
STALE = 3600.0                                          # a temporary file this old is a killed build's
_FLAGS = ["-O3", "-fopenmp"]                          # -fopenmp: at::parallel_for's threads
# torch's CPU capability -> the CPU flags it needs, the build's flags (as ATen builds its kernels of that set; int8's
# VNNI is a target of its own in kernels.cpp), the floats a vector and the int8 inputs an instruction sums a lane
ISAS = {"AVX512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq"},
                   ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"], 16, 4),
        "AVX2": ({"avx2", "fma"}, ["-mavx2", "-mfma", "-mf16c"], 8, 2)}
_log = logging.getLogger("duolm.kernels")


@functools.cache
def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo ("model name", "flags"), None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), None)
    except OSError:
        return None


def isa() -> str | None:
    """The instruction set the kernels are built for here: torch's CPU capability where ISAS has it (on x86-64:
    "AVX512", or "AVX2", also where ATEN_CPU_CAPABILITY holds torch to it), else None."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISAS and platform.machine().lower() in ("x86_64", "amd64") else None


def supported(flags: str) -> bool:
    """Whether a CPU with these /proc/cpuinfo `flags` runs the kernels: isa() is one and the CPU has its features."""
    return isa() is not None and ISAS[isa()][0] <= set(flags.split())


def int8_supported(flags: str) -> bool:
    """Whether int8_linear runs too: under AVX-512 the CPU needs AVX512-VNNI besides."""
    return supported(flags) and (isa() != "AVX512" or "avx512_vnni" in flags.split())


def layout() -> tuple[int, int]:
    """(floats a vector, int8 inputs summed a lane) of the build here: the packs' blocks (16, 4) or (8, 2)."""
    return ISAS[isa() or "AVX512"][2:]


def build(cache: Path = CACHE, timeout: float = TIMEOUT) -> Path:
    """The kernels' shared library in `cache`, built there first where it is not (the module's docstring: the name,
    why no lock); not loaded. Raises RuntimeError (no compiler, a failed or overlong compile) or OSError (a folder
    that cannot be written)."""
    cxx = next(filter(None, map(shutil.which, COMPILERS)), None)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler: none of {', '.join(COMPILERS)} on PATH")
    lib = Path(torch.__file__).parent / "lib"                  # c10 and torch_cpu: the operators' registry
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"     # std::string as torch's
    name = isa()
    flags = ["-std=c++17", *_FLAGS, *ISAS[name][1], f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}", "-fPIC",
             "-shared", abi, *(f"-I{p}" for p in include_paths()), str(SOURCE),
             f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update("\0".join([torch.__version__, *flags, _run([cxx, "--version"], timeout).stdout]).encode())
    path = cache / f"duolm_kernels-{key.hexdigest()[:16]}.so"
    for old in cache.glob("*.tmp"):                   # killed builds' (a live one's is younger than TIMEOUT)
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > STALE:
                old.unlink()
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"     # this build's own
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o755))     # the umask's mode (the linker keeps it)
    start = time.perf_counter()
    try:
        _run([cxx, *flags, "-o", str(tmp)], timeout)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())                            # on disk before its name: never a cut library
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _log.warning("duolm.kernels: built %s from %s with %s in %.1f s", path, SOURCE.name, cxx,
                 time.perf_counter() - start)
    return path


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """cmd's run, bounded: a RuntimeError with the compiler's first error line where it fails or runs over (then
    the compiler and the programs it started, cc1plus and the assembler, are killed as one process group)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"{cmd[0]} ran over {timeout:g} s") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise RuntimeError(f"{cmd[0]} failed: {next((line for line in lines if 'error' in line), lines[-1])}")
    return done


@functools.cache
def available(flags: str, cache: Path = CACHE) -> bool:
    """Whether the kernels run here: the CPU supports them (supported()) and they build into `cache` (build()) and
    load, once a process; where they do not, a warning says why, once, and duolm.precision runs torch's kernels."""
    if not supported(flags):
        return False
    try:
        torch.ops.load_library(build(cache))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"duolm.kernels: duolm's CPU kernels did not build ({type(e).__name__}: {e}); torch's kernels "
                      "run instead", RuntimeWarning, stacklevel=3)
        return False
    torch.library.register_fake("duolm_cpu::fp32_linear")(lambda x, packed, bias, n: x.new_empty(*x.shape[:-1], n))
    torch.library.register_fake("duolm_cpu::int8_linear")(
        lambda x, packed, scale, row_sums, bias, n: x.new_empty(*x.shape[:-1], n))
    torch.library.register_fake("duolm_cpu::one_query_attention")(lambda q, k, v, mask: q.new_empty(q.shape))
    torch.library.register_fake("duolm_cpu::masked_logits")(lambda logits, bitmasks, rows: torch.empty_like(logits))
    return True


@torch.compiler.assume_constant_result      # a compiled graph takes the answer as a constant
def ready() -> bool:
    """Whether the kernels run on this CPU: available() for its flags."""
    return available(cpuinfo("flags") or "")


def pack_fp32(w: torch.Tensor, lanes: int | None = None) -> torch.Tensor:
    """fp32_linear's layout of W (N, K): blocks of `lanes` rows (layout()'s here), each column of a block contiguous,
    [N/lanes][K][lanes].

    >>> pack_fp32(torch.arange(6.0).view(3, 2), lanes=4)[0].tolist()
    [[0.0, 2.0, 4.0, 0.0], [1.0, 3.0, 5.0, 0.0]]
    """
    n, k = w.shape
    lanes = lanes or layout()[0]
    nb = -(-n // lanes)
    return F.pad(w.detach().float(), (0, 0, 0, lanes * nb - n)).view(nb, lanes, k).permute(0, 2, 1).contiguous()


def pack_int8(q: torch.Tensor, lanes: int | None = None, group: int | None = None) -> torch.Tensor:
    """int8_linear's layout of int8 rows q (N, K): blocks of `lanes` rows and `group` columns (layout()'s here),
    [N/lanes][K/group][lanes][group].

    >>> pack_int8(torch.arange(8, dtype=torch.int8).view(2, 4), lanes=4, group=2)[0].tolist()
    [[[0, 1], [4, 5], [0, 0], [0, 0]], [[2, 3], [6, 7], [0, 0], [0, 0]]]
    """
    n, k = q.shape
    lanes, group = lanes or layout()[0], group or layout()[1]
    nb, kg = -(-n // lanes), -(-k // group)
    padded = F.pad(q, (0, group * kg - k, 0, lanes * nb - n))
    return padded.view(nb, lanes, kg, group).permute(0, 2, 1, 3).contiguous()


def fp32_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (..., K) @ W^T + b -> (..., n) on pack_fp32(W) (available() first)."""
    return torch.ops.duolm_cpu.fp32_linear(x, packed, bias, n)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) by the int8 formula on pack_int8(q) (int8_supported() and available() first)."""
    return torch.ops.duolm_cpu.int8_linear(x, packed, scale, row_sums, bias, scale.shape[0])


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear's formula in torch ops: the same fp32 quantization (the same u8), the sums exact (float64).

    A row [0, 1, 3] (lo 0, span 3: u8 [0, 85, 255]) times the int8 row [1, 2, 0] with scale 0.5 (row sum 1.5):
    (0 + 170 + 0) * (3 / 255) * 0.5 + 0 * 1.5 = 1.0, x's exact product 0 + 1 + 0 = 1.

    >>> q, s = torch.tensor([[1, 2, 0]], dtype=torch.int8), torch.tensor([0.5])
    >>> int8_reference(torch.tensor([[0.0, 1.0, 3.0]]), q, s, (q.float() * s[:, None]).sum(1), None).tolist()
    [[1.0]]
    """
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-30)
    u8 = torch.round((x - lo) * torch.full_like(span, 255.0).div(span))    # (255 / span is 255 * (1 / span))
    y = (u8.double() @ q.double().T) * (span / 255.0).double() * scale.double() + lo.double() * row_sums.double()
    return (y if bias is None else y + bias.double()).float()


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) under mask) v for one query a row, fp32 (available() first): q (B, nh, 1, hd), k and v
    (B, nh, L, hd) with rows of hd contiguous (slices of a cache), mask bool (B or 1, 1, 1, L) or None (every column)
    -> (B, nh, 1, hd). Only the columns a row's mask shows are read."""
    return torch.ops.duolm_cpu.one_query_attention(q, k, v, mask)


def masked_logits(logits: torch.Tensor, bitmasks: list, rows: list) -> torch.Tensor:
    """logits (B, V) fp32 -> a copy whose row rows[k] keeps the tokens bitmasks[k] allows and has -inf for the others
    (available() first): bitmasks[k] (1, W) int32 with W >= V / 32, token t allowed where bit t % 32 of word t // 32
    is set (duolm.generation.grammar's bitmasks; its penalty_rows is the same mask in numpy); the other rows as they
    are."""
    return torch.ops.duolm_cpu.masked_logits(logits, bitmasks, rows)
