"""ONNX export: a model's graph for ONNX Runtime, checked against the model before it is written.

`export(model, path)` writes path/onnx/model.onnx (and, for an embedding model, path/onnx/embedding.onnx); beside
them duolm.checkpoint.save(format="onnx") writes the Hugging Face files the loaders read (config.json, the tokenizer's
files, sentence-transformers' modules.json and pooling folders). Inputs and outputs are named as optimum's exports
name them (B batch, T tokens, N choices, P past tokens, V vocabulary, C width, h heads, d head width):

    Bert                 input_ids, attention_mask, token_type_ids (B, T) -> last_hidden_state (B, T, C),
                         pooler_output (B, C)
    BertForPreTraining   the same inputs -> logits (B, T, V) (masked LM), seq_relationship_logits (B, 2)
    BertForSequence      -> logits (B, labels), a regressor's (B, 1)
    BertForTokens        -> logits (B, T, labels)
    BertForSpans         -> start_logits, end_logits (B, T)
    BertForChoice        input_ids, attention_mask, token_type_ids (B, N, T) -> logits (B, N)
    BertForEmbedding     model.onnx: -> last_hidden_state (B, T, C), which sentence-transformers' ONNX backend pools
                         and normalises by its modules beside; embedding.onnx: -> sentence_embedding (B, C), pooled
                         and normalised inside, for a runtime that has neither
    GPT2, cache=True     input_ids (B, T), attention_mask (B, P + T), past_key_values.{i}.key / .value (B, h, P, d)
                         -> logits (B, T, V), present.{i}.key / .value (B, h, P + T, d); P may be 0 (the prompt)
    GPT2, cache=False    input_ids, attention_mask (B, T) -> logits (B, T, V)
    GPT2ForSequence      input_ids, attention_mask (B, T), right-padded ((B, 2, T) when trained on both orders)
                         -> logits (B, labels)

BERT pads on the right, GPT-2's language model on the left (positions count real tokens), as duolm does. Every axis
but the widths is dynamic. The exporter is torch.onnx.export(dynamo=True): torch.export traces the model's own
forward, onnxscript translates it at opset OPSET. Each graph is run in ONNX Runtime on sample inputs (the traced batch,
one row, and a padded batch of other lengths) and compared with the model before it is moved into place: a model
that does not export, or a graph that does not give the model's numbers, is a ValueError naming the model, and
nothing is written. `quantize(model, path)` adds dynamic int8 graphs (ONNX Runtime's quantize_dynamic) and returns
how they agree with the model's fp32 outputs. onnx, onnxruntime and onnxscript (the `onnx` extra) are imported here
only, when an export runs.
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from duolm.models import GPT2, Bert, BertForPreTraining
from duolm.models.heads import (BertForChoice, BertForEmbedding, BertForSequence, BertForSpans, BertForTokens,
                                GPT2ForSequence)

OPSET = 18
FOLDER = "onnx"                   # where sentence-transformers' ONNX backend and optimum(subfolder="onnx") look
TOLERANCE = 1e-4                  # largest |ONNX Runtime - duolm| on a sample, times max(1, largest |duolm|)
QUANTIZED = "_quantized"          # model.onnx -> model_quantized.onnx (optimum's and transformers.js' name)
EXTRA = "ONNX export needs duolm's onnx extra (onnx, onnxruntime, onnxscript): pip install 'duolm[onnx]'"
BERT_AXES = {0: "batch_size", 1: "sequence_length"}


@dataclass
class Graph:
    """One ONNX graph: `module(*inputs)` -> a tuple of outputs, traced on samples[0] and checked on every sample;
    axes: per input, its dynamic axes by name."""
    file: str
    module: nn.Module
    inputs: list[str]
    outputs: list[str]
    axes: list[dict[int, str]]
    samples: list[tuple]


@dataclass(frozen=True)
class Agreement:
    """How an int8 graph's first output agrees with the model's fp32 one on the sample inputs: the least cosine
    similarity of its rows (vectors along the last axis; a regressor's scores as one vector), and the share of rows
    whose largest entry is fp32's (logits; None for states and embeddings)."""
    file: str
    output: str
    cosine: float
    top1: float | None


class _Call(nn.Module):
    """fn(model, *inputs) as a module torch.export traces."""

    def __init__(self, model: nn.Module, fn: Callable):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs):
        out = self.fn(self.model, *inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Past:
    """A KVCache (duolm.models.gpt2) over the graph's past_key_values: each layer's buffers are the past with room
    for the T new positions after it, where GPT2.hidden writes them; the filled buffers are the present."""

    def __init__(self, past: tuple, T: int):
        grow = lambda x: torch.cat([x, x.new_zeros(*x.shape[:2], T, x.shape[3])], 2)        # noqa: E731
        self.k, self.v = [grow(x) for x in past[0::2]], [grow(x) for x in past[1::2]]
        self.length = past[0].shape[2]

    batch_size = property(lambda self: self.k[0].shape[0])
    max_len = property(lambda self: self.k[0].shape[2])


def _gpt2_step(model, ids, mask, *past):
    cache = _Past(past, ids.shape[1])
    logits = model(ids, mask, cache)
    return (logits, *[x for kv in zip(cache.k, cache.v) for x in kv])


def _gpt2_classify(model, ids, mask):
    """GPT2ForSequence.classify, the mask given to GPT2.hidden: the same numbers (right-padded, a real token has the
    same positions and keys), and an attention torch.export traces at every length (without a mask GPT-2 passes
    SDPA is_causal=T > 1, a bool of the length)."""
    T = ids.shape[-1]
    return model._task(model.gpt2.hidden(ids.reshape(-1, T), mask.reshape(-1, T)), mask.sum(-1) - 1)


# --- sample inputs --------------------------------------------------------------------------------------------

def _rows(lengths, T, left=False):
    """0/1 mask (len(lengths), T) of each row's real tokens, padded on the right (BERT) or on the left (GPT-2)."""
    pos = torch.arange(T)
    return torch.stack([(pos >= T - n) if left else (pos < n) for n in lengths]).long()


def _encoder_sample(gen, vocab, lengths, group=1):
    """(input_ids, attention_mask, token_type_ids) of rows of `lengths` real tokens (the second half of each in segment
    B), (B, T) or, in groups of `group` rows (choices, orders), (B, group, T)."""
    T = max(lengths)
    mask = _rows(lengths, T)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=gen) * mask
    segments = (torch.arange(T) >= torch.tensor(lengths)[:, None] // 2).long() * mask
    shape = (len(lengths) // group, group, T) if group > 1 else (len(lengths), T)
    return tuple(x.view(shape) for x in (ids, mask, segments))


def _gpt2_sample(gen, config, lengths, T, past):
    """(input_ids (B, T), attention_mask (B, past + T) left-padded to `lengths`, past keys and values (B, h, past, d)
    of each layer, or none when past is None)."""
    B = len(lengths)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=gen)
    if past is None:
        return ids, _rows(lengths, T, left=True)
    kv = [0.5 * torch.randn(B, config.n_head, past, config.head_dim, generator=gen) for _ in range(2 * config.n_layer)]
    return (ids, _rows(lengths, past + T, left=True), *kv)


# the traced sample first (every size >= 2 and each axis another, so that torch.export keeps them symbolic), then one
# row and a padded batch of other lengths: rows' real tokens (B, T); in groups of 2 (B, 2, T); GPT-2's decoding steps:
# rows' real tokens, new tokens, past tokens
ROWS = ([6, 4], [3], [7, 2, 5])
GROUPS = ([6, 4, 5, 3, 2, 6], [3, 2], [7, 2, 5, 4, 3, 1])
DECODE = (([7, 5], 4, 3), ([5], 5, 0), ([3, 1, 3], 1, 2))


# --- the graphs of each model ---------------------------------------------------------------------------------

def _bert_graphs(model, gen) -> list[Graph]:
    inputs = ["input_ids", "attention_mask", "token_type_ids"]
    choice, V = isinstance(model, BertForChoice), model.config.vocab_size
    samples = [_encoder_sample(gen, V, r, 2 if choice else 1) for r in (GROUPS if choice else ROWS)]
    axes = [{0: "batch_size", 1: "num_choices", 2: "sequence_length"} if choice else BERT_AXES] * 3
    if isinstance(model, BertForEmbedding):
        return [Graph("model.onnx", _Call(model, lambda m, i, a, t: m.bert(i, t, a)[0]), inputs,
                      ["last_hidden_state"], axes, samples),
                Graph("embedding.onnx", _Call(model, lambda m, i, a, t: m(i, t, a)), inputs, ["sentence_embedding"],
                      axes, samples)]
    outputs = {Bert: ["last_hidden_state", "pooler_output"], BertForPreTraining: ["logits", "seq_relationship_logits"],
               BertForSpans: ["start_logits", "end_logits"]}.get(type(model), ["logits"])
    return [Graph("model.onnx", _Call(model, lambda m, i, a, t: m(i, t, a)), inputs, outputs, axes, samples)]


def _gpt2_graphs(model, gen, cache: bool) -> list[Graph]:
    c, inputs = model.config, ["input_ids", "attention_mask"]
    if isinstance(model, GPT2ForSequence):
        both = model.head.both_orders
        samples = [_encoder_sample(gen, c.vocab_size, r, 2 if both else 1)[:2] for r in (GROUPS if both else ROWS)]
        axes = {0: "batch_size", 1: "num_orders", 2: "sequence_length"} if both else BERT_AXES
        return [Graph("model.onnx", _Call(model, _gpt2_classify), inputs, ["logits"], [axes] * 2, samples)]
    if not cache:
        samples = [_gpt2_sample(gen, c, rows, max(rows), None) for rows in ROWS]
        return [Graph("model.onnx", _Call(model, lambda m, i, a: m(i, a)), inputs, ["logits"], [BERT_AXES] * 2,
                      samples)]
    past = [f"past_key_values.{i}.{kv}" for i in range(c.n_layer) for kv in ("key", "value")]
    samples = [_gpt2_sample(gen, c, rows, T, P) for rows, T, P in DECODE]
    axes = [BERT_AXES, {0: "batch_size", 1: "total_sequence_length"}, *[{0: "batch_size", 2: "past_sequence_length"}]
            * len(past)]
    return [Graph("model.onnx", _Call(model, _gpt2_step), inputs + past,
                  ["logits", *[p.replace("past_key_values", "present") for p in past]], axes, samples)]


def graphs(model, cache: bool = True) -> list[Graph]:
    """The graphs `export` writes for `model`, with their sample inputs (on the model's device)."""
    gen = torch.Generator().manual_seed(0)
    if isinstance(model, (GPT2, GPT2ForSequence)):
        out = _gpt2_graphs(model, gen, cache)
    elif isinstance(model, (Bert, BertForPreTraining, BertForSequence, BertForTokens, BertForSpans, BertForChoice,
                            BertForEmbedding)):
        out = _bert_graphs(model, gen)
    else:
        raise ValueError(f"cannot export a {type(model).__name__} to ONNX; duolm exports GPT2, Bert, "
                         "BertForPreTraining and the head models of duolm.models.heads")
    device = next(model.parameters()).device
    for g in out:
        g.samples = [tuple(x.to(device) for x in s) for s in g.samples]
    return out


# --- export ---------------------------------------------------------------------------------------------------

def _need():
    """onnx, onnxruntime and onnxscript, or an ImportError naming the extra."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError:
        raise ImportError(EXTRA) from None
    return onnxruntime


@contextlib.contextmanager
def _quiet():
    """The exporter's and the quantizer's warnings and log lines kept from the user: the library is quiet."""
    logs = [logging.getLogger(name) for name in ("torch.onnx", "")]     # "": quantize_dynamic's advice, on the root
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


@contextlib.contextmanager
def _eval(model):
    """The model in eval mode (no dropout) for a while, then in the mode it was in."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _reason(e: Exception) -> str:
    """The one line that says why torch.onnx.export failed (its messages run to a page, with colours)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    summary = re.search(r"Exception summary\s+<class '[\w.]+'>: (.*)", text)
    return (summary[1] if summary else text.strip().splitlines()[0] if text.strip() else type(e).__name__).strip()


def _name_axes(program, graph: Graph) -> None:
    """The graph's dynamic axes named as `graph.axes` says (torch.export calls them s0, s1, ...), in the outputs' shapes
    too (present.*: past_sequence_length + sequence_length)."""
    import onnx_ir as ir

    names = {}
    for value, axes in zip(program.model.graph.inputs, graph.axes):
        for axis, name in axes.items():
            names[str(value.shape[axis])] = name
    rename = lambda d: ir.SymbolicDim(re.sub(r"s\d+", lambda m: names.get(m[0], m[0]), str(d)))   # noqa: E731
    for value in (*program.model.graph.inputs, *program.model.graph.outputs):
        value.shape = ir.Shape([rename(d) if isinstance(d, ir.SymbolicDim) else d for d in value.shape])


def _session(ort, file: Path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])


def _run(session, graph: Graph, sample: tuple) -> list:
    return session.run(graph.outputs, {n: x.cpu().numpy() for n, x in zip(graph.inputs, sample)})


def _check(ort, graph: Graph, file: Path, name: str) -> None:
    """Every sample through ONNX Runtime against the model: a ValueError naming the model and the output where one
    differs by more than TOLERANCE (relative to its scale) or has another shape."""
    session = _session(ort, file)
    for sample in graph.samples:
        with torch.no_grad():
            want = graph.module(*sample)
        for out, w, g in zip(graph.outputs, want, _run(session, graph, sample)):
            w = w.float().cpu()
            shape = "x".join(map(str, sample[0].shape))
            if tuple(g.shape) != tuple(w.shape):
                raise ValueError(f"ONNX export of {name}: {out} has shape {tuple(g.shape)} in ONNX Runtime, "
                                 f"{tuple(w.shape)} in duolm, on input_ids {shape}; nothing written")
            diff = (torch.from_numpy(g) - w).abs().max().item()
            if not diff <= TOLERANCE * max(1.0, w.abs().max().item()):
                raise ValueError(f"ONNX export of {name}: {out} differs from duolm's by {diff:.3g} on input_ids "
                                 f"{shape} (tolerance {TOLERANCE:g} of its scale); nothing written")


def _export(graph: Graph, file: Path, name: str) -> None:
    D = torch.export.Dim.DYNAMIC
    shapes = tuple({a: D for a in axes} for axes in graph.axes)
    try:
        with _quiet():
            program = torch.onnx.export(graph.module, graph.samples[0], dynamo=True, input_names=graph.inputs,
                                        output_names=graph.outputs, opset_version=OPSET, verbose=False,
                                        dynamic_shapes=(shapes,))
    except Exception as e:                       # torch.export's and onnxscript's errors have no common type
        raise ValueError(f"cannot export {name} to ONNX: {_reason(e)}") from None
    _name_axes(program, graph)
    big = sum(p.numel() * p.element_size() for p in graph.module.parameters()) > 1 << 30   # protobuf's 2 GB limit
    program.save(str(file), external_data=big)   # big: the weights in FILE.data beside it


def export(model, path, cache: bool = True) -> list[Path]:
    """Write `model`'s graphs (see the module doc) into path/onnx/, each checked in ONNX Runtime against the model
    first; cache: a GPT2 language model's graph takes and returns the KV cache. -> the files written. A model that
    does not export, or a graph whose numbers are not the model's, is a ValueError naming the model; then nothing is
    written. The model runs in eval mode during the export (its mode is restored)."""
    ort = _need()
    name = type(model).__name__
    folder = Path(path) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    with _eval(model), tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
        todo = graphs(model, cache)
        for g in todo:
            _export(g, Path(tmp) / g.file, name)
            _check(ort, g, Path(tmp) / g.file, name)
        for f in sorted(Path(tmp).iterdir()):
            f.replace(folder / f.name)
    return [folder / g.file for g in todo]


# --- int8 -----------------------------------------------------------------------------------------------------

def _agreement(file: str, output: str, pairs: list, logits: bool) -> Agreement:
    """pairs: (fp32, int8) outputs of each sample -> their Agreement."""
    cosines, same, rows = [], 0, 0
    for want, got in pairs:
        width = want.shape[-1] if want.shape[-1] > 1 else want.numel()   # a regressor's scores: one vector
        w, g = want.float().cpu().reshape(-1, width), got.reshape(-1, width)
        cosines.append(torch.nn.functional.cosine_similarity(w, g, dim=-1).min().item())
        same, rows = same + (w.argmax(-1) == g.argmax(-1)).sum().item(), rows + len(w)
    return Agreement(file, output, min(cosines), same / rows if logits and pairs[0][0].shape[-1] > 1 else None)


def quantize(model, path, cache: bool = True) -> list[Agreement]:
    """Dynamic int8 of each graph `export(model, path, cache)` wrote: ONNX Runtime's quantize_dynamic (int8 weights,
    per output channel; activations quantized to uint8 as they come) into path/onnx/NAME_quantized.onnx. -> how each
    agrees with the model's fp32 outputs on the sample inputs (Agreement), as duolm reports its own int8's."""
    ort = _need()
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = Path(path) / FOLDER
    out = []
    with _eval(model):
        for g in graphs(model, cache):
            source, target = folder / g.file, folder / g.file.replace(".onnx", f"{QUANTIZED}.onnx")
            if not source.is_file():
                raise FileNotFoundError(f"{source}: no such file; quantize() reads the graphs export() wrote")
            proto = onnx.load(source)
            del proto.graph.value_info[:]       # the exporter's shapes of weights that the quantizer transposes
            with _quiet():
                quantize_dynamic(proto, target, per_channel=True, weight_type=QuantType.QInt8,
                                 use_external_data_format=source.with_name(source.name + ".data").is_file())
            session = _session(ort, target)
            pairs = []
            for s in g.samples:
                with torch.no_grad():
                    pairs.append((g.module(*s)[0], torch.from_numpy(_run(session, g, s)[0])))
            out.append(_agreement(target.name, g.outputs[0], pairs, "logits" in g.outputs[0]))
    return out
