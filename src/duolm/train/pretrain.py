"""Pretraining as one library call: GPT-2 (causal LM) or BERT (MLM + NSP) on a prepared data directory.

    from duolm.train import ModelConfig, TrainConfig, pretrain
    pretrain("gpt2", "data/", "runs/gpt2", ModelConfig(preset="tiny"), TrainConfig(max_steps=2000))

The CLI (`duolm pretrain`) and the demo call this; torchrun runs it as is (DDP over the processes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from duolm.config import opt
from duolm.data import (
    BertBatches,
    CausalBatches,
    MaskSpec,
    load_documents,
    load_meta,
    open_split,
)
from duolm.evaluation.choice import multiple_choice, read_items
from duolm.evaluation.scoring import blimp, read_blimp
from duolm.models import GPT2, BertConfig, BertForPreTraining, GPT2Config
from duolm.objectives import CAUSAL_LM, MLM_NSP
from duolm.precision import resolve
from duolm.tokenizers import load_tokenizer
from duolm.train.logs import plot_run
from duolm.train.loop import TrainConfig, loss_validator, train
from duolm.train.memory import layout
from duolm.train.parallel import process_group, rank_world

FAMILIES = ("gpt2", "bert")
# loss.png's panels: BERT's two losses apart, so the picture shows when each starts to learn
PLOTS = {"gpt2": (("loss", "val_loss"),), "bert": (("mlm_loss", "val_mlm_loss"), ("nsp_loss", "val_nsp_loss"))}


@dataclass
class ModelConfig:
    """What model to pretrain, how to build its batches and what to validate it on; the CLI's flags are these fields."""
    preset: str = opt("tiny", "size preset: tiny, gpt2, gpt2-medium, ..., bert-base, bert-large")
    block_size: int | None = opt(None, "sequence length (default: the preset's)")
    dropout: float | None = opt(None, "dropout (default: the preset's)")
    n_layer: int | None = opt(None, "override the preset's layers")
    n_head: int | None = opt(None, "override the preset's heads")
    n_embd: int | None = opt(None, "override the preset's width (BERT: n_inner = 4x)")
    order: str = opt("random", "gpt2: window order", choices=("random", "shuffle", "sequential"))
    masking: str = opt("dynamic", "bert: masks drawn once or at every use", choices=("static", "dynamic"))
    nsp: bool = opt(True, "bert: next-sentence prediction (off: MLM only, as RoBERTa)")
    whole_word: bool = opt(False, "bert: whole-word masking")
    masked_lm_prob: float = opt(0.15, "bert: share of tokens masked")
    max_predictions: int = opt(20, "bert: masked positions per sequence at most")
    short_seq_prob: float = opt(0.1, "bert: share of shorter sequences")
    dupe_factor: int = opt(1, "bert static masking: copies with different masks")
    eval_mc: list[str] | None = opt(None, "gpt2: a multiple-choice jsonl (llm-foundry's forms or HellaSwag's) scored "
                                          "at every validation, acc_norm logged as val_mc_<file name>_acc_norm; "
                                          "repeat for more files")
    eval_blimp: str | None = opt(None, "a BLiMP .jsonl file or folder scored at every validation (either family: "
                                       "GPT-2's log-likelihood, BERT's pseudo-log-likelihood), its overall accuracy "
                                       "logged as val_blimp_acc")


def build(family: str, data_dir, mc: ModelConfig, seed: int = 0):
    """The model (fresh, seeded by `seed`), objective, train and validation batch sources, tokenizer."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {FAMILIES}")
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    tok = load_tokenizer(data_dir / "tokenizer")
    want = "bpe" if family == "gpt2" else "wordpiece"
    if meta["kind"] != want:
        raise ValueError(f"{data_dir} holds {meta['kind']} data; pretraining {family} needs data prepared with a "
                         f"{want} tokenizer (duolm tokenizer train --kind {want})")
    sizes = {k: getattr(mc, k) for k in ("block_size", "dropout", "n_layer", "n_head", "n_embd")
             if getattr(mc, k) is not None}
    torch.manual_seed(seed)                                # the initial weights are a function of the seed
    if family == "gpt2":
        config = GPT2Config.preset(mc.preset, vocab_size=meta["vocab_size"], **sizes)
        train_data = CausalBatches(open_split(data_dir, "train"), config.block_size, seed=seed, order=mc.order)
        val_data = CausalBatches(open_split(data_dir, "val"), config.block_size, order="sequential")
        return GPT2(config), CAUSAL_LM, train_data, val_data, tok
    if mc.n_embd:
        sizes["n_inner"] = 4 * mc.n_embd
    config = BertConfig.preset(mc.preset, vocab_size=meta["vocab_size"], pad_token_id=tok.pad_id, **sizes)
    common = dict(spec=MaskSpec.from_tokenizer(tok), max_seq_length=config.block_size, nsp=mc.nsp,
                  short_seq_prob=mc.short_seq_prob, masked_lm_prob=mc.masked_lm_prob,
                  max_predictions_per_seq=mc.max_predictions, whole_word=mc.whole_word)
    train_data = BertBatches(load_documents(data_dir, "train"), seed=seed, masking=mc.masking,
                             dupe_factor=mc.dupe_factor, **common)
    val_data = BertBatches(load_documents(data_dir, "val"), seed=seed + 1, masking="static", **common)
    return BertForPreTraining(config), MLM_NSP, train_data, val_data, tok


def with_metrics(validate, metrics: dict):
    """`validate` plus each metrics[name](model), of the model as it is, in eval mode (and fp32)."""
    def run(model, step):
        out = validate(model, step)
        was_training = model.training
        model.eval()
        try:
            out.update({name: f(model) for name, f in metrics.items()})
        finally:
            model.train(was_training)
        return out
    return run


def extra_metrics(mc: ModelConfig, family: str, tokenizer) -> dict:
    """The validations --eval-mc and --eval-blimp add, name -> f(model), their files read here, once:
    val_mc_<name>_acc_norm (`duolm eval --task multiple-choice`'s, or hellaswag's, acc_norm) and val_blimp_acc
    (`duolm eval --task blimp`'s overall accuracy)."""
    metrics = {}
    if mc.eval_mc and family != "gpt2":
        raise ValueError("--eval-mc scores a causal language model: pretrain gpt2")
    for f in mc.eval_mc or ():
        items = read_items(f)[1]
        metrics[f"val_mc_{Path(f).stem}_acc_norm"] = lambda m, i=items: multiple_choice(m, tokenizer, i)["acc_norm"]
    if mc.eval_blimp:
        pairs = read_blimp(mc.eval_blimp)
        metrics["val_blimp_acc"] = lambda m: blimp(m, tokenizer, pairs)["acc"]
    return metrics


def pretrain(family: str, data_dir, run_dir, model_config: ModelConfig | None = None,
             train_config: TrainConfig | None = None, *, resume: bool = False, device: str | None = None,
             on_start=None, on_log=None) -> dict:
    """Pretrain `family` ("gpt2" | "bert") on `data_dir` (written by duolm.data.prepare) into `run_dir`.

    resume: continue from the run's newest complete checkpoint. on_start(model, device, start_step, precision,
    layout) (layout: duolm.train.memory.Layout, the step over the processes and the memory of each) and on_log(row)
    are called on rank 0 (the CLI prints and draws its progress bar from them). Returns
    train()'s result; the run folder holds checkpoints, metrics.jsonl, tb/ and loss.png."""
    mc, tc = model_config or ModelConfig(), train_config or TrainConfig()
    with process_group(device) as (dev, rank):
        model, objective, train_data, val_data, tok = build(family, data_dir, mc, tc.seed)
        model.to(dev)
        tc = replace(tc, precision=resolve(tc.precision, dev, training=True))
        if on_start is not None and rank == 0:
            from duolm.runs import read_manifest
            on_start(model, dev, (read_manifest(run_dir) or {}).get("step", 0) if resume else 0, tc.precision,
                     layout(model, tc, rank_world()[1]))
        validate = with_metrics(loss_validator(objective, val_data, tc), extra_metrics(mc, family, tok))
        result = train(model, objective, train_data, tc, run_dir, validate=validate, tokenizer=tok, resume=resume,
                       on_log=on_log)
        if rank == 0:
            mc_plot = tuple(f"val_mc_{Path(f).stem}_acc_norm" for f in mc.eval_mc or ()) + \
                (("val_blimp_acc",) if mc.eval_blimp else ())
            result["plot"] = plot_run(run_dir, PLOTS[family] + ((mc_plot,) if mc_plot else ()))
        return result
