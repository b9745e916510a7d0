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
    batch). The sums on the int8 engines timed on this machine (duolm.engines.int8_choice()): duolm.kernels' int8
    kernel (AVX2, or AVX-512 with VNNI) or torch._int_mm (int8_mm), the same integers either way.
Whatever the precision, on the CPU, BERT's attention core (SelfAttention, SDPA) becomes ShortAttention: the same
numbers by bert.scores_attention's three products (baddbmm, softmax, bmm) up to the most keys at which they ran
faster than SDPA's fused kernel on this machine (attention_choice(): timed once a machine, kept as the engines are),
SDPA above.
The matmul inputs are the only activations that change precision: LayerNorms, softmax, the residual stream and
the KV cache stay fp32; embedding lookups read the fp32 table.

Where a kernel is PyTorch-private (oneDNN's matmul), it is tried once on a tiny input (duolm.engines.onednn_runs);
where it is missing or fails, the module runs F.linear and a warning says so once.
"""
from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from duolm import kernels
from duolm.engines import (FEW_ROWS, best_times, fp32_choice, int8_choice, int8_mm, int8_rows, json_times, kept_choice,
                           on_rows, onednn_linear, onednn_rows, onednn_runs, pack_onednn)
from duolm.kernels import cpuinfo as _cpuinfo
from duolm.models import bert
from duolm.models.bert import SelfAttention, scores_attention
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
            raise ValueError("duolm's fp32 kernel does not run on this CPU (AVX2 or AVX-512 and a C++ compiler "
                             "needed)")
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


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 rows with a scale each (int8_rows), each row of x mapped onto 0..255 by its own
    min and max and the int32 sums mapped back (duolm.kernels' formula: a row's result is the same whatever the other
    rows hold). The sums by the int8 engines timed on this machine (duolm.engines.int8_choice(): "few" up to
    KERNEL_ROWS rows, "wide" above): "duolm", duolm.kernels' int8 kernel (AVX2, AVX512-VNNI) on W packed once, or
    "torch",
    int8_mm around torch._int_mm (oneDNN's int8 GEMM); both operators that compiled graphs call as they are."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        choice = int8_choice()
        q, scale = int8_rows(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("row_sums", (q.float() * scale[:, None]).sum(1))
        self.register_buffer("q_sums", q.sum(1, dtype=torch.int32))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # duolm's kernel where it loads in this process (built once a machine), else torch's (a warning said why)
        self.engines = tuple(e if e != "duolm" or kernels.ready() else "torch" for e in (choice["few"], choice["wide"]))
        self.register_buffer("packed", kernels.pack_int8(q) if "duolm" in self.engines else None)

    def forward(self, x):
        few = x.numel() <= KERNEL_ROWS * x.shape[-1]
        if (self.engines[0] if few else self.engines[1]) == "duolm":
            return kernels.int8_linear(x, self.packed, self.scale, self.row_sums, self.bias)
        return int8_mm(x, self.qweight, self.scale, self.row_sums, self.bias, self.q_sums)

    def extra_repr(self):
        return f"in_features={self.qweight.shape[1]}, out_features={self.qweight.shape[0]}, " \
               f"bias={self.bias is not None}, kernel={self.engines[0]} int8 up to {KERNEL_ROWS} rows, " \
               f"{self.engines[1]} above"


class KernelAttention(OneQueryAttention):
    """One query's attention over the cache as one call of duolm.kernels (fp32: only the columns the mask shows are
    read), in the eager decoding step too (fused); other dtypes and autograd take the formula."""

    fused = True

    def forward(self, q, k, v, mask):
        if q.dtype == k.dtype == v.dtype == torch.float32 and not q.requires_grad:
            return kernels.one_query_attention(q, k, v, mask)
        return super().forward(q, k, v, mask)


# ---------------------------------------------------------------------------------------------
# BERT's attention: the three products where they beat SDPA here

ATTENTION_LENGTHS = (8, 16, 32, 64, 128, 256)


def time_attention(lengths=ATTENTION_LENGTHS, shape=(32, 12, 64), repeats=5, budget: float = 1.0) -> dict:
    """{"sdpa": {T: seconds}, "scores": {T: seconds}}: SelfAttention (SDPA) and scores_attention at each T of `lengths`
    (duolm.engines.best_times: the two alternating; a sample runs each 512 // T times) on q, k, v as BERT's attention
    passes them: (B, nh, T, hd) views of one (B, T, 3C) projection (shape = (B, nh, hd)) under its bool key mask
    (B, 1, 1, T), a quarter of the rows padded to half their length."""
    B, nh, hd = shape
    g = torch.Generator().manual_seed(0)
    attend: dict[str, Callable[..., torch.Tensor]] = {"sdpa": SelfAttention(), "scores": scores_attention}
    times: dict = {name: {} for name in attend}
    with torch.inference_mode():
        for T in lengths:
            qkv = torch.randn(B, T, 3 * nh * hd, generator=g).split(nh * hd, dim=2)
            q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in qkv)
            mask = torch.ones(B, T, dtype=torch.bool)
            mask[:B // 4, T // 2:] = False
            mask = mask[:, None, None, :]
            calls = max(1, 512 // T)
            runs = {name: lambda f=f: [f(q, k, v, mask) for _ in range(calls)] for name, f in attend.items()}
            for name, t in best_times(runs, repeats, budget).items():
                times[name][T] = t / calls
    return times


def scores_longest(times: dict, margin: float = 0.03) -> int:
    """The longest T up to which scores_attention ran no slower than SDPA at every length in `times` (time_attention's),
    0 where it lost at the shortest. Within `margin` of SDPA counts as no slower: a tie is noise, and the three calls
    stay (as an engine stays before a faster one within 3%: duolm.engines.choose), so that a near tie at the shortest
    length does not hand every length to SDPA.

    >>> scores_longest({"sdpa": {8: 2, 16: 2, 32: 2, 64: 2}, "scores": {8: 2.05, 16: 1.5, 32: 3, 64: 1}})
    16
    """
    longest = 0
    for T in sorted(times["sdpa"]):
        if times["scores"][T] > times["sdpa"][T] * (1 + margin):
            break
        longest = T
    return longest


@functools.cache
def attention_choice(cache: Path | None = None) -> dict:
    """This machine's BERT attention: {"longest": the most keys ShortAttention runs scores_attention at
    (scores_longest), "times", "key"}, timed once a machine and kept on disk as the fp32 and int8 engines are
    (duolm.engines.kept_choice, kind "attention", keyed by the sources of this file and of models/bert.py too: the
    timing and the rule are here, the two ways of attending there)."""
    def measure():
        times = time_attention()
        longest = scores_longest(times)
        return {"longest": longest, "times": json_times(times)}, ShortAttention.runs(longest)
    return kept_choice("attention", cache, measure, lambda kept: type(kept.get("longest")) is int,
                       (Path(__file__), Path(bert.__file__)))


class ShortAttention(SelfAttention):
    """SelfAttention's numbers (within 1e-5) by scores_attention (baddbmm, softmax, bmm) up to `longest` keys, where
    those three calls ran faster than SDPA's fused kernel on this machine (attention_choice()), and by SDPA above;
    training forwards (self.training, autograd on q), dtypes other than fp32 and devices other than the CPU take
    SelfAttention's path."""

    def __init__(self, longest: int, dropout: float = 0.0):
        super().__init__(dropout)
        self.longest = longest

    @staticmethod
    def runs(longest: int) -> str:
        """What a ShortAttention of `longest` runs, in words."""
        return f"scores_attention up to {longest} keys, SDPA above" if longest else "SDPA at every length"

    def forward(self, q, k, v, mask=None):
        if (k.shape[2] <= self.longest and q.dtype == torch.float32 and q.device.type == "cpu"
                and not (self.training or q.requires_grad)):
            return scores_attention(q, k, v, mask)
        return super().forward(q, k, v, mask)

    def extra_repr(self):
        return self.runs(self.longest)


def engines_report() -> dict:
    """What runs the matmuls on this CPU, as quantize() would swap them in (timing the engines first if this machine
    has no choice kept yet): the machine, the fp32 and int8 engines with their timings, attention's engines (GPT-2's
    decoding; BERT's, ShortAttention's, with its timings under "bert_attention")."""
    decoding = "duolm" if kernels.ready() else "torch (SDPA, the formula when compiled)"
    bert = attention_choice()
    return {"machine": machine(), "fp32": fp32_choice(), "int8": int8_choice(),
            "attention": f"{decoding}; BERT's: {ShortAttention.runs(bert['longest'])} (timed on this machine)",
            "bert_attention": bert}


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
    duolm.save refuses one), on a CPU where duolm.kernels run GPT-2's one-query attention their kernel
    (KernelAttention), and on a CPU BERT's attention core ShortAttention. print(model) shows what runs; the embeddings,
    LayerNorms and the rest stay. The first call in a process may build duolm.kernels and, once on a machine, time the
    fp32 engines (duolm.engines) and BERT's attention (attention_choice): each says so."""
    device = next(model.parameters()).device
    swap = _swap(precision, device)
    attention = device.type == "cpu" and kernels.ready()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in (nn.Linear, TiedLinear) and swap is not None:
                setattr(parent, name, swap(child.weight, child.bias))
            elif type(child) is OneQueryAttention and attention:
                setattr(parent, name, KernelAttention())
            elif type(child) is SelfAttention and device.type == "cpu":
                setattr(parent, name, ShortAttention(attention_choice()["longest"], child.dropout))
    return model.eval()


SWAPPED = (KernelLinear, PackedLinear, BF16Linear, Int8Linear)
