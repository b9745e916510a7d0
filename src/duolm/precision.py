"""Which arithmetic runs the matmuls: exact fp32 through the CPU's fastest kernels, bf16 autocast for
training where the device computes bf16 natively, bf16 weights or int8 matmuls for inference.

    with training("auto", device):        # bf16 autocast where native (CUDA, AVX512-BF16, AMX), else fp32
        loss = objective(model(x), batch)
    with Inference("fp32"):               # the same numbers through oneDNN on CPU, weights packed once
        logits = model(idx)
    with Inference("int8"):               # int8 weights and matmuls: 1 byte per weight read, other numbers
        generate(model, prompts, 64)

Like autocast, both wrap the model from outside: the models call F.linear and never know. Inference
is a torch function mode that catches F.linear under no_grad (every nn.Linear, GPT-2's tied output
layer, BERT's MLM decoder) and runs it on a form of the weight made on first use and kept as long as the
Inference object: it takes the weights as constant (a generation, an evaluation, a server's lifetime), so
make a new one after an optimizer step. (A version-counter check would not do: the fused AdamW kernel
updates weights in place without bumping it.)

  * "fp32": oneDNN's linear on a weight packed into its blocked layout. The same dot products in
    another order (within ~1e-6 of F.linear); PyTorch's fp32 F.linear goes to MKL, whose kernels on
    this project's AMD EPYC reach about half of oneDNN's for the few-row matmuls of decoding
    (benchmarks/cpu_engines.py). Where MKL is the faster of the two (`fp32_engine()` measures once
    per process), fp32 stays on F.linear.
  * "bf16": a bf16 copy of the weight, packed for oneDNN; the input cast to bf16, the output back to fp32.
  * "int8": dynamic quantization, as CTranslate2's int8: the weight symmetric per output row (w ~= q * scale,
    |q| <= 127, int8_rows), each input quantized to uint8 on the fly, products summed in int32 by the x86 int8
    kernels (VNNI where the CPU has it), output fp32. The kernel takes one scale and zero point for the whole
    input, so each row is first mapped onto [0, 1] by its own min and max and the output mapped back
    (row_affine): every row gets all 256 steps, whatever the other rows hold (an outlier token, padding,
    another request of the batch).

The matmul inputs are the only activations that change precision: LayerNorms, softmax, the residual stream
and the KV cache stay fp32 in every mode; embedding lookups read the fp32 table. Modes are per thread (as autocast is): a worker thread enters its own.
"""
from __future__ import annotations

import contextlib
import functools
import platform
import time
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

PRECISIONS = ("auto", "fp32", "bf16", "int8")
TRAINING = ("auto", "fp32", "bf16")


def native_bf16(device) -> bool:
    """Whether `device` computes bf16 matmuls natively: CUDA with bf16 support, or a CPU with
    AVX512-BF16 or AMX tiles (elsewhere bf16 is emulated and slower than fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def machine() -> dict:
    """What a measurement ran on: {"cpu": the model name, "native_bf16": bool, "threads": torch's intra-op
    threads} (benchmarks print it; result files record it)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "native_bf16": native_bf16("cpu"), "threads": torch.get_num_threads()}


def choose(precision: str, device, training: bool) -> str:
    """The precision "auto" stands for, others as given: for training bf16 where the device does it
    natively and fp32 elsewhere; for inference always fp32 (exact)."""
    allowed = TRAINING if training else PRECISIONS
    if precision not in allowed:
        raise ValueError(f"precision {precision!r} is not one of {allowed}"
                         + (" (int8 is for inference only)" if precision == "int8" else ""))
    if precision != "auto":
        return precision
    return "bf16" if training and native_bf16(device) else "fp32"


def training(precision: str, device):
    """The context a training or validation forward runs in: bf16 autocast (weights, optimizer state
    and losses stay fp32) or nothing. `precision` as chosen by choose()."""
    device = torch.device(device)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def inference(precision: str, device):
    """The context a prediction, evaluation, generation or serving forward runs in: on CPU the Inference mode
    of choose(precision, device, training=False); on CUDA fp32 as is or bf16 autocast (int8 is CPU-only)."""
    device = torch.device(device)
    precision = choose(precision, device, training=False)
    if device.type == "cpu":
        return Inference(precision)
    if precision == "int8":
        raise ValueError(f"precision int8 (the x86 quantized kernels) runs on the CPU only, not {device}")
    return training(precision, device)


# ---------------------------------------------------------------------------------------------
# inference kernels

_linear_onednn = torch.ops.mkldnn._linear_pointwise


def _pack_onednn(w):
    # the batch-size hint only picks the blocked layout; one packing serves every row count
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def int8_rows(w: torch.Tensor):
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


def _int8_form(w):
    q, scale = int8_rows(w)
    with warnings.catch_warnings():   # quantized dtypes are deprecated upstream; the pinned torch has them
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q, scale.clamp(min=1e-12).double(),
                                                      torch.zeros(len(q), dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None), (q.float() * scale[:, None]).sum(1)


# Without VNNI, the x86 kernels multiply u8 x s8 pairs into int16, which 8-bit activations can overflow
_REDUCE_RANGE = not torch.cpu._is_vnni_supported()


def row_affine(f, row_sums: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T for f(v) = v @ W.T, computed as f((x - lo) / span) * span + lo * row_sums, with lo and span the
    min and max - min of each row of x (span 1 for a constant row) and row_sums = W.sum(1): every row enters f
    on [0, 1]. A single row goes in as it is.

    >>> W = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    >>> row_affine(lambda v: v @ W.T, W.sum(1), torch.tensor([[3.0, 5.0], [2.0, 2.0]])).tolist()
    [[13.0, -5.0], [6.0, -2.0]]
    """
    if x.numel() == x.shape[-1]:
        return f(x)
    lo, hi = x.aminmax(dim=-1, keepdim=True)
    span = torch.where(hi > lo, hi - lo, 1.0)
    return torch.addcmul(lo * row_sums, f((x - lo) / span), span)


def _linear_int8(x, form, bias):
    packed, row_sums = form
    y = row_affine(lambda v: torch.ops.quantized.linear_dynamic(v.contiguous(), packed, _REDUCE_RANGE), row_sums, x)
    return y if bias is None else y + bias


def _linear_bf16(x, packed, bias):
    y = _linear_onednn(x.to(torch.bfloat16), packed, None, "none", [], "").float()
    return y if bias is None else y + bias


def _linear_fp32(x, packed, bias):
    return _linear_onednn(x, packed, bias, "none", [], "")


# precision -> (weight -> its form, (x, form, bias) -> y)
_FORMS = {
    "fp32": (_pack_onednn, _linear_fp32),
    "bf16": (lambda w: _pack_onednn(w.to(torch.bfloat16)), _linear_bf16),
    "int8": (_int8_form, _linear_int8),
}


@functools.cache
def fp32_engine(rows: tuple = (1, 8, 256), n_in: int = 768, n_out: int = 3072, repeats: int = 5) -> str:
    """"onednn" if oneDNN's linear on a packed weight beats F.linear (MKL) on this CPU by more than 10%, summed
    over decoding-sized and prefill-sized matmuls (best of `repeats` each), else "mkl". Measured once per
    process; a ~(n_in x n_out) weight is what GPT-2 and BERT blocks multiply. The margin keeps the choice
    (and so the last bits of the numbers) the same from one process to the next on a given CPU."""
    if not torch.backends.mkldnn.is_available():
        return "mkl"
    w = torch.randn(n_out, n_in)
    packed = _pack_onednn(w)
    spent = {"mkl": 0.0, "onednn": 0.0}
    for m in rows:
        x = torch.randn(m, n_in)
        for name, f in (("mkl", lambda: F.linear(x, w)), ("onednn", lambda: _linear_fp32(x, packed, None))) * 2:
            f()
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t)
            spent[name] += best / 2
    return "onednn" if spent["onednn"] < spent["mkl"] / 1.1 else "mkl"


class Inference(TorchFunctionMode):
    """Runs F.linear on CPU under no_grad in `precision` ("fp32", "bf16", "int8"; see the module
    docstring); anything else (autograd, autocast regions, other devices, other dtypes) as usual.
    engine: for "fp32", "onednn" or "mkl" (F.linear unchanged); None measures once (fp32_engine).
    Enter it in the thread that runs the model: `with Inference("int8"): ...`. One instance can be entered
    again and by several threads at once, which share its weight forms (made once, kept while it lives): the
    weights must not change during its life."""

    def __init__(self, precision: str = "fp32", engine: str | None = None):
        super().__init__()
        if precision not in _FORMS:
            raise ValueError(f"inference precision {precision!r} is not one of {tuple(_FORMS)}")
        if precision == "fp32" and engine is None:
            engine = fp32_engine()
        if engine not in (None, "onednn", "mkl"):
            raise ValueError(f"engine {engine!r} is not one of ('onednn', 'mkl')")
        self.precision = precision
        self.engine = engine
        self.active = not (precision == "fp32" and engine == "mkl")
        self.make, self.linear = _FORMS[precision]
        self.forms = {}                      # id(weight) -> (data_ptr, form)

    def form(self, w: torch.Tensor):
        """The weight's form for this precision, made on its first use; a view (a slice of a weight, made anew
        by every call) gets one for the call only."""
        if w._base is not None:
            with torch.no_grad():
                return self.make(w.detach())
        hit = self.forms.get(id(w))
        if hit is None or hit[0] != w.data_ptr():       # (a new tensor at a dead one's id has its own data)
            with torch.no_grad():
                hit = self.forms[id(w)] = (w.data_ptr(), self.make(w.detach()))
        return hit[1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.active and not torch.is_grad_enabled():
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.dim() == 2
                    and not torch.is_autocast_enabled("cpu")):
                return self.linear(x, self.form(w), bias)
        return func(*args, **kwargs)
