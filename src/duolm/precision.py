"""Which arithmetic runs the matmuls: exact fp32 through the CPU's fastest kernels, bf16 autocast for
training where the device computes bf16 natively, bf16 weights or int8 matmuls for inference.

    with training("auto", device):        # bf16 autocast where native (CUDA, AVX512-BF16, AMX), else fp32;
        loss = objective(model(x), batch) # on CPU inside Training: oneDNN linears, faster dropout masks
    with Inference("fp32"):               # the same numbers through oneDNN on CPU, weights packed once
        logits = model(idx)
    with Inference("int8"):               # int8 weights and matmuls: 1 byte per weight read, other numbers
        generate(model, prompts, 64)

Like autocast, both wrap the model from outside: the models call F.linear and never know. Training (the
end of this file) does the same for a training forward with autograd on. Inference
is a torch function mode that catches F.linear under no_grad (every nn.Linear, GPT-2's tied output
layer, BERT's MLM decoder) and runs it on a form of the weight made on first use and kept as long as the
Inference object: it takes the weights as constant (a generation, an evaluation, a server's lifetime), so
make a new one after an optimizer step. (A version-counter check would not do: the fused AdamW kernel
updates weights in place without bumping it.)

  * "fp32": oneDNN's linear on a weight packed into its blocked layout. The same dot products in
    another order (within ~1e-6 of F.linear); PyTorch's fp32 F.linear goes to MKL, whose kernels on
    this project's AMD EPYC reach about half of oneDNN's for the few-row matmuls of decoding
    (benchmarks/cpu_engines.py). On Intel CPUs, where MKL is the fast path (`fp32_engine()`), fp32 stays on
    F.linear. oneDNN runs a product of m rows on onednn_rows(m) (zero rows added), so that inputs of varied
    length meet a bounded number of shapes: oneDNN keeps memory for every shape it has run.
  * "bf16": a bf16 copy of the weight, packed for oneDNN; the input cast to bf16, the output back to fp32.
  * "int8": dynamic quantization, as CTranslate2's int8: the weight symmetric per output row (w ~= q * scale,
    |q| <= 127, int8_rows), each input quantized to uint8 on the fly, products summed in int32 by the x86 int8
    kernels (VNNI where the CPU has it), output fp32. The kernel takes one scale and zero point for the whole
    input, so each row is first mapped onto [0, 1] by its own min and max and the output mapped back
    (row_affine): every row gets all 256 steps, whatever the other rows hold (an outlier token, padding,
    another request of the batch).

The matmul inputs are the only activations that change precision: LayerNorms, softmax, the residual stream
and the KV cache stay fp32 in every mode; embedding lookups read the fp32 table. Modes are per thread (as autocast
is): a worker thread enters its own.
"""
from __future__ import annotations

import contextlib
import functools
import math
import platform
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
    name = _cpuinfo("model name") or platform.processor() or platform.machine()
    return {"cpu": name, "native_bf16": native_bf16("cpu"), "threads": torch.get_num_threads()}


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo ("model name", "vendor_id"), None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), None)
    except OSError:
        return None


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


@contextlib.contextmanager
def training(precision: str, device, kernels: bool = True):
    """The context a training forward runs in: bf16 autocast (weights, optimizer state and losses stay fp32)
    or none, and on CPU the Training mode (its faster linear and dropout) unless `kernels` is False (a
    torch.compile'd model makes its own). `precision` as chosen by choose()."""
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        if precision == "bf16":
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if kernels and device.type == "cpu":
            stack.enter_context(Training(precision))
        yield


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

def onednn_rows(m: int) -> int:
    """The row count a oneDNN matmul of m rows runs at: m up to 64, above that m rounded up to a step of an eighth
    of the power of two below it (at most 12.5% more rows, padding). oneDNN (through PyTorch) keeps about 1 MB
    for every distinct (rows, weight shape) it has run, in its caches and malloc pages it does not give back; a
    server, an evaluation or fine-tuning on inputs of varied length meets a new row count at almost every batch,
    and the memory grows with each (by hundreds of MB: tests/test_precision.py). Bucketed, the row counts are at
    most 64 + 8 per doubling.

    >>> [onednn_rows(m) for m in (1, 64, 65, 100, 128, 129, 1000, 1024, 1025)]
    [1, 64, 72, 104, 128, 144, 1024, 1024, 1152]
    """
    if m <= 64:
        return m
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _linear_onednn(x, w, bias):
    """torch.ops.mkldnn._linear_pointwise(x, w, bias) on onednn_rows() rows: x padded with zero rows, which the
    result leaves out."""
    m = x.numel() // x.shape[-1]
    rows = onednn_rows(m)
    if rows == m:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    padded = x.new_empty(rows, x.shape[-1])
    padded[:m] = x.reshape(m, -1)
    padded[m:] = 0
    y = torch.ops.mkldnn._linear_pointwise(padded, w, bias, "none", [], "")[:m]
    return y.view(*x.shape[:-1], y.shape[-1])


def _pack_onednn(w, rows: int):
    """w in the layout oneDNN picks for products of `rows` rows; one packing serves every row count. For fp32,
    rows > 1 gives its blocked layout (AB16b64a), read by its AVX-512 kernels whatever the row count, where rows=1
    keeps the plain layout, which a single row reads with AVX2 code (benchmarks/cpu_engines.py times both on
    GPT-2's matrices). bf16 weights keep the layout for rows=1 (not timed against the blocked one)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


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
    y = _linear_onednn(x.to(torch.bfloat16), packed, None).float()
    return y if bias is None else y + bias


# precision -> (weight -> its form, (x, form, bias) -> y)
_FORMS = {
    "fp32": (lambda w: _pack_onednn(w, 64), _linear_onednn),
    "bf16": (lambda w: _pack_onednn(w.to(torch.bfloat16), 1), _linear_bf16),
    "int8": (_int8_form, _linear_int8),
}


def fp32_engine() -> str:
    """"onednn" on x86 CPUs not made by Intel, else "mkl" (plain F.linear). PyTorch's fp32 F.linear calls MKL, which
    on other vendors' CPUs takes slower code paths: on this project's AMD EPYC oneDNN is faster for decoding's
    few-row matmuls (benchmarks/cpu_engines.py, benchmarks/models.py print both), while on Intel CPUs MKL is the
    fast path and stays. A rule rather than a timing, so that every process on a machine makes the same choice
    and a resumed run, an evaluation and a server compute the same numbers bit for bit."""
    if not torch.backends.mkldnn.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return "mkl"
    return "mkl" if _cpuinfo("vendor_id") == "GenuineIntel" else "onednn"


def _engine(precision: str, engine: str | None) -> str | None:
    """An fp32 mode's engine: as given, or fp32_engine()'s when None (other precisions use none)."""
    if precision == "fp32" and engine is None:
        engine = fp32_engine()
    if engine not in (None, "onednn", "mkl"):
        raise ValueError(f"engine {engine!r} is not one of ('onednn', 'mkl')")
    return engine


class Inference(TorchFunctionMode):
    """Runs F.linear on CPU under no_grad in `precision` ("fp32", "bf16", "int8"; see the module
    docstring); anything else (autograd, autocast regions, other devices, other dtypes) as usual.
    engine: for "fp32", "onednn" or "mkl" (F.linear unchanged); None: fp32_engine()'s choice.
    Enter it in the thread that runs the model: `with Inference("int8"): ...`. One instance can be entered
    again and by several threads at once, which share its weight forms (made once, kept while it lives): the
    weights must not change during its life."""

    def __init__(self, precision: str = "fp32", engine: str | None = None):
        super().__init__()
        if precision not in _FORMS:
            raise ValueError(f"inference precision {precision!r} is not one of {tuple(_FORMS)}")
        self.precision = precision
        self.engine = engine = _engine(precision, engine)
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


# ---------------------------------------------------------------------------------------------
# training kernels (CPU)

def dropout_cut(p: float) -> tuple[int, float]:
    """Dropout from 16 random bits per element: an element is kept when its bits, read as an int16, are at
    least `cut`, and kept values are multiplied by `scale` so their mean is the input's. The probability of
    dropping is p rounded to a multiple of 1/65536.

    >>> dropout_cut(0.1)                # 6554 of the 65536 values (-32768 .. -26215) drop: p = 0.100006
    (-26214, 1.1111186463666882)
    """
    drop = round(p * 65536)
    return drop - 32768, 65536 / (65536 - drop)


def dropout_keep(shape, p: float) -> tuple[torch.Tensor, float]:
    """(keep, scale): a bool mask of `shape` and the factor for kept values (dropout_cut), its bits drawn
    from torch's generator (so torch.manual_seed reproduces it and a resumed run continues it) two elements
    per 32-bit draw, where F.dropout on CPU draws a Bernoulli variate per element (several times slower)."""
    n = math.prod(shape)
    bits = torch.randint(-2**31, 2**31, ((n + 1) // 2,), dtype=torch.int32).view(torch.int16)[:n]
    cut, scale = dropout_cut(p)
    return (bits >= cut).view(shape), scale


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    keep, scale = dropout_keep(x.shape, p)
    return torch.where(keep, x, 0.0).mul_(scale)


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention written out (its math path, as PyTorch runs it on CPU whenever dropout is
    on), with _dropout on the attention weights."""
    if enable_gqa:
        raise NotImplementedError("grouped-query attention: GPT-2 and BERT do not use it")
    att = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        attn_mask = torch.ones(att.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        att = att.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        att = att + attn_mask
    att = torch._safe_softmax(att.float(), -1)          # fp32 under autocast too; a row with every key masked
                                                        # attends to nothing, as in SDPA
    return _dropout(att, dropout_p) @ v


class _LinearOneDNN(torch.autograd.Function):
    """y = x W^T + b, its forward and the input's gradient through oneDNN (_linear_onednn on the weight as it is:
    packing each step would cost more than it saves), the weight's gradient through MKL: on this project's AMD
    EPYC each the faster of the two for training's matmuls (benchmarks/models.py)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _linear_onednn(x, w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _linear_onednn(dy, w.t(), None) if ctx.needs_input_grad[0] else None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class Training(TorchFunctionMode):
    """Faster CPU kernels for a training forward, the numbers those of the plain path up to summation order
    and the dropout masks' random bits:
      * F.linear with autograd in fp32 (engine "onednn", as fp32_engine() picks it for inference): _LinearOneDNN.
        Under bf16 autocast PyTorch's linear already runs on oneDNN and is left alone.
      * dropout, F.dropout's and scaled-dot-product attention's: masks from dropout_keep (p to 1/65536).
    training(precision, device) enters it; anything else (no autograd, other devices) runs as usual."""

    def __init__(self, precision: str = "fp32", engine: str | None = None):
        super().__init__()
        if precision not in TRAINING[1:]:
            raise ValueError(f"training precision {precision!r} is not one of {TRAINING[1:]}")
        self.linear = precision == "fp32" and _engine(precision, engine) == "onednn"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.linear and torch.is_grad_enabled():
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.dim() == 2
                    and not torch.is_autocast_enabled("cpu")):
                return _LinearOneDNN.apply(x, w, bias)
        elif func is F.dropout:
            call = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
            x, p = call["input"], call.get("p", 0.5)
            if call.get("training", True) and not call.get("inplace") and 0 < p < 1 and x.device.type == "cpu":
                return _dropout(x, p)
        elif func is F.scaled_dot_product_attention:
            call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args), **kwargs)
            if call.get("dropout_p", 0.0) > 0 and call["query"].device.type == "cpu":
                return _attention(call.pop("query"), call.pop("key"), call.pop("value"), **call)
        return func(*args, **kwargs)
