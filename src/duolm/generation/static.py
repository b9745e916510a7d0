"""The decode step in shapes that never change, compiled once and, on a GPU, replayed as one CUDA graph.

Decoding one token of GPT-2 124M is ~200 small operations around the matrix products; one by one, a GPU spends
its time launching them (gpt-fast's cure, followed here: a static KV cache, one compiled step, CUDA graphs). Every
shape is fixed by a (batch, cache length) pair: the cache is preallocated at a bucketed length L and attended over
its whole length under a mask of the columns each row may see; the write column, the positions and that mask are
tensors the step advances itself, so a step is one graph replay and no Python int enters it.

    state after prefill of P columns:  keys[b, :P] = row b's real tokens, pos[b] = their number, at = P
    one step:                          keys[:, at] = True; logits = model.step(ids, pos, keys, cache, at);
                                       pos += 1; at += 1

generate's prefill stays eager (once per generation), writing into the same cache. A StaticDecoder keeps one compiled
step per model and one captured graph per (batch, cache length) bucket, reused across generations. On the CPU, where
there is no graph to replay, the step is compiled ahead of time instead (AheadOfTime: torch.export, then AOTInductor's
C++ library, one for batch 1 and one for a range of batches, at every cache length): a torch.compile'd step's Python
wrapper and dynamo's checks of its inputs (every weight, every cache) are time a CPU step spends outside its kernels
(docs/benchmarks.md). A StaticDecoder also prefills one prompt at a time at bucketed lengths (16, 32, ... up to
block_size: the prompt right-padded, which causal attention keeps from its real positions), compiled and on CUDA
replayed as a graph: what a server runs for every joining request (duolm.serve.scheduler), where an eager prefill
would launch a forward's ~200 operations one by one.
"""
from __future__ import annotations

import logging
import statistics
import time
import types
import warnings
import weakref
from collections import OrderedDict

import torch

from duolm.generation.base import device_dtype, last_logits, new_cache

MIN_CACHE = 64          # the shortest cache length; longer ones double up to block_size
MIN_PROMPT = 16         # the shortest bucketed prompt length
# inductor's options for the step and the prefill: the compiled code does not check each input's sizes and strides
# at every call (inductor's size_asserts; a step's inputs are the same tensors at every call, and dynamo's guards have
# checked them: 275 Python calls a GPT-2 124M step, which a CPU's step pays for, a CUDA graph's replay not)
LEAN = {"size_asserts": False}
log = logging.getLogger("duolm.generation")


def isa_options() -> dict:
    """inductor's options that name the vector width torch dispatches on this CPU (cpp.simdlen: 512 under AVX-512,
    256 under AVX2, as inductor would pick; {} elsewhere), so that they are part of its on-disk cache's key. Without
    them a graph compiled and cached by a process on AVX-512 is found again by one held to AVX2
    (ATEN_CPU_CAPABILITY=avx2): inductor reuses the cached code, written for 16 floats a vector, and builds it for 8,
    which leaves half of each vector's outputs unwritten (NaN: tests/test_static.py)."""
    width = {"AVX512": 512, "AVX2": 256}.get(torch.backends.cpu.get_cpu_capability())
    return {"cpp.simdlen": width} if width else {}


def bucket(n: int, smallest: int, block_size: int) -> int:
    """The first of smallest, 2 smallest, 4 smallest, ... that holds n, at most block_size: the lengths a static shape
    is built for. bucket(160, 64, 1024) = 256; bucket(40, 64, 1024) = 64; bucket(900, 64, 1024) = 1024."""
    m = smallest
    while m < n:
        m *= 2
    return min(m, block_size)


def cache_length(needed: int, block_size: int) -> int:
    """The bucketed cache length for `needed` columns: 64, 128, 256, ... up to block_size."""
    return bucket(needed, MIN_CACHE, block_size)


def prompt_length(n: int, block_size: int) -> int:
    """The bucketed length a prompt of n tokens is prefilled at: 16, 32, 64, ... up to block_size."""
    return bucket(n, MIN_PROMPT, block_size)


def prefill(model, idx) -> tuple:
    """A prompt's forward into a cache of its own: idx (B, T) -> (hidden states (B, T, C), each layer's keys,
    each layer's values (B, n_head, T, head_dim))."""
    cache = new_cache(model, idx.shape[0], idx.shape[1], *device_dtype(model))
    return model.hidden(idx, None, cache), cache.k, cache.v


def advance(model, cache, ids, pos, at, keys) -> torch.Tensor:
    """One static step: ids (B, 1) in at column `at`; returns fp32 logits (B, V) and advances pos, at."""
    keys.index_fill_(1, at, True)
    logits = model.step(ids, pos, keys, cache, at)[:, 0].float()
    pos.add_(1)
    at.add_(1)
    return logits


_OWN: dict = {}         # (function, print(model)) -> the function under a code object of its own


def own_code(fn, model, *tags):
    """fn (advance, prefill) with a code object of its own for each structure of model (print(model): its modules,
    their shapes and kernels) and each of the `tags` given (a prompt length). Dynamo keeps at most 8 graphs a code
    object (torch._dynamo.config.recompile_limit); one code object for every model would make the ninth model of
    another shape in a process fail (fullgraph). Models of one structure share theirs, and their graphs."""
    key = (fn.__name__, repr(model), *tags)
    if key not in _OWN:
        _OWN[key] = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    return _OWN[key]


def _captured(call, run):
    """PyTorch's CUDA graph recipe: call() three times on a side stream (warm-up), then run() recorded -> (the graph,
    run()'s outputs, which each replay overwrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # other threads may use CUDA
        out = run()
    return graph, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StaticStep:
    """One (batch, cache length) bucket: the cache, the step's input tensors (`ids`, `pos`, `at`, `keys`: see the
    module's doc) and, on CUDA, its captured graph. The tensors are fixed: a caller writes into them, never
    rebinds them."""

    def __init__(self, model, step_fn, cache, ids, pos, at, keys):
        self._model = weakref.ref(model)           # a decoder kept for a model must not keep it alive
        self.cache, self.ids, self.pos, self.at, self.keys = cache, ids, pos, at, keys
        self._fn = step_fn
        self.graph: torch.cuda.CUDAGraph | None = None

    @classmethod
    def allocate(cls, model, step_fn, batch: int, length: int) -> "StaticStep":
        """A step with buffers of its own; the cache zeroed (masked columns are still multiplied by 0: no NaN may
        sit there)."""
        device, dtype = device_dtype(model)
        cache = new_cache(model, batch, length, device, dtype)
        for buf in cache.k + cache.v:
            buf.zero_()
        return cls(model, step_fn, cache, torch.zeros(batch, 1, dtype=torch.long, device=device),
                   torch.zeros(batch, 1, dtype=torch.long, device=device),
                   torch.zeros(1, dtype=torch.long, device=device),
                   torch.zeros(batch, length, dtype=torch.bool, device=device))

    def _run(self) -> torch.Tensor:
        return self._fn(self._model(), self.cache, self.ids, self.pos, self.at, self.keys)

    def warm(self) -> None:
        """Compile the step (a first call) and, on CUDA, capture it: warm-up calls on a side stream, then one step
        recorded (PyTorch's CUDA graph recipe). Each call writes the cache at column `at` only (set it to the column
        the next real step writes) and the state is put back after it."""
        state = [t.clone() for t in (self.pos, self.at, self.keys)]

        def call():
            self._run()
            for t, saved in zip((self.pos, self.at, self.keys), state):
                t.copy_(saved)
        if self.ids.device.type != "cuda":
            call()
            return
        self.graph, self.out = _captured(call, self._run)

    def seconds(self, calls: int = 5) -> float:
        """The median seconds of a step (a graph's replay where captured), each call put back as in warm()."""
        state = [t.clone() for t in (self.pos, self.at, self.keys)]
        times = []
        for _ in range(calls):
            _sync(self.ids.device)
            start = time.perf_counter()
            if self.graph is None:
                self._run()
            else:
                self.graph.replay()
            _sync(self.ids.device)
            times.append(time.perf_counter() - start)
            for t, saved in zip((self.pos, self.at, self.keys), state):
                t.copy_(saved)
        return statistics.median(times)

    def prefill(self, idx: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Run the (left-padded) prompts eagerly into the cache's first columns -> their last logits (B, V)."""
        P = idx.shape[1]
        self.cache.length = 0
        logits = last_logits(self._model(), idx, mask, self.cache)
        self.keys.zero_()
        self.keys[:, :P] = True if mask is None else mask.bool()
        self.pos.copy_(self.keys.sum(1, keepdim=True))
        self.at.fill_(P)
        return logits

    def step(self, nxt: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ids (B,) (None: `ids` already holds them) -> the next logits (B, V) (on CUDA a view of the graph's
        output, which the next step overwrites)."""
        if nxt is not None:
            self.ids.copy_(nxt[:, None])
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.out


class StaticPrefill:
    """One bucketed prompt length of a one-row prefill: the prompt written into `idx` right-padded with id 0, run
    through the compiled prefill() and, on CUDA, its captured graph; the outputs cut back to the prompt's length."""

    def __init__(self, model, fn, length: int):
        self._model = weakref.ref(model)
        self._fn = fn
        self.idx = torch.zeros(1, length, dtype=torch.long, device=device_dtype(model)[0])
        self.graph: torch.cuda.CUDAGraph | None = None

    def _run(self):
        return self._fn(self._model(), self.idx)

    def warm(self) -> None:
        """Compile (a first call) and, on CUDA, capture."""
        if self.idx.device.type != "cuda":
            self._run()
            return
        self.graph, self.out = _captured(self._run, self._run)

    def __call__(self, prompt: list) -> tuple:
        """-> (hidden states (1, P, C), keys, values per layer (1, n_head, P, head_dim)) of the P ids of `prompt`, views
        of buffers the next call of this length overwrites."""
        P = len(prompt)
        self.idx.zero_()
        self.idx[0, :P] = torch.tensor(prompt, dtype=torch.long)
        if self.graph is None:
            h, k, v = self._run()
        else:
            self.graph.replay()
            h, k, v = self.out
        return h[:, :P], [t[:, :, :P] for t in k], [t[:, :, :P] for t in v]


class _Step(torch.nn.Module):
    """advance() over `model`, the cache as two tuples of tensors: the module torch.export traces."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, pos, at, keys, k, v):
        return advance(self.model, types.SimpleNamespace(k=list(k), v=list(v)), ids, pos, at, keys)


_PACKAGES: dict = {}        # (print(model), block_size) -> [(fewest rows, most rows, AOTInductor package file)]


def _package(model, batch: int) -> str:
    """An AOTInductor package of the step that runs `batch` rows, compiled on first need: torch.export traces advance()
    at `batch` rows with the batch and the cache's length dynamic where the model lets them be (a batch of 1 stays 1;
    a module that branches on its rows, as KernelLinear at KERNEL_ROWS, bounds the batch), and AOTInductor compiles it
    into a C++ library, its constants left out (the model's own tensors are loaded into it). Kept in a process for
    each structure of model (print(model)) and range of batches."""
    key = (repr(model), model.config.block_size)
    for lo, hi, path in _PACKAGES.get(key, []):
        if lo <= batch <= hi:
            return path
    with torch.inference_mode(False), torch.no_grad():          # export traces tensors made outside inference mode
        ex = StaticStep.allocate(model, advance, batch, cache_length(1, model.config.block_size))
        Dim = torch.export.Dim
        auto, length, n = Dim.AUTO if batch > 1 else Dim.STATIC, Dim.AUTO, len(ex.cache.k)
        program = torch.export.export(
            _Step(model), (ex.ids, ex.pos, ex.at, ex.keys, tuple(ex.cache.k), tuple(ex.cache.v)), strict=False,
            dynamic_shapes=({0: auto}, {0: auto}, None, {0: auto, 1: length}, ({0: auto, 2: length},) * n,
                            ({0: auto, 2: length},) * n))
    rows = next(node for node in program.graph.nodes if node.op == "placeholder"
                and node.name == program.graph_signature.user_inputs[0]).meta["val"].shape[0]
    bounds = program.range_constraints.get(rows.node.expr) if isinstance(rows, torch.SymInt) else None
    lo, hi = (batch, batch) if bounds is None else (int(bounds.lower), float(bounds.upper))
    path = torch._inductor.aoti_compile_and_package(
        program, inductor_configs={"aot_inductor.package_constants_in_so": False} | isa_options())
    _PACKAGES.setdefault(key, []).append((lo, hi, path))
    return path


class AheadOfTime:
    """The step compiled ahead of time by AOTInductor (a _package: its batches, every cache length): the whole step
    in C++, no Python between its kernels and no guards to check (what a torch.compile'd step pays at every call),
    its constants the model's own tensors, loaded, not copied. Called as advance (model, cache, ids, pos, at, keys;
    the model is the one loaded)."""

    def __init__(self, model, package: str):
        with warnings.catch_warnings():     # torch's own use of a deprecated pytree name, as it reads the package
            warnings.simplefilter("ignore", FutureWarning)
            self.runner = torch._inductor.aoti_load_package(package)
        step = _Step(model)
        # kept here: the runner holds their pointers only (user_managed)
        self.tensors = dict(step.named_parameters()) | dict(step.named_buffers())
        self.runner.load_constants({name: self.tensors[name] for name in self.runner.get_constant_fqns()},
                                   check_full_update=True, user_managed=True)

    def __call__(self, model, cache, ids, pos, at, keys) -> torch.Tensor:
        return self.runner(ids, pos, at, keys, tuple(cache.k), tuple(cache.v))


def exportable(model) -> bool:
    """Whether torch.export can trace `model`'s step: no module of it says it cannot (an `exportable` False, as
    duolm.precision's Int8Linear on torch's packed int8 weights)."""
    return all(getattr(m, "exportable", True) for m in model.modules())


class StaticDecoder:
    """The static steps of one GPT-2: compiled once (torch.compile, fullgraph; on the CPU ahead of time where
    torch.export can trace the model: `ahead`), one StaticStep per (batch, cache length) bucket, kept across
    generations (the `max_steps` most recent), and one StaticPrefill per bucketed prompt length (torch.compile's).
    `compile_s` counts the seconds spent building them (compiling, warming up, capturing); `built` how many were
    built. A compiled step is kept where it is the faster: each (batch, cache length) times it against the same step
    run op by op (`advance` uncompiled: on a CPU as fast as generate's eager step, whose attention reads only the
    columns a row sees), once, and says which it keeps (`compiled`: key -> True where compiled won)."""

    keep_faster = True                              # False: keep every compiled step untimed (the tests of compile)

    def __init__(self, model, compile: bool = True, max_steps: int = 8):
        self._model = weakref.ref(model)
        # on the CPU, the steps compiled ahead of time (a runner per package), where torch.export can trace the model
        self.ahead = compile and device_dtype(model)[0].type == "cpu" and exportable(model)
        self._fn = torch.compile(own_code(advance, model), fullgraph=True, options=LEAN | isa_options()) \
            if compile and not self.ahead else advance
        self._ahead_fns: dict = {}                  # package -> its AheadOfTime step
        self._compile = compile
        self._prefills: dict = {}                   # bucketed prompt length -> StaticPrefill
        self._steps: OrderedDict = OrderedDict()
        self.max_steps = max_steps
        self.compile_s = 0.0
        self.built = 0
        self.compiled: dict = {}                    # (batch, cache length) -> whether the compiled step is kept

    def _build(self, make):
        t = time.perf_counter()
        with torch.inference_mode():
            step = make()
            step.warm()
            if isinstance(step, StaticStep) and self._compile and self.keep_faster:
                self._keep_faster(step)
        self.compile_s += time.perf_counter() - t
        self.built += 1
        return step

    def _keep_faster(self, step: StaticStep) -> None:
        """`step` compiled where that is the faster for its (batch, cache length), else run op by op (advance);
        timed on the first step of that shape, alternating, and said in one line."""
        key = (step.ids.shape[0], step.keys.shape[1])
        if key not in self.compiled:
            compiled, graph = step._fn, step.graph
            times = {"compiled": [], "eager": []}
            for _ in range(3):
                step._fn, step.graph = compiled, graph
                times["compiled"].append(step.seconds())
                step._fn, step.graph = advance, None
                times["eager"].append(step.seconds())
            step._fn, step.graph = compiled, graph
            ms = {k: 1e3 * min(v) for k, v in times.items()}
            self.compiled[key] = ms["compiled"] <= ms["eager"]
            log.warning("duolm: the decode step of batch %d, cache length %d: compiled %.2f ms, eager %.2f ms: "
                        "keeping the %s one", *key, ms["compiled"], ms["eager"],
                        "compiled" if self.compiled[key] else "eager")
        if not self.compiled[key]:
            step._fn, step.graph = advance, None

    def _step_fn(self, batch: int):
        """The step function of `batch` rows: the AheadOfTime step of its package (loaded on first use, then kept) or
        the shared one."""
        if not self.ahead:
            return self._fn
        package = _package(self._model(), batch)
        if package not in self._ahead_fns:
            self._ahead_fns[package] = AheadOfTime(self._model(), package)
        return self._ahead_fns[package]

    def get(self, batch: int, needed: int) -> StaticStep:
        """The step for `batch` rows and at least `needed` cache columns, with buffers of its own (built on first
        use, then kept)."""
        model = self._model()
        key = (batch, cache_length(needed, model.config.block_size))
        if key not in self._steps:
            self._steps[key] = self._build(lambda: StaticStep.allocate(model, self._step_fn(batch), *key))
            while len(self._steps) > self.max_steps:
                self._steps.popitem(last=False)
        self._steps.move_to_end(key)
        return self._steps[key]

    def prefill(self, prompt: list) -> tuple:
        """One prompt (P ids, P <= block_size) prefilled at its bucketed length (prompt_length; built on first use, then
        kept) -> (hidden states (1, P, C), keys, values per layer (1, n_head, P, head_dim)): views that the next prompt
        of its bucket overwrites."""
        model = self._model()
        length = prompt_length(len(prompt), model.config.block_size)
        if length not in self._prefills:        # a code object a length: its one graph, never dynamic shapes
            fn = torch.compile(own_code(prefill, model, length), fullgraph=True, dynamic=False,
                               options=LEAN | isa_options()) \
                if self._compile else prefill
            self._prefills[length] = self._build(lambda: StaticPrefill(model, fn, length))
        return self._prefills[length](prompt)

    def bind(self, cache, ids, pos, at, keys) -> StaticStep:
        """A step over the caller's buffers (a server's batch: views of its first rows); built, not kept. An
        ahead-of-time step reads its inputs in the layout it was compiled for: contiguous."""
        if self.ahead and not all(t.is_contiguous() for t in (ids, pos, at, keys, *cache.k, *cache.v)):
            raise ValueError("a step compiled ahead of time runs on contiguous buffers: ids, pos, at, keys and the "
                             "cache's tensors")
        return self._build(lambda: StaticStep(self._model(), self._step_fn(ids.shape[0]), cache, ids, pos, at, keys))


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_of(model) -> StaticDecoder:
    """The compiled StaticDecoder of `model`, made on first use and dropped with the model."""
    if model not in _DECODERS:
        _DECODERS[model] = StaticDecoder(model)
    return _DECODERS[model]
