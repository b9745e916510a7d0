"""Hugging Face transformers <-> duolm: name tables for GPT-2 and BERT state dicts and configs.

A table maps each of our key templates ({i} = layer) to the HF key, or to a tuple of HF keys that
are concatenated along dim 0 (BERT's separate query/key/value -> our fused c_attn). A short list
names the tensors stored transposed (OpenAI's Conv1D keeps weights as (in, out)). Every function
checks that every key was used and every shape matches, and raises ValueError listing the rest.

Tied tensors: HF state dicts name the tied output layer separately (GPT-2 "lm_head.weight", BERT
"cls.predictions.decoder.weight"/".bias"). from_hf ignores them (after checking they are tied);
to_hf emits them as the very same tensor objects so HF's load_state_dict(strict=True) works.
A safetensors writer should drop the keys in HF_TIED_KEYS (transformers re-ties them on load).
"""
from __future__ import annotations

import re

import torch

from duolm.models.bert import Bert, BertConfig, BertForPreTraining
from duolm.models.gpt2 import GPT2, GPT2Config

# ---------------------------------------------------------------------------------------------
# GPT-2 (HF GPT2Model names; GPT2LMHeadModel prefixes them with "transformer.")

GPT2_TABLE = {
    "wte.weight": "wte.weight",
    "wpe.weight": "wpe.weight",
    "h.{i}.ln_1.weight": "h.{i}.ln_1.weight",
    "h.{i}.ln_1.bias": "h.{i}.ln_1.bias",
    "h.{i}.attn.c_attn.weight": "h.{i}.attn.c_attn.weight",
    "h.{i}.attn.c_attn.bias": "h.{i}.attn.c_attn.bias",
    "h.{i}.attn.c_proj.weight": "h.{i}.attn.c_proj.weight",
    "h.{i}.attn.c_proj.bias": "h.{i}.attn.c_proj.bias",
    "h.{i}.ln_2.weight": "h.{i}.ln_2.weight",
    "h.{i}.ln_2.bias": "h.{i}.ln_2.bias",
    "h.{i}.mlp.c_fc.weight": "h.{i}.mlp.c_fc.weight",
    "h.{i}.mlp.c_fc.bias": "h.{i}.mlp.c_fc.bias",
    "h.{i}.mlp.c_proj.weight": "h.{i}.mlp.c_proj.weight",
    "h.{i}.mlp.c_proj.bias": "h.{i}.mlp.c_proj.bias",
    "ln_f.weight": "ln_f.weight",
    "ln_f.bias": "ln_f.bias",
}
# Conv1D stores (in, out); our nn.Linear stores (out, in).
GPT2_TRANSPOSED = ["h.{i}.attn.c_attn.weight", "h.{i}.attn.c_proj.weight",
                   "h.{i}.mlp.c_fc.weight", "h.{i}.mlp.c_proj.weight"]
# Buffers older HF checkpoints carry: the causal mask and its fill value. Not weights.
GPT2_IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

# ---------------------------------------------------------------------------------------------
# BERT (HF BertModel names; BertForPreTraining prefixes the encoder with "bert.")

BERT_TABLE = {
    "wte.weight": "embeddings.word_embeddings.weight",
    "wpe.weight": "embeddings.position_embeddings.weight",
    "wse.weight": "embeddings.token_type_embeddings.weight",
    "ln_e.weight": "embeddings.LayerNorm.weight",
    "ln_e.bias": "embeddings.LayerNorm.bias",
    "h.{i}.attn.c_attn.weight": tuple(f"encoder.layer.{{i}}.attention.self.{n}.weight" for n in ("query", "key", "value")),
    "h.{i}.attn.c_attn.bias": tuple(f"encoder.layer.{{i}}.attention.self.{n}.bias" for n in ("query", "key", "value")),
    "h.{i}.attn.c_proj.weight": "encoder.layer.{i}.attention.output.dense.weight",
    "h.{i}.attn.c_proj.bias": "encoder.layer.{i}.attention.output.dense.bias",
    "h.{i}.ln_1.weight": "encoder.layer.{i}.attention.output.LayerNorm.weight",
    "h.{i}.ln_1.bias": "encoder.layer.{i}.attention.output.LayerNorm.bias",
    "h.{i}.mlp.c_fc.weight": "encoder.layer.{i}.intermediate.dense.weight",
    "h.{i}.mlp.c_fc.bias": "encoder.layer.{i}.intermediate.dense.bias",
    "h.{i}.mlp.c_proj.weight": "encoder.layer.{i}.output.dense.weight",
    "h.{i}.mlp.c_proj.bias": "encoder.layer.{i}.output.dense.bias",
    "h.{i}.ln_2.weight": "encoder.layer.{i}.output.LayerNorm.weight",
    "h.{i}.ln_2.bias": "encoder.layer.{i}.output.LayerNorm.bias",
    "pool.weight": "pooler.dense.weight",
    "pool.bias": "pooler.dense.bias",
}
BERT_HEADS_TABLE = {
    "mlm.dense.weight": "cls.predictions.transform.dense.weight",
    "mlm.dense.bias": "cls.predictions.transform.dense.bias",
    "mlm.ln.weight": "cls.predictions.transform.LayerNorm.weight",
    "mlm.ln.bias": "cls.predictions.transform.LayerNorm.bias",
    "mlm.bias": "cls.predictions.bias",
    "nsp.fc.weight": "cls.seq_relationship.weight",
    "nsp.fc.bias": "cls.seq_relationship.bias",
}
# Groups a checkpoint may lack entirely: BertForMaskedLM has no pooler and no NSP head. Our state
# dict then lacks those keys (they keep their init when loaded with strict=False).
BERT_OPTIONAL = ("pool.", "nsp.")
# A non-persistent buffer that older transformers versions saved.
BERT_IGNORED = re.compile(r"^(bert\.)?embeddings\.position_ids$")

HF_TIED_KEYS = ("lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")

GPT2_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
BERT_ARCHITECTURES = ("BertModel", "BertForPreTraining", "BertForMaskedLM")
SUPPORTED = (f"model_type 'gpt2' {list(GPT2_ARCHITECTURES)} or 'bert' {list(BERT_ARCHITECTURES)}, and the "
             f"fine-tuned GPT2ForSequenceClassification, Bert{{ForSequence,ForToken}}Classification, "
             f"BertForQuestionAnswering, BertForMultipleChoice")


# ---------------------------------------------------------------------------------------------
# The one renaming routine both families use

def _expand(table: dict, n_layer: int) -> list[tuple[str, str | tuple]]:
    out = []
    for ours, theirs in table.items():
        for i in (range(n_layer) if "{i}" in ours else [None]):
            fill = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
            out.append((fill(ours), tuple(map(fill, theirs)) if isinstance(theirs, tuple) else fill(theirs)))
    return out


def _n_layer(keys, pattern: str) -> int:
    found = {int(m.group(1)) for k in keys if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def _rename(sd: dict, pairs, transposed: set, to_hf: bool, optional=()) -> dict:
    """pairs: (our key, HF key or tuple of HF keys). Direction HF -> ours unless to_hf."""
    out, used, missing = {}, set(), []
    for ours, theirs in pairs:
        group = theirs if isinstance(theirs, tuple) else (theirs,)
        if to_hf:
            if ours not in sd:
                if not ours.startswith(optional) or not optional:
                    missing.append(ours)
                continue
            used.add(ours)
            t = sd[ours]
            if ours in transposed:
                t = t.t().contiguous()
            if isinstance(theirs, tuple):
                for name, part in zip(theirs, t.chunk(len(theirs), 0)):
                    out[name] = part.clone()   # own storage: writers refuse shared tensors
            else:
                out[theirs] = t
        else:
            have = [k in sd for k in group]
            if not all(have):
                if any(have) or not optional or not ours.startswith(optional):
                    missing.extend(k for k, h in zip(group, have) if not h)
                continue
            used.update(group)
            t = torch.cat([sd[k] for k in group], 0) if isinstance(theirs, tuple) else sd[group[0]]
            out[ours] = t.t().contiguous() if ours in transposed else t
    unknown = sorted(set(sd) - used)
    if missing or unknown:
        raise ValueError(f"state dict does not match the name table: missing keys {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}; unknown keys {unknown[:20]}"
                         f"{' ...' if len(unknown) > 20 else ''}")
    return out


def _check_shapes(sd: dict, expected: dict) -> None:
    bad = [f"{k}: {tuple(v.shape)} != {tuple(expected[k].shape)}" for k, v in sd.items()
           if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    extra = sorted(set(sd) - set(expected))
    if bad or extra:
        raise ValueError(f"tensor shapes do not match the model: {bad[:20]}; unexpected keys {extra[:20]}")


def _meta_state(model_cls, config) -> dict:
    with torch.device("meta"):
        return model_cls(config).state_dict()


# ---------------------------------------------------------------------------------------------
# GPT-2

def _gpt2_shape_config(sd: dict, n_layer: int) -> GPT2Config:
    """A config with the sizes a (our-names) state dict implies; n_head does not change shapes."""
    try:
        V, C = sd["wte.weight"].shape
        inner = sd["h.0.mlp.c_fc.weight"].shape[0] if n_layer else 4 * C
        cfg = GPT2Config(vocab_size=V, block_size=sd["wpe.weight"].shape[0], n_layer=max(n_layer, 1),
                         n_head=1, n_embd=C)
    except (KeyError, ValueError) as e:
        raise ValueError(f"not a GPT-2 state dict: {e}") from None
    if inner != 4 * C:
        raise ValueError(f"GPT-2 MLP width {inner} != 4 * n_embd = {4 * C}: not supported")
    return cfg


def gpt2_from_hf(sd: dict) -> dict:
    """HF GPT2LMHeadModel / GPT2Model state dict (with or without "transformer.") -> ours."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not GPT2_IGNORED.match(k)}
    lm_head = sd.pop("lm_head.weight", None)
    if lm_head is not None and "wte.weight" in sd and not (
            lm_head is sd["wte.weight"] or (lm_head.shape == sd["wte.weight"].shape and torch.equal(lm_head, sd["wte.weight"]))):
        raise ValueError("lm_head.weight differs from wte.weight: untied GPT-2 output layers are not supported")
    n_layer = _n_layer(sd, r"h\.(\d+)\.")
    out = _rename(sd, _expand(GPT2_TABLE, n_layer), set(_expand_keys(GPT2_TRANSPOSED, n_layer)), to_hf=False)
    _check_shapes(out, _meta_state(GPT2, _gpt2_shape_config(out, n_layer)))
    return out


def gpt2_to_hf(sd: dict) -> dict:
    """Our GPT-2 state dict -> HF GPT2LMHeadModel's (transformer.* plus the tied lm_head.weight)."""
    n_layer = _n_layer(sd, r"h\.(\d+)\.")
    _check_shapes(sd, _meta_state(GPT2, _gpt2_shape_config(sd, n_layer)))
    out = _rename(sd, _expand(GPT2_TABLE, n_layer), set(_expand_keys(GPT2_TRANSPOSED, n_layer)), to_hf=True)
    out = {"transformer." + k: v for k, v in out.items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]   # tied: the same tensor
    return out


def _expand_keys(templates, n_layer):
    return [t.format(i=i) for t in templates for i in range(n_layer)]


def _check_hf_type(d: dict, model_type: str, architectures) -> None:
    mt = d.get("model_type")
    archs = d.get("architectures") or []
    architectures = tuple(architectures) + tuple(a for a in HEAD_LAYERS if a.lower().startswith(model_type))
    if mt != model_type or any(a not in architectures for a in archs):
        raise ValueError(f"model_type {mt!r} with architectures {archs} is not supported; "
                         f"duolm supports {SUPPORTED}")


def gpt2_config_from_hf(d: dict) -> GPT2Config:
    """HF GPT2Config dict (config.json) -> GPT2Config. Rejects variants we do not implement."""
    _check_hf_type(d, "gpt2", GPT2_ARCHITECTURES)
    n_embd = d.get("n_embd", 768)
    unsupported = []
    if d.get("n_inner") not in (None, 4 * n_embd):
        unsupported.append(f"n_inner={d['n_inner']} (only 4*n_embd={4 * n_embd})")
    if d.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        unsupported.append(f"activation_function={d['activation_function']!r} (only the tanh GELU 'gelu_new')")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if d.get(key, ok) != ok:
            unsupported.append(f"{key}={d[key]}")
    if unsupported:
        raise ValueError(f"unsupported GPT-2 config options: {', '.join(unsupported)}")
    return GPT2Config(
        vocab_size=d.get("vocab_size", 50257), block_size=d.get("n_positions", d.get("n_ctx", 1024)),
        n_layer=d.get("n_layer", 12), n_head=d.get("n_head", 12), n_embd=n_embd,
        dropout=float(d.get("resid_pdrop", 0.1)), layer_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)))


def gpt2_config_to_hf(c: GPT2Config) -> dict:
    eot = c.vocab_size - 1 if c.vocab_size == 50257 else None   # GPT-2's <|endoftext|> = 50256
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_ctx": c.block_size,
        "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": c.layer_norm_eps,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "tie_word_embeddings": True,
        "bos_token_id": eot, "eos_token_id": eot,
    }


# ---------------------------------------------------------------------------------------------
# BERT

def _bert_shape_config(sd: dict, prefix: str, n_layer: int) -> BertConfig:
    try:
        V, C = sd[prefix + "wte.weight"].shape
        cfg = BertConfig(vocab_size=V, block_size=sd[prefix + "wpe.weight"].shape[0], n_layer=max(n_layer, 1),
                         n_head=1, n_embd=C, type_vocab_size=sd[prefix + "wse.weight"].shape[0],
                         n_inner=sd[prefix + "h.0.mlp.c_fc.weight"].shape[0] if n_layer else 4 * C)
    except (KeyError, ValueError) as e:
        raise ValueError(f"not a BERT state dict: {e}") from None
    return cfg


def _normalize_bert_keys(sd: dict) -> dict:
    # Checkpoints converted from TensorFlow name LayerNorm parameters gamma/beta.
    return {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v
            for k, v in sd.items() if not BERT_IGNORED.match(k)}


def bert_from_hf(sd: dict) -> tuple[dict, bool]:
    """HF BertModel / BertForPreTraining / BertForMaskedLM state dict -> (our sd, heads).

    heads is True when MLM/NSP tensors are present; our keys are then bert.*, mlm.*, nsp.*,
    else the bare Bert keys. A checkpoint without pooler or NSP head (BertForMaskedLM) gives a
    state dict without those keys (see BERT_OPTIONAL)."""
    sd = _normalize_bert_keys(sd)
    heads = any(k.startswith("cls.") for k in sd)
    prefixed = any(k.startswith("bert.") for k in sd)
    decoder_w = sd.pop("cls.predictions.decoder.weight", None)
    decoder_b = sd.pop("cls.predictions.decoder.bias", None)
    n_layer = _n_layer(sd, r"(?:bert\.)?encoder\.layer\.(\d+)\.")
    enc = {k.removeprefix("bert."): v for k, v in sd.items() if not k.startswith("cls.")} if prefixed else \
        {k: v for k, v in sd.items() if not k.startswith("cls.")}
    out = _rename(enc, _expand(BERT_TABLE, n_layer), set(), to_hf=False, optional=BERT_OPTIONAL)
    if not heads:
        _check_shapes(out, _meta_state(Bert, _bert_shape_config(out, "", n_layer)))
        return out, False
    out = {"bert." + k: v for k, v in out.items()}
    cls = {k: v for k, v in sd.items() if k.startswith("cls.")}
    out.update(_rename(cls, _expand(BERT_HEADS_TABLE, 0), set(), to_hf=False, optional=BERT_OPTIONAL))
    wte = out["bert.wte.weight"]
    if decoder_w is not None and not (decoder_w is wte or (decoder_w.shape == wte.shape and torch.equal(decoder_w, wte))):
        raise ValueError("cls.predictions.decoder.weight differs from the word embeddings: untied MLM decoders are not supported")
    if decoder_b is not None and "mlm.bias" in out and not torch.equal(decoder_b, out["mlm.bias"]):
        raise ValueError("cls.predictions.decoder.bias differs from cls.predictions.bias")
    _check_shapes(out, _meta_state(BertForPreTraining, _bert_shape_config(out, "bert.", n_layer)))
    return out, True


def bert_to_hf(sd: dict) -> dict:
    """Our Bert / BertForPreTraining state dict -> HF BertModel / BertForPreTraining names
    (with the tied cls.predictions.decoder.weight/.bias as the same tensors)."""
    heads = any(k.startswith(("mlm.", "nsp.")) for k in sd)
    prefix = "bert." if heads else ""
    n_layer = _n_layer(sd, r"(?:bert\.)?h\.(\d+)\.")
    cfg = _bert_shape_config(sd, prefix, n_layer)
    _check_shapes(sd, _meta_state(BertForPreTraining if heads else Bert, cfg))
    enc = {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix) or not heads}
    out = {prefix + k: v for k, v in _rename(enc, _expand(BERT_TABLE, n_layer), set(), to_hf=True).items()}
    if heads:
        rest = {k: v for k, v in sd.items() if not k.startswith("bert.")}
        out.update(_rename(rest, _expand(BERT_HEADS_TABLE, 0), set(), to_hf=True))
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def bert_config_from_hf(d: dict) -> BertConfig:
    _check_hf_type(d, "bert", BERT_ARCHITECTURES)
    unsupported = []
    if d.get("hidden_act", "gelu") != "gelu":
        unsupported.append(f"hidden_act={d['hidden_act']!r} (only the erf GELU 'gelu')")
    if d.get("position_embedding_type", "absolute") != "absolute":
        unsupported.append(f"position_embedding_type={d['position_embedding_type']!r}")
    if d.get("is_decoder", False) or d.get("add_cross_attention", False):
        unsupported.append("is_decoder/add_cross_attention")
    if unsupported:
        raise ValueError(f"unsupported BERT config options: {', '.join(unsupported)}")
    pad = d.get("pad_token_id", 0)
    return BertConfig(
        vocab_size=d.get("vocab_size", 30522), block_size=d.get("max_position_embeddings", 512),
        n_layer=d.get("num_hidden_layers", 12), n_head=d.get("num_attention_heads", 12),
        n_embd=d.get("hidden_size", 768), n_inner=d.get("intermediate_size", 3072),
        type_vocab_size=d.get("type_vocab_size", 2), dropout=float(d.get("hidden_dropout_prob", 0.1)),
        layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)), pad_token_id=0 if pad is None else pad)


def bert_config_to_hf(c: BertConfig, heads: bool) -> dict:
    return {
        "model_type": "bert", "architectures": ["BertForPreTraining" if heads else "BertModel"],
        "vocab_size": c.vocab_size, "max_position_embeddings": c.block_size,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "hidden_size": c.n_embd,
        "intermediate_size": c.n_inner, "type_vocab_size": c.type_vocab_size, "hidden_act": "gelu",
        "hidden_dropout_prob": c.dropout, "attention_probs_dropout_prob": c.dropout,
        "layer_norm_eps": c.layer_norm_eps, "pad_token_id": c.pad_token_id,
        "initializer_range": 0.02, "position_embedding_type": "absolute", "tie_word_embeddings": True,
    }


def config_from_hf(d: dict) -> tuple[str, GPT2Config | BertConfig]:
    """Dispatch on model_type: -> ("gpt2", GPT2Config) or ("bert", BertConfig)."""
    if d.get("model_type") == "gpt2":
        return "gpt2", gpt2_config_from_hf(d)
    if d.get("model_type") == "bert":
        return "bert", bert_config_from_hf(d)
    raise ValueError(f"unsupported HF model_type {d.get('model_type')!r} "
                     f"(architectures {d.get('architectures')}); duolm supports {SUPPORTED}")


# ---------------------------------------------------------------------------------------------
# Fine-tuning heads: the backbone's table under a prefix, plus the head layer's names

HEAD_ARCHITECTURES = {  # (family, head kind) -> HF class
    ("bert", "classify"): "BertForSequenceClassification", ("bert", "regress"): "BertForSequenceClassification",
    ("bert", "tag"): "BertForTokenClassification", ("bert", "span"): "BertForQuestionAnswering",
    ("bert", "choice"): "BertForMultipleChoice",
    ("gpt2", "classify"): "GPT2ForSequenceClassification", ("gpt2", "regress"): "GPT2ForSequenceClassification",
}
HEAD_LAYERS = {  # HF class -> {our head key: HF key}
    "BertForSequenceClassification": {"fc.weight": "classifier.weight", "fc.bias": "classifier.bias"},
    "BertForTokenClassification": {"fc.weight": "classifier.weight", "fc.bias": "classifier.bias"},
    "BertForQuestionAnswering": {"fc.weight": "qa_outputs.weight", "fc.bias": "qa_outputs.bias"},
    "BertForMultipleChoice": {"fc.weight": "classifier.weight", "fc.bias": "classifier.bias"},
    "GPT2ForSequenceClassification": {"score.weight": "score.weight"},
}
# transformers builds the token and span heads on a BertModel without the pooler (add_pooling_layer=False)
_NO_POOLER = ("BertForTokenClassification", "BertForQuestionAnswering")


def head_to_hf(architecture: str, sd: dict) -> dict:
    """Our head model's state dict (bert.* or gpt2.* plus the head layer) -> the HF class's names."""
    table = HEAD_LAYERS[architecture]
    out = {table[k]: v for k, v in sd.items() if k in table}
    if architecture.startswith("GPT2"):
        body = gpt2_to_hf({k.removeprefix("gpt2."): v for k, v in sd.items() if k.startswith("gpt2.")})
        body.pop("lm_head.weight")
    else:
        body = {"bert." + k: v for k, v in bert_to_hf({k.removeprefix("bert."): v for k, v in sd.items()
                                                       if k.startswith("bert.")}).items()}
        if architecture in _NO_POOLER:
            body = {k: v for k, v in body.items() if not k.startswith("bert.pooler.")}
    missing = sorted(set(table) - set(sd))
    if missing:
        raise ValueError(f"state dict lacks the {architecture} head tensors {missing}")
    return {**body, **out}


def head_from_hf(architecture: str, sd: dict) -> dict:
    """An HF head model's state dict -> ours (bert.* / gpt2.* plus the head layer); a missing pooler (token
    and span heads) is left out, to be initialised."""
    inverse = {v: k for k, v in HEAD_LAYERS[architecture].items()}
    missing = sorted(set(inverse) - set(sd))
    if missing:
        raise ValueError(f"{architecture} checkpoint lacks the head tensors {missing}")
    head = {inverse[k]: v for k, v in sd.items() if k in inverse}
    rest = {k: v for k, v in sd.items() if k not in inverse}
    if architecture.startswith("GPT2"):
        body = {"gpt2." + k: v for k, v in gpt2_from_hf(rest).items()}
    else:
        stray = sorted(k for k in rest if not k.startswith("bert."))
        if stray:
            raise ValueError(f"unknown keys for {architecture}: {stray[:10]}")
        ours, _ = bert_from_hf({k.removeprefix("bert."): v for k, v in rest.items()})
        body = {"bert." + k: v for k, v in ours.items()}
    return {**body, **head}


def head_config_to_hf(head, pad_token_id: int | None = None) -> dict:
    """The HF config keys of a head: architecture, labels (id2label / label2id), problem type."""
    names = head.labels or [f"LABEL_{i}" for i in range(head.n_out)]
    d = {"id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}
    if head.kind in ("classify", "regress"):
        d["problem_type"] = "regression" if head.kind == "regress" else "single_label_classification"
    if pad_token_id is not None:
        d["pad_token_id"] = pad_token_id
    return d


def head_kind_from_hf(d: dict) -> tuple[str, list]:
    """(head kind, labels) of an HF head config (config.json of a *For{Sequence,Token}Classification /
    BertForQuestionAnswering / BertForMultipleChoice directory)."""
    arch = (d.get("architectures") or [""])[0]
    id2label = d.get("id2label") or {}
    labels = [id2label[k] for k in sorted(id2label, key=int)]
    if arch == "BertForQuestionAnswering":
        return "span", []
    if arch == "BertForMultipleChoice":
        return "choice", []
    if arch == "BertForTokenClassification":
        return "tag", labels
    if d.get("problem_type") == "regression" or len(labels) == 1 or d.get("num_labels") == 1:
        return "regress", []
    return "classify", labels
