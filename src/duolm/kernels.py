"""duolm's CPU kernels for decoding, kernels.cpp: products of the few rows decoding multiplies (a token of each
sequence), each weight packed once so that one pass over it serves every row, its next lines prefetched, and one
query's attention over a KV cache. Built by torch's C++ extension loader the first time a process needs them (~20 s;
cached after, under torch's extensions folder), where the CPU has AVX-512 (available(); ready() on this CPU);
duolm.precision's KernelLinear and Int8Linear run the products, GPT-2's decoding step the attention
(duolm.models.gpt2.kernel_attends). Each is an operator (duolm_cpu::...) with a shape function, which compiled graphs
call as it is.

fp32_linear(x, pack_fp32(W), b) = x W^T + b in fp32 (the sums in k's order: F.linear's numbers to float rounding).

int8_linear (AVX512-VNNI CPUs: int8_supported()): for x (M, K) fp32 and W ~= q * scale (int8 rows with a scale each,
duolm.precision.int8_rows), each row of x is mapped onto 0..255 by its own min lo and span = max - min (at least
1e-30: a constant row's u8 are all 0), and the int8 sums come back through the same affine map:

    u8[m, k] = round((x[m, k] - lo[m]) * (255 / span[m]))
    y[m, n]  = (sum_k u8[m, k] q[n, k]) * (span[m] / 255) * scale[n] + lo[m] * row_sums[n] + b[n]

with row_sums[n] = sum_k q[n, k] scale[n]. Every row gets all 256 steps whatever the other rows hold, and a row's
result is the same bits alone as in any batch (the sums are exact integers). int8_reference() is the formula in
torch ops. Where the kernels cannot be had, duolm.precision runs torch's kernels instead.
"""
from __future__ import annotations

import functools
import os
import platform
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]     # -fopenmp: at::parallel_for's threads; int8's own target: VNNI


@functools.cache
def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo ("model name", "vendor_id", "flags"), None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), None)
    except OSError:
        return None


def supported(flags: str) -> bool:
    """Whether a CPU with these /proc/cpuinfo `flags` runs the kernels: x86-64 with AVX-512F, and torch dispatching
    its AVX-512 kernels (not held to AVX2 by ATEN_CPU_CAPABILITY)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and "avx512f" in flags.split()
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))


def int8_supported(flags: str) -> bool:
    """Whether int8_linear runs too: AVX512-BW and AVX512-VNNI besides."""
    return supported(flags) and {"avx512bw", "avx512_vnni"} <= set(flags.split())


@functools.cache
def available(flags: str) -> bool:
    """Whether the kernels run here: the CPU supports them (supported()) and they build (a C++ compiler, ninja); a
    failed build warns once and leaves duolm.precision on torch's kernels."""
    if not supported(flags):
        return False
    path = os.environ.get("PATH", "")
    try:
        import ninja                                         # the loader runs `ninja`: the package's, venv active or not
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
        load(name="duolm_kernels", sources=[str(SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False)
    except Exception as e:                                   # noqa: BLE001 - no compiler, no ninja, a failed build
        warnings.warn(f"duolm.kernels: duolm's CPU kernels did not build ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); torch's kernels run instead",
                      RuntimeWarning, stacklevel=3)
        return False
    finally:
        os.environ["PATH"] = path
    torch.library.register_fake("duolm_cpu::fp32_linear")(lambda x, packed, bias, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("duolm_cpu::int8_linear")(
        lambda x, packed, scale, row_sums, bias, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("duolm_cpu::one_query_attention")(lambda q, k, v, mask: q.new_empty(q.shape))
    return True


@torch.compiler.assume_constant_result      # a compiled graph takes the answer as a constant
def ready() -> bool:
    """Whether the kernels run on this CPU: available() for its flags."""
    return available(cpuinfo("flags") or "")


def pack_fp32(w: torch.Tensor) -> torch.Tensor:
    """fp32_linear's layout of W (N, K): blocks of 16 rows, each column of a block contiguous, [N/16][K][16].

    >>> pack_fp32(torch.arange(6.0).view(3, 2))[0, :, :4].tolist()
    [[0.0, 2.0, 4.0, 0.0], [1.0, 3.0, 5.0, 0.0]]
    """
    n, k = w.shape
    nb = -(-n // 16)
    return F.pad(w.detach().float(), (0, 0, 0, 16 * nb - n)).view(nb, 16, k).permute(0, 2, 1).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8_linear's layout of int8 rows q (N, K): blocks of 16 rows and 4 columns, [N/16][K/4][16][4].

    >>> pack_int8(torch.arange(8, dtype=torch.int8).view(2, 4))[0, 0, :3].tolist()
    [[0, 1, 2, 3], [4, 5, 6, 7], [0, 0, 0, 0]]
    """
    n, k = q.shape
    nb, kg = -(-n // 16), -(-k // 4)
    padded = F.pad(q, (0, 4 * kg - k, 0, 16 * nb - n))
    return padded.view(nb, 16, kg, 4).permute(0, 2, 1, 3).contiguous()


def fp32_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (..., K) @ W^T + b -> (..., n) on pack_fp32(W) (available() first)."""
    y = torch.ops.duolm_cpu.fp32_linear(x.reshape(-1, x.shape[-1]), packed, bias, n)
    return y.view(*x.shape[:-1], n)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) -> (..., N) by the int8 formula on pack_int8(q) (int8_supported() and available() first)."""
    n = scale.shape[0]
    y = torch.ops.duolm_cpu.int8_linear(x.reshape(-1, x.shape[-1]), packed, scale, row_sums, bias, n)
    return y.view(*x.shape[:-1], n)


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
