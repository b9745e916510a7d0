"""Which arithmetic runs the matmuls: one value, resolved once where a job starts, then applied in the open.

    precision = resolve("auto", device, training=True)  # "bf16" where the device computes it natively, else "fp32"
    with autocast(precision, device):                    # training: torch.autocast to bf16, or nothing
        loss = objective(model(x), batch)

    quantize(model, "int8")                              # inference: each nn.Linear (and tied output layer) becomes
    print(model)                                         # the module that runs it: Int8Linear(768, 2304, ...)

Training changes nothing in the model: bf16 is torch.autocast (fp32 weights, optimizer state and losses). Inference
swaps the linears, in place, for modules that say what they run:
  * "fp32": exact, on the engines timed on this machine (duolm.engines.fp32_choice(): "few" for products of up to
    KERNEL_ROWS rows, "wide" for longer ones; the one switch, through which tests force each engine). "duolm":
    KernelLinear, duolm.kernels' fp32 kernel (the same dot products in another order, within ~1e-6); "onednn":
    PackedLinear, oneDNN on the weight packed once into its blocked layout; "mkl": F.linear as it is (or
    PackedLinear(rows=wide_rows) where oneDNN wins the longer products). benchmarks/cpu_engines.py times decoding.
  * "bf16": BF16Linear, a bf16 copy of the weight (packed for oneDNN where the CPU computes bf16 natively); the
    input cast to bf16, the output back to fp32.
  * "int8": Int8Linear, dynamic quantization as CTranslate2's int8: the weight symmetric per output row (int8_rows),
    each input row quantized to uint8 on the fly by its own min and max, products summed in int32, output fp32:
    every row gets all 256 steps, whatever the other rows hold (an outlier token, padding, another request of the
    batch). Below WIDE_ROWS rows on CPUs with AVX512-VNNI (vnni_rows()) duolm.kernels' int8 kernel does it all in one
    call; elsewhere torch's x86 int8 kernels (fbgemm's; from WIDE_ROWS rows oneDNN's where the CPU has AMX int8 tiles,
    amx_int8), which take one scale and zero point for the whole input: each row is first mapped onto [0, 1] and the
    output mapped back (row_affine).
The matmul inputs are the only activations that change precision: LayerNorms, softmax, the residual stream and
the KV cache stay fp32; embedding lookups read the fp32 table.

Where a kernel is PyTorch-private (oneDNN's matmul, the quantized engine), it is tried once on a tiny input
(duolm.engines.onednn_runs, _works); where it is missing or fails, the module runs the same arithmetic in public
torch ops (the same numbers: tests/test_precision.py) and a warning says so once.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import platform
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from duolm import kernels
from duolm.engines import (FEW_ROWS, fp32_choice, on_rows, onednn_linear, onednn_rows, onednn_runs, pack_onednn,
                           works)
from duolm.kernels import cpuinfo as _cpuinfo
from duolm.models.gpt2 import OneQueryAttention, TiedLinear

PRECISIONS = ("auto", "fp32", "bf16", "int8")
KERNEL_ROWS = FEW_ROWS
TRAINING = ("auto", "fp32", "bf16")


def native_bf16(device) -> bool:
    """Whether `device` computes bf16 matmuls natively: CUDA with bf16 support, or a CPU that has AVX512-BF16 or
    AMX tiles and on which torch dispatches its AVX-512 kernels (torch.backends.cpu.get_cpu_capability(): under
    ATEN_CPU_CAPABILITY=avx2 the same CPU has no bf16 kernels). Elsewhere bf16 is emulated and slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    flags = (_cpuinfo("flags") or "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine() -> dict:
    """What a measurement ran on: {"cpu": the model name, "capability": what torch dispatches, "native_bf16",
    "threads": torch's intra-op threads} (benchmarks print it; result files record it)."""
    name = _cpuinfo("model name") or platform.processor() or platform.machine()
    return {"cpu": name, "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16("cpu"),
            "threads": torch.get_num_threads()}


def resolve(precision: str, device, training: bool) -> str:
    """The precision "auto" stands for, others as given (checked): for training bf16 where the device computes it
    natively (native_bf16) and fp32 elsewhere; for inference fp32 (exact). Deterministic for a machine, so a
    resumed run continues in the precision it started in. Called once, where a job starts."""
    allowed = TRAINING if training else PRECISIONS
    if precision not in allowed:
        raise ValueError(f"precision {precision!r} is not one of {allowed}"
                         + (" (int8 is for inference only)" if precision == "int8" else ""))
    if precision != "auto":
        return precision
    return "bf16" if training and native_bf16(device) else "fp32"


def autocast(precision: str, device):
    """The context a training forward runs in: torch.autocast to bf16 for "bf16", nothing for "fp32"."""
    if precision not in TRAINING[1:]:
        raise ValueError(f"training precision {precision!r} is not one of {TRAINING[1:]} (resolve it first)")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# private kernels, each tried once

@functools.cache
def _works(kernel: str) -> bool:
    """Whether a private torch kernel ("int8": the quantized engine) exists here and runs; warns once where not."""
    return works(f"{kernel} kernel", lambda: _int8_linear(torch.randn(2, 8), _int8_pack(*int8_rows(torch.randn(4, 8))),
                                                          False), "running the same arithmetic in public torch ops")


def wide_rows(m: int) -> int | None:
    """PackedLinear's rule where F.linear (MKL) is the faster for few rows and oneDNN for more: None (F.linear) up to
    KERNEL_ROWS rows, onednn_rows(m) above.

    >>> [wide_rows(m) for m in (1, 32, 33, 100)]
    [None, None, 33, 104]
    """
    return onednn_rows(m) if m > KERNEL_ROWS else None


def _plain(x: torch.Tensor) -> bool:
    """Whether a forward on x takes F.linear rather than a packed weight: autograd on (training), or under
    torch.compile (inductor lowers only weights it packed)."""
    return (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling()


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w (N, K) ~= q (N, K) * scale (N,), |q| <= 127; an all-zero
    row (GPT-2's vocabulary padding) gets q = 0.

    >>> q, s = int8_rows(torch.tensor([[0.5, -1.27], [0.0, 0.0]]))
    >>> q.tolist(), [round(x, 4) for x in s.tolist()]
    ([[50, -127], [0, 0]], [0.01, 0.0])
    """
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scale.clamp(min=1e-12)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def _int8_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, engine: str | None = None):
    """A quantized engine's packed form of q * scale, with the bias it adds to each output: the engine torch is set
    to (x86: fbgemm's kernels), or `engine` ("onednn"). Quantized tensors are deprecated upstream; the tested torch
    has them, and _works() falls back where they are gone."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q, scale.clamp(min=1e-12).double(),
                                                      torch.zeros(len(q), dtype=torch.long), 0)
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine or before
    try:
        return torch.ops.quantized.linear_prepack(qw, bias)
    finally:
        torch.backends.quantized.engine = before


def vnni_rows() -> bool:
    """Whether Int8Linear runs duolm.kernels' int8 kernel here: the CPU has AVX512-VNNI and the kernels build."""
    flags = _cpuinfo("flags") or ""
    return kernels.int8_supported(flags) and kernels.available(flags)


def amx_int8() -> bool:
    """Whether the CPU has AMX int8 tiles and torch its oneDNN quantized engine, whose int8 kernel runs on them:
    Int8Linear then multiplies WIDE_ROWS rows or more there (prefills, encoders' batches); the x86 engine, fbgemm,
    keeps decoding's few rows, where oneDNN's kernel gained nothing (docs/precision.md)."""
    return "amx_int8" in (_cpuinfo("flags") or "").split() and "onednn" in torch.backends.quantized.supported_engines


WIDE_ROWS = 64


def _int8_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    """The x86 dynamic int8 kernel on a packed weight. Called on an object that is not a tensor (the packed weight),
    torch's dispatcher first asks it for __torch_function__, a lookup that fails by raising an exception, on a
    small matrix at one row costlier than the kernel (docs/benchmarks.md). Subclasses' __torch_function__ is off
    around the call (no subclass can reach inside the kernel), which skips the lookup; modes still see the op."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, reduce_range)


# Without AVX512-VNNI, the x86 kernels multiply u8 x s8 pairs into int16, which 8-bit activations can overflow
# (the kernel then takes 7-bit activations): what torch.cpu._is_vnni_supported() checks, read from the flags
_REDUCE_RANGE = "avx512_vnni" not in (_cpuinfo("flags") or "").split()


_TINY = torch.finfo(torch.float32).tiny


def row_affine(f, row_sums: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for f(v) = v @ W.T + bias (bias None: none), computed as (f(u) - bias) * span + lo * row_sums
    + bias with u = (x - lo) / span, lo and span the min and max - min of each row of x, and row_sums = W.sum(1):
    every row enters f on [0, 1] (a constant row as zeros, its term (f(0) - bias) * span = 0). A single row goes in
    as it is.

    >>> W, b = torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([1.0, 0.0])
    >>> row_affine(lambda v: v @ W.T + b, W.sum(1), torch.tensor([[3.0, 5.0], [2.0, 2.0]]), b).tolist()
    [[14.0, -5.0], [7.0, -2.0]]
    """
    if x.numel() == x.shape[-1]:
        return f(x)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)   # two passes: faster than aminmax(dim=-1)
    span = (hi - lo).clamp_(min=_TINY)                  # no division by 0 for a constant row
    y = f((x - lo) / span)
    if bias is None:
        return torch.addcmul(lo * row_sums, y, span)
    return torch.addcmul(torch.addcmul(bias, lo, row_sums), y.sub_(bias), span)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, reduce_range: bool = False) -> torch.Tensor:
    """x @ (q * scale).T as the x86 dynamic int8 kernel computes it, in public torch ops: x quantized on one
    scale s and zero point z chosen from min(x, 0) and max(x, 0) over [0, 255] ([0, 127] with reduce_range),
    xq = clamp(round(x / s) + z), then s * scale * sum((xq - z) * q), the sums exact (float64).

    >>> int8_matmul(torch.tensor([[0.0, 2.55]]), torch.tensor([[1, -2]], dtype=torch.int8), torch.tensor([0.5]))
    tensor([[-2.5500]])
    """
    qmax = 127 if reduce_range else 255
    lo, hi = x.min().double().clamp(max=0), x.max().double().clamp(min=0)
    s = torch.where(hi > lo, (hi - lo) / qmax, 0.1).float()            # as the kernel: a float scale,
    z = torch.round(-lo / s.double()).clamp(0, qmax).float()           # an integer zero point
    xq = (torch.round(x.float() * (1 / s)) + z).clamp(0, qmax) - z     # x times the float 1/s, rounded to even
    return (xq.double() @ q.double().T * (s.double() * scale.double())).float()


# ---------------------------------------------------------------------------------------------
# the inference linears

class PackedLinear(nn.Module):
    """y = x W^T + b in exact fp32 through oneDNN, W packed once into its blocked layout (few rows' engine "onednn"), a
    product of m rows run at rows(m) rows (onednn_rows, or wide_rows); where rows(m) is None through F.linear on W,
    as are training forwards (autograd on) and forwards under torch.compile (inductor lowers only weights it
    packed)."""

    exportable = False          # torch.export cannot trace oneDNN's packed weight (an opaque tensor) among its buffers

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows=onednn_rows):
        super().__init__()
        self.register_buffer("weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.register_buffer("packed", pack_onednn(weight.detach()))
        self.rows = rows

    def forward(self, x):
        rows = self.rows(x.numel() // x.shape[-1])
        if rows is None or _plain(x):
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.packed, self.bias, rows)

    def extra_repr(self):
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, " \
               f"bias={self.bias is not None}, kernel=onednn fp32, rows={self.rows.__name__}"


class KernelLinear(nn.Module):
    """y = x W^T + b in exact fp32 (within ~1e-6), fp32_choice()["few"] "duolm": up to KERNEL_ROWS rows (decoding, short
    prompts) on duolm.kernels' fp32 kernel (an operator, in compiled graphs too), W packed once; longer inputs on
    oneDNN on the plain W where it is the faster here (wide_onednn: duolm.engines' "wide"; no second copy of W), else
    on F.linear, as are training forwards and forwards under torch.compile."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, wide_onednn: bool = False):
        super().__init__()
        if not kernels.ready():                             # the kernels built and loaded (once), or why not
            raise ValueError("duolm's fp32 kernel does not run on this CPU (AVX-512 and a C++ compiler needed)")
        self.register_buffer("weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.register_buffer("packed", kernels.pack_fp32(weight))
        self.wide_onednn = wide_onednn

    def forward(self, x):
        if x.numel() > KERNEL_ROWS * x.shape[-1] or (torch.is_grad_enabled() and x.requires_grad):
            if self.wide_onednn and not _plain(x):
                return onednn_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        return kernels.fp32_linear(x, self.packed, self.bias, self.weight.shape[0])

    def extra_repr(self):
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, " \
               f"bias={self.bias is not None}, kernel=duolm fp32 up to {KERNEL_ROWS} rows, " \
               f"{'onednn' if self.wide_onednn else 'F.linear'} above"


class BF16Linear(nn.Module):
    """y = float(bf16(x) bf16(W)^T) + b: the product in bf16 (fp32 sums) on a bf16 copy of W, made once; input and
    output fp32. On CPUs that compute bf16 natively (native_bf16) the copy is also packed once into oneDNN's layout
    and run there (F.linear reorders the whole weight at every call: benchmarks/generation.py times both);
    elsewhere, under autograd and under torch.compile, F.linear, which on x86 runs oneDNN too: hence onednn_rows
    either way."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().to(torch.bfloat16)
        self.register_buffer("weight", w)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        on_onednn = w.device.type == "cpu" and native_bf16("cpu") and onednn_runs()
        self.register_buffer("packed", pack_onednn(w) if on_onednn else None)

    def forward(self, x):
        x = x.to(torch.bfloat16)
        if self.packed is None or _plain(x):
            y = on_rows(lambda v: F.linear(v, self.weight), x)
        else:
            y = onednn_linear(x, self.packed, None)
        y = y.float()
        return y if self.bias is None else y + self.bias

    exportable = property(lambda self: self.packed is None)   # torch.export: not with oneDNN's copy (opaque tensor)

    def extra_repr(self):
        kernel = "onednn bf16 packed" if self.packed is not None else "F.linear bf16"
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, " \
               f"bias={self.bias is not None}, weight=bf16, kernel={kernel}"


# The int8 kernel as an operator torch.compile calls without looking inside (torch.library.custom_op): dynamo cannot
# trace the packed weight, a TorchScript object, so the operator takes the number of the Int8Linear that holds it, as
# a tensor (a buffer: an input of the graph, not a constant in it, so that models of one shape share their graphs).
_INT8: weakref.WeakValueDictionary = weakref.WeakValueDictionary()     # number -> Int8Linear, gone with the module
_NUMBERS = itertools.count()


@torch.library.custom_op("duolm::int8_linear", mutates_args=())
def _int8_op(x: torch.Tensor, module: torch.Tensor, out_features: int) -> torch.Tensor:
    return _INT8[int(module)].kernel(x)


@_int8_op.register_fake
def _(x, module, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 rows with a scale each (int8_rows), each input row quantized to uint8 by its own
    min and max. Fewer than WIDE_ROWS rows: where the CPU has AVX512-VNNI (vnni_rows()), duolm.kernels' int8 kernel in
    one call. Elsewhere, and from WIDE_ROWS rows, row_affine around torch's x86 dynamic int8 kernel, which adds b
    (under torch.compile as the operator duolm::int8_linear; int8_matmul where that kernel is unavailable): fbgemm's
    packed weight, or from WIDE_ROWS rows oneDNN's where the CPU has AMX int8 tiles (amx_int8; kernel())."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = int8_rows(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("row_sums", (q.float() * scale[:, None]).sum(1))
        bias = None if bias is None else bias.detach().float()
        self.register_buffer("bias", bias)
        self.register_buffer("packed_rows", kernels.pack_int8(q) if vnni_rows() else None)
        quantized = _works("int8")
        wide = _int8_pack(q, scale, bias, engine="onednn") if quantized and amx_int8() else None
        few = self.packed_rows is None or wide is None              # fbgemm's kernel runs some row counts
        # the engines' packed weights (TorchScript objects) in a tuple: torch.export gathers a module's own attributes
        self._packs = (wide, _int8_pack(q, scale, bias) if quantized and few else None)
        self._register()

    packed_wide = property(lambda self: self._packs[0], doc="oneDNN's packed weight (AMX int8 tiles), or None")
    packed = property(lambda self: self._packs[1], doc="the x86 dynamic int8 engine's packed weight, or None")
    # torch.export (the CPU's ahead-of-time step) traces it where duolm's kernel runs it, then at every row count
    exportable = property(lambda self: self.packed_rows is not None)

    def _register(self):
        n = next(_NUMBERS)
        self.register_buffer("number", torch.tensor(n), persistent=False)
        _INT8[n] = self

    def __setstate__(self, state):          # a copy (copy.deepcopy) is registered as a module of its own
        super().__setstate__(state)
        self._register()

    def kernel(self, v):
        """v @ W.T + b by the x86 dynamic int8 kernel: WIDE_ROWS rows or more on oneDNN's packed weight where there is
        one (amx_int8), run at onednn_rows() rows (oneDNN keeps memory for every row count it meets; the zero rows
        added leave the input's scale, and so every row's result, as it is), fewer on the x86 engine's. The two
        compute the same formula, to float rounding."""
        if self.packed_wide is not None and v.numel() >= WIDE_ROWS * v.shape[-1]:
            return on_rows(lambda u: _int8_linear(u, self.packed_wide, _REDUCE_RANGE), v)
        return _int8_linear(v, self.packed, _REDUCE_RANGE)

    def matmul(self, v):
        """v @ W.T + b."""
        if self.packed is None and self.packed_wide is None:
            y = int8_matmul(v, self.qweight, self.scale, _REDUCE_RANGE)
            return y if self.bias is None else y + self.bias
        if torch.compiler.is_compiling():
            return _int8_op(v, self.number, self.qweight.shape[0])
        return self.kernel(v)

    def forward(self, x):
        if self.packed_rows is not None and (torch.compiler.is_exporting() or x.numel() < WIDE_ROWS * x.shape[-1]):
            return kernels.int8_linear(x, self.packed_rows, self.scale, self.row_sums, self.bias)
        return row_affine(self.matmul, self.row_sums, x, self.bias)

    def extra_repr(self):
        kernel = ("AVX512-VNNI rows" if self.packed_rows is not None else
                  "x86 dynamic int8" if self.packed is not None else "int8 in public ops")
        kernel += f", oneDNN (AMX) from {WIDE_ROWS} rows" if self.packed_wide is not None else ""
        return f"in_features={self.qweight.shape[1]}, out_features={self.qweight.shape[0]}, " \
               f"bias={self.bias is not None}, kernel={kernel}"


class KernelAttention(OneQueryAttention):
    """One query's attention over the cache as one call of duolm.kernels (fp32: only the columns the mask shows are
    read), in the eager decoding step too (fused); other dtypes and autograd take the formula."""

    fused = True

    def forward(self, q, k, v, mask):
        if q.dtype == k.dtype == v.dtype == torch.float32 and not q.requires_grad:
            return kernels.one_query_attention(q, k, v, mask)
        return super().forward(q, k, v, mask)


def engines_report() -> dict:
    """What runs the matmuls on this CPU, as quantize() would swap them in (timing the fp32 engines first if this
    machine has no choice kept yet): the machine, the fp32 engines with their timings, int8's engine, attention's."""
    return {"machine": machine(), "fp32": fp32_choice(),
            "int8": "duolm AVX512-VNNI" if vnni_rows() else "torch x86 (fbgemm)" if _works("int8") else "public ops",
            "attention": "duolm" if kernels.ready() else "torch (SDPA, the formula when compiled)"}


def _swap(precision: str, device: torch.device):
    """The module class `precision` swaps a linear for on `device`, None where F.linear is what runs."""
    if precision == "int8":
        if device.type != "cpu":
            raise ValueError(f"precision int8 (the x86 quantized kernels) runs on the CPU only, not {device}")
        return Int8Linear
    if precision == "bf16":
        return BF16Linear
    if precision == "fp32":
        if device.type != "cpu":
            return None
        choice = fp32_choice()
        wide = choice["wide"] == "onednn"
        few = {"duolm": functools.partial(KernelLinear, wide_onednn=wide), "onednn": PackedLinear,
               "mkl": functools.partial(PackedLinear, rows=wide_rows) if wide else None}
        return few[choice["few"]]
    raise ValueError(f"inference precision {precision!r} is not one of {PRECISIONS[1:]} (resolve it first)")


def quantize(model: nn.Module, precision: str) -> nn.Module:
    """Swaps, in place, every nn.Linear of `model` and its tied output layers (TiedLinear) for the module that runs
    `precision` ("fp32", "bf16", "int8": see the module docstring) and returns the model, in eval mode: a model for
    inference, its linears' weights now buffers in the form they run in (save the model before, not after:
    duolm.save refuses one), and on a CPU where duolm.kernels run GPT-2's one-query attention their kernel
    (KernelAttention). print(model) shows what runs; the embeddings, LayerNorms and the rest stay. The first call in
    a process may build duolm.kernels and, once on a machine, time the fp32 engines (duolm.engines): each says so."""
    device = next(model.parameters()).device
    swap = _swap(precision, device)
    attention = device.type == "cpu" and kernels.ready()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in (nn.Linear, TiedLinear) and swap is not None:
                setattr(parent, name, swap(child.weight, child.bias))
            elif type(child) is OneQueryAttention and attention:
                setattr(parent, name, KernelAttention())
    return model.eval()


SWAPPED = (KernelLinear, PackedLinear, BF16Linear, Int8Linear)
