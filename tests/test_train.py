"""Training: schedule, objectives, accumulation, the loop's checkpoints / resume / SIGTERM / DDP, run logs.

Tiny configs throughout; the subprocess tests (SIGKILL resume, torchrun) run the real `duolm pretrain`.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from duolm.models import GPT2, GPT2Config
from duolm.runs import read_metrics
from duolm.train import (CAUSAL_LM, IGNORE, MLM_NSP, Objective, TrainConfig, causal_lm_loss, loss_validator, lr_at,
                         mlm_nsp_loss, param_groups, train)
from duolm.train.logs import plot_run

ROOT = Path(__file__).resolve().parents[1]


class Windows:
    """Synthetic causal-LM data with the duolm.data batch protocol: a pure function of the step.

    Targets of some positions are IGNORE (a different number per row), so micro-batches hold unequal
    numbers of predicted tokens - the case where averaging per micro-batch would be wrong.
    """

    def __init__(self, vocab=64, T=16, seed=0, holes=True):
        g = torch.Generator().manual_seed(seed)
        # a learnable sequence: mostly t -> t+1 (mod vocab) with noise
        steps = torch.where(torch.rand(20000, generator=g) < 0.8, 1, torch.randint(0, vocab, (20000,), generator=g))
        self.tokens = torch.cumsum(steps, 0) % vocab
        self.vocab, self.T, self.seed, self.holes = vocab, T, seed, holes

    def batch(self, step, batch_size, rank=0, world_size=1):
        g = torch.Generator().manual_seed(self.seed * 100003 + step)
        starts = torch.randint(0, len(self.tokens) - self.T - 1, (batch_size,), generator=g)
        w = torch.stack([self.tokens[s:s + self.T + 1] for s in starts])
        x, y = w[:, :-1].clone(), w[:, 1:].clone()
        if self.holes:
            for r in range(batch_size):
                y[r, : int(torch.randint(0, self.T // 2, (1,), generator=g))] = IGNORE
        b = batch_size // world_size
        return {"x": x[rank * b:(rank + 1) * b], "y": y[rank * b:(rank + 1) * b]}

    def eval_batches(self, batch_size, rank=0, world_size=1, max_batches=None):
        return [self.batch(10 ** 6 + i, batch_size, rank, world_size) for i in range(max_batches or 2)]


def tiny_gpt2(vocab=64, T=16, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return GPT2(GPT2Config(vocab_size=vocab, block_size=T, n_layer=2, n_head=2, n_embd=32, dropout=dropout))


# --- pure functions --------------------------------------------------------------------------------

def test_lr_schedule_worked_example():
    cos = [lr_at(s, 1.0, warmup_steps=2, max_steps=6) for s in range(8)]
    assert cos == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0, 0.0])
    lin = [lr_at(s, 1e-3, 4, 12, "linear", min_lr=1e-4) for s in (0, 3, 4, 8, 12)]
    assert lin == pytest.approx([2.5e-4, 1e-3, 1e-3, 5.5e-4, 1e-4])
    assert lr_at(100, 0.1, 10, 50, "constant") == 0.1
    with pytest.raises(ValueError, match="decay"):
        lr_at(0, 1.0, 0, 10, "exp")


def test_memory_estimate_worked_example():
    """N = 10,000 parameters, 2 blocks of 12 * 10^2 = 1,200 (so a root of 7,600), vocab 100, micro-batches of 3 x 8 =
    24 tokens; a block keeps 17 * 10 = 170 values a token, the head 3 x 4 bytes a logit."""
    from duolm.train.memory import Memory, estimate_memory

    def est(**kw):
        return estimate_memory(10_000, 2, 10, 2, 100, 8, 3, **kw)
    act = 24 * (2 * 170 * 4 + 12 * 100)                                         # 61,440
    assert est() == Memory(40_000, 40_000, 80_000, act)
    assert est(world=2) == Memory(40_000, 80_000, 80_000, act)                  # + DDP's buckets
    # FSDP over 4: a quarter of each, plus the gathered root (7,600) and two blocks, the root's and a block's gradients
    assert est(parallel="fsdp", world=4) == Memory(10_000 + 4 * (7_600 + 2_400), 10_000 + 4 * (7_600 + 1_200),
                                                   20_000, act)
    assert est(parallel="fsdp", world=4, precision="bf16") == Memory(10_000 + 2 * (7_600 + 2_400),
                                                                     10_000 + 4 * (7_600 + 1_200), 20_000,
                                                                     24 * (2 * 170 * 2 + 12 * 100))
    assert est(activation_checkpointing=True).activations == 24 * ((2 * 10 + 170) * 4 + 12 * 100)
    assert est(dropout=True).activations == 24 * (2 * (170 + 2 * 8) * 4 + 12 * 100)   # + H x T attention weights
    assert est().total == 221_440 and str(est()) == ("parameters 0.0 MB, gradients 0.0 MB, optimizer 0.1 MB, "
                                                     "activations 0.1 MB; 0.2 MB in all")


def test_weight_decay_groups():
    model = tiny_gpt2()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    nd = {names[id(p)] for p in no_decay["params"]}
    assert nd and all(n.endswith("bias") or ".ln_" in n or n.startswith("ln_") for n in nd)
    d = {names[id(p)] for p in decay["params"]}
    assert {"wte.weight", "wpe.weight", "h.0.attn.c_attn.weight"} <= d
    assert len(d) + len(nd) == len(list(model.parameters()))        # every parameter once (wte tied)


def test_objectives_are_the_paper_means():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    y = torch.randint(0, 11, (3, 5), generator=g)
    y[0, :2] = IGNORE
    loss, _ = causal_lm_loss(logits, {"y": y})
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1), ignore_index=IGNORE))
    half, _ = causal_lm_loss(logits, {"y": y}, norm={"lm": 26})      # a bigger step's denominator
    torch.testing.assert_close(half, loss * 13 / 26)

    mlm_logits, nsp_logits = torch.randn(2, 6, 9, generator=g), torch.randn(2, 2, generator=g)
    labels = torch.full((2, 6), IGNORE)
    labels[0, 1], labels[0, 4], labels[1, 2] = 3, 5, int(mlm_logits[1, 2].argmax())
    nsp = torch.tensor([0, 1])
    loss, m = mlm_nsp_loss((mlm_logits, nsp_logits), {"mlm_labels": labels, "nsp_labels": nsp})
    want_mlm = F.cross_entropy(mlm_logits.reshape(-1, 9), labels.reshape(-1), ignore_index=IGNORE)
    want_nsp = F.cross_entropy(nsp_logits, nsp)
    torch.testing.assert_close(loss, want_mlm + want_nsp)
    torch.testing.assert_close(m["mlm_loss"], want_mlm)
    acc = ((mlm_logits.argmax(-1) == labels) & (labels != IGNORE)).sum() / 3
    torch.testing.assert_close(m["mlm_acc"], acc.float())


# --- the loop, in process ----------------------------------------------------------------------------

def _losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


def test_accumulation_equals_one_big_batch():
    """4 micro-batches of 4 == 1 batch of 16, although the micro-batches predict different token counts."""
    results = {}
    for micro in (16, 4):
        model = tiny_gpt2()
        cfg = TrainConfig(max_steps=4, batch_size=16, micro_batch_size=micro, lr=3e-3, warmup_steps=1,
                          precision="fp32")
        rows = train(model, CAUSAL_LM, Windows(), cfg)["rows"]
        results[micro] = (_losses(rows), [r["grad_norm"] for r in rows], model.state_dict())
    (l1, g1, w1), (l4, g4, w4) = results[16], results[4]
    assert l1[0] == pytest.approx(l4[0], abs=1e-6, rel=0)         # the same first step, to rounding
    assert l1 == pytest.approx(l4, abs=1e-5, rel=0) and g1 == pytest.approx(g4, rel=1e-5)   # fused AdamW amplifies it
    for k in w1:
        torch.testing.assert_close(w1[k], w4[k], atol=1e-5, rtol=0)   # Adam magnifies rounding in ~0 grads
    # averaging per micro-batch instead (the common bug) gives a measurably different loss
    data = Windows().batch(0, 16)
    model = tiny_gpt2()
    naive = sum(causal_lm_loss(model(data["x"][i:i + 4]), {"y": data["y"][i:i + 4]})[0] for i in (0, 4, 8, 12)) / 4
    assert abs(float(naive.detach()) - l1[0]) > 1e-4


def test_activation_checkpointing_gives_the_same_run_holding_less():
    """--activation-checkpointing: the same losses, gradient norms and weights bit for bit (dropout on: its masks are
    replayed in the recomputation), while a forward keeps under half the bytes for the backward pass; the blocks are
    as before afterwards."""
    from duolm.train.parallel import activation_checkpointing

    results = {}
    for on in (False, True):
        model = tiny_gpt2(dropout=0.1)
        cfg = TrainConfig(max_steps=3, batch_size=8, lr=3e-3, warmup_steps=1, precision="fp32",
                          activation_checkpointing=on)
        rows = train(model, CAUSAL_LM, Windows(), cfg)["rows"]
        results[on] = (_losses(rows), [r["grad_norm"] for r in rows], model.state_dict())
        assert all("forward" not in vars(block) for block in model.h)
    assert results[True][:2] == results[False][:2]
    assert all(torch.equal(results[True][2][k], w) for k, w in results[False][2].items())

    def saved_bytes(on):
        model, held = tiny_gpt2(dropout=0.1).train(), []
        with activation_checkpointing(model, on), torch.autograd.graph.saved_tensors_hooks(
                lambda t: held.append(t.numel() * t.element_size()) or t, lambda t: t):
            model(Windows().batch(0, 8)["x"])
        return sum(held)
    assert saved_bytes(True) < saved_bytes(False) / 2, (saved_bytes(True), saved_bytes(False))


def test_nonfinite_step_is_skipped():
    def forward(model, b):
        return model(b["x"])

    def poisoned(logits, batch, norm=None):
        loss, m = causal_lm_loss(logits, batch, norm)
        scale = batch["scale"][0]
        return loss * scale, {k: v * scale for k, v in m.items()}

    class Poisoned(Windows):
        def batch(self, step, batch_size, rank=0, world_size=1):
            b = super().batch(step, batch_size, rank, world_size)
            b["scale"] = torch.full((len(b["x"]),), float("nan") if step == 2 else 1.0)
            return b

    obj = Objective(forward=forward, loss=poisoned, counts=CAUSAL_LM.counts, tokens=CAUSAL_LM.tokens)
    model = tiny_gpt2()
    snapshots = []

    class Watch(Poisoned):
        def batch(self, step, *a, **k):
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
            return super().batch(step, *a, **k)

    out = train(model, obj, Watch(), TrainConfig(max_steps=5, batch_size=4, lr=1e-2))
    rows = out["rows"]
    assert out["skipped"] == 1 and rows[2].get("nonfinite") and rows[2]["skipped"] == 1
    assert all(math.isfinite(p.detach().sum()) for p in model.parameters())
    for n in snapshots[2]:   # step 2 changed nothing; step 3 did train
        assert torch.equal(snapshots[2][n], snapshots[3][n])
    assert any(not torch.equal(snapshots[3][n], snapshots[4][n]) for n in snapshots[3])


def test_sigterm_saves_and_stops(tmp_path):
    class Term(Windows):
        def batch(self, step, *a, **k):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)   # arrives mid-step; the step finishes, then we save
            return super().batch(step, *a, **k)

    model = tiny_gpt2()
    before = signal.getsignal(signal.SIGTERM)
    out = train(model, CAUSAL_LM, Term(), TrainConfig(max_steps=50, batch_size=4, checkpoint_every=100), tmp_path)
    assert out["stopped"] and out["step"] == 4 and out["saved_at"] == 4
    assert signal.getsignal(signal.SIGTERM) == before
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    assert manifest["latest"] == "ckpt-00000004" and manifest["step"] == 4
    state = torch.load(tmp_path / "ckpt-00000004" / "train_state.pt", weights_only=True)
    assert state["step"] == 4
    import duolm
    loaded, _ = duolm.load(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_run_logs_jsonl_tensorboard_png(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from matplotlib.image import imread

    model = tiny_gpt2()
    cfg = TrainConfig(max_steps=6, batch_size=4, lr=1e-2, eval_every=3, eval_batches=1, checkpoint_every=2,
                      keep_last=2)
    train(model, CAUSAL_LM, Windows(), cfg, tmp_path, validate=loss_validator(CAUSAL_LM, Windows(seed=1), cfg))
    rows = read_metrics(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "tokens_per_s", "grad_norm"} <= r.keys() for r in train_rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 6]
    # TensorBoard's own reader finds the jsonl's scalars (as float32)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert tb_loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train_rows]
    assert [e.step for e in acc.Scalars("val_loss")] == [0, 3, 6]
    # keep_last=2: the manifest names the newest two, which are the only ones on disk
    manifest = json.loads((tmp_path / "checkpoint.json").read_text())
    assert manifest["checkpoints"] == ["ckpt-00000004", "ckpt-00000006"]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == manifest["checkpoints"]
    # the picture: matplotlib's default colours for the first two curves (train blue, val orange) are drawn
    png = plot_run(tmp_path, log_scale=True)
    pixels = (imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3).tolist()
    assert imread(png).shape[:2] == (400, 640)
    assert pixels.count([31, 119, 180]) > 20 and pixels.count([255, 127, 14]) > 20
    assert not list(tmp_path.glob(".*.tmp"))


def test_same_math_as_transformers():
    """20 steps of our loop on our GPT-2 == a plain loop on transformers' GPT2LMHeadModel, same start weights."""
    transformers = pytest.importorskip("transformers")
    from duolm.convert.hf import gpt2_config_to_hf, gpt2_to_hf

    model = tiny_gpt2(vocab=64, T=16)
    hf_cfg = transformers.GPT2Config(**{k: v for k, v in gpt2_config_to_hf(model.config).items()
                                        if k not in ("architectures", "model_type")})
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    hf.load_state_dict(gpt2_to_hf(model.state_dict()), strict=False)
    hf.train()
    data = Windows(holes=False)
    cfg = TrainConfig(max_steps=20, batch_size=8, lr=3e-3, warmup_steps=3, weight_decay=0.1, grad_clip=1.0,
                      precision="fp32")
    ours = _losses(train(model, CAUSAL_LM, data, cfg)["rows"])

    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    ref = []
    for step in range(cfg.max_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.warmup_steps, cfg.max_steps)
        b = data.batch(step, cfg.batch_size)
        logits = hf(input_ids=b["x"]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), b["y"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert ref[-1] < ref[0] - 0.5                      # it trained
    assert ours == pytest.approx(ref, abs=1e-5, rel=0)



def test_mlm_nsp_objective_equals_transformers_pretraining_loss_and_gradients():
    """MLM_NSP runs BERT's MLM head at the masked positions alone (mlm_positions): its loss and every gradient
    equal transformers' BertForPreTraining(labels=..., next_sentence_label=...), whose head runs everywhere,
    and the same model's full-logits path; padded rows included."""
    transformers = pytest.importorskip("transformers")
    from duolm.convert.hf import bert_config_to_hf, bert_to_hf
    from duolm.models import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    ours = BertForPreTraining(BertConfig.preset("tiny", dropout=0.0)).train()
    hf = transformers.BertForPreTraining(transformers.BertConfig(**bert_config_to_hf(ours.config, heads=True)))
    hf.load_state_dict(bert_to_hf(ours.state_dict()))
    hf.train()
    g = torch.Generator().manual_seed(1)
    B, T, V = 3, 24, ours.config.vocab_size
    idx = torch.randint(5, V, (B, T), generator=g)
    segments = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, 17:] = 0
    labels = torch.where((torch.rand(B, T, generator=g) < 0.15) & (mask == 1), idx, IGNORE)
    labels[0, 3] = int(idx[0, 3])                                       # at least one per row
    batch = {"idx": idx, "segment_ids": segments, "attention_mask": mask, "mlm_labels": labels,
             "nsp_labels": torch.tensor([0, 1, 1])}

    def grads(model):
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    loss, metrics = mlm_nsp_loss(MLM_NSP.forward(ours, batch), batch)
    loss.backward()
    fast = grads(ours)
    full = ours(idx, segments, mask)
    assert full[0].shape == (B, T, V)
    loss_full, _ = mlm_nsp_loss(full, batch)
    loss_full.backward()
    plain = grads(ours)
    ref = hf(input_ids=idx, token_type_ids=segments, attention_mask=mask, labels=labels,
             next_sentence_label=batch["nsp_labels"]).loss
    ref.backward()
    theirs = {n: p.grad for n, p in hf.named_parameters()}

    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, loss_full, atol=1e-6, rtol=0)
    assert metrics["mlm_acc"] == mlm_nsp_loss(full, batch)[1]["mlm_acc"]
    for name, grad in fast.items():
        torch.testing.assert_close(grad, plain[name], atol=1e-6, rtol=1e-5, msg=name)
    fast_hf = bert_to_hf(fast)
    for name, grad in theirs.items():                                   # every transformers parameter
        torch.testing.assert_close(fast_hf[name], grad, atol=1e-6, rtol=1e-5, msg=name)

# --- the real command, in subprocesses: SIGKILL + exact resume, torchrun DDP ----------------------------

@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    from duolm.data import prepare
    from duolm.tokenizers import ByteLevelBPE

    rng = random.Random(0)
    words = "the king and queen of a small land said that all men must go to sea when winter comes".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "." for _ in range(2000))
    d = tmp_path_factory.mktemp("gpt2data")
    (d / "corpus.txt").write_text(text)
    prepare([d / "corpus.txt"], ByteLevelBPE.train([text], vocab_size=300), d / "data", val_fraction=0.1,
            chunk_chars=4096)
    return d / "data"


def _pretrain_command(data, run, *extra, launcher=(), crash=None, family="gpt2"):
    """(command, environment) of a tiny `duolm pretrain gpt2` (or `family`) of 12 steps (extra flags override)."""
    start = [*(launcher or [sys.executable]), *([str(ROOT / "tests" / "crash_at.py"), crash] if crash else ["-m", "duolm"])]
    cmd = [*start, "pretrain", family, "--data", str(data), "-o", str(run),
           "--preset", "tiny", "--block-size", "32", "--batch-size", "8", "--micro-batch-size", "2",
           "--max-steps", "12", "--lr", "3e-3", "--warmup-steps", "2", "--checkpoint-every", "2",
           "--eval-every", "4", "--eval-batches", "2", "--quiet", "--precision", "fp32", *extra]
    # Bitwise equality across processes needs a reproducible BLAS: one thread, and MKL's conditional numerical
    # reproducibility (without it MKL may pick kernels by memory alignment, a different rounding per process).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE",
           "PYTHONPATH": str(ROOT / "src")}
    return cmd, env


def _pretrain(data, run, *extra, launcher=(), crash=None, check=True, family="gpt2"):
    cmd, env = _pretrain_command(data, run, *extra, launcher=launcher, crash=crash, family=family)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def _pretrain_here(data, run, *extra, family="gpt2"):
    """_pretrain in this process, on one thread (no interpreter to start): for runs whose numbers are compared to
    another's within a tolerance, or not at all (bit-for-bit comparisons run every side in a subprocess)."""
    from duolm.cli import main

    cmd, _ = _pretrain_command(data, run, *extra, family=family)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(cmd[cmd.index("pretrain"):])
    finally:
        torch.set_num_threads(threads)


def _weights(ckpt):
    """A checkpoint's weights: its model.safetensors, or a sharded one's as duolm.load reads them (one process)."""
    from safetensors.torch import load_file

    import duolm
    return load_file(str(ckpt / "model.safetensors")) if (ckpt / "model.safetensors").exists() else \
        duolm.load(ckpt)[0].state_dict()


def test_sigkill_anywhere_then_resume_is_exact(gpt2_data, tmp_path):
    """12 steps straight == killed after step 1 (before any checkpoint), after step 5, inside the save of
    step 8, after the rename of step 10, each time resumed: the same per-step losses, every step logged
    once, and bit-identical final weights (dropout on)."""
    _pretrain(gpt2_data, tmp_path / "a", "--dropout", "0.1")
    b = tmp_path / "b"
    # the first kill comes before any checkpoint, after the step-0 validation row was logged
    for crash, manifest_step in (("1:step", None), ("5:step", 4), ("8:save", 6), ("10:renamed", 8)):
        p = _pretrain(gpt2_data, b, "--dropout", "0.1", "--resume", crash=crash, check=False)
        assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
        manifest = b / "checkpoint.json"
        assert (json.loads(manifest.read_text())["step"] if manifest.exists() else None) == manifest_step
    assert (b / "ckpt-00000010").is_dir()                       # complete on disk, but never named: not used
    _pretrain(gpt2_data, b, "--dropout", "0.1", "--resume")
    rows_a, rows_b = read_metrics(tmp_path / "a"), read_metrics(b)
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]   # no step twice after the resumes
    assert _losses(rows_b) == _losses(rows_a)
    assert [r.get("val_loss") for r in rows_b] == [r.get("val_loss") for r in rows_a]
    wa, wb = _weights(tmp_path / "a" / "ckpt-00000012"), _weights(b / "ckpt-00000012")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not list(b.glob(".tmp-*"))


def test_sigkill_then_resume_is_exact_under_bf16(gpt2_data, tmp_path, capsys):
    """bf16 autocast (fp32 weights and optimizer state): a run killed after step 5 and resumed equals the run
    straight through, bit for bit; resuming it in fp32 is refused in one line."""
    bf16 = ("--dropout", "0.1", "--precision", "bf16")
    _pretrain(gpt2_data, tmp_path / "a", *bf16)
    b = tmp_path / "b"
    p = _pretrain(gpt2_data, b, *bf16, "--resume", crash="5:step", check=False)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _pretrain_here(gpt2_data, b, "--resume")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "trained in bf16" in err, err
    _pretrain(gpt2_data, b, *bf16, "--resume")
    rows_a, rows_b = read_metrics(tmp_path / "a"), read_metrics(b)
    assert _losses(rows_b) == _losses(rows_a)
    wa, wb = _weights(tmp_path / "a" / "ckpt-00000012"), _weights(b / "ckpt-00000012")
    assert all(torch.equal(wa[k], wb[k]) and wa[k].dtype == torch.float32 for k in wa)
    assert json.loads((b / "checkpoint.json").read_text())["precision"] == "bf16"


def test_pretrain_records_the_precision_auto_resolved_to(gpt2_data, tmp_path, capsys):
    """`duolm pretrain --precision auto` resolves it once: the header says what it became, the manifest records it."""
    from duolm.precision import resolve

    _pretrain_here(gpt2_data, tmp_path / "run", "--max-steps", "2", "--precision", "auto")
    out = capsys.readouterr().out
    auto = resolve("auto", "cpu", training=True)
    assert f"parameters on cpu in {auto}" in out, out
    # the step laid out over the processes, and the memory estimate a process
    assert "\n1 process(es): 8 sequences each a step in 4 micro-batch(es) of 2; memory a process (estimate): " \
        "parameters " in out, out
    assert json.loads((tmp_path / "run" / "checkpoint.json").read_text())["precision"] == auto


def test_one_run_directory_has_one_writer(gpt2_data, tmp_path, capsys):
    """A second `duolm pretrain` into a directory another process is training into is refused at once, in one line
    naming the directory and the holder; the first run, stopped afterwards by SIGTERM, is complete and intact
    (every step logged once, its last step checkpointed) and resumes at once: the OS released the lock."""
    run = tmp_path / "run"
    cmd, env = _pretrain_command(gpt2_data, run, "--max-steps", "100000", "--checkpoint-every", "0")
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ((run / ".lock").is_file() and f"process {first.pid}" in (run / ".lock").read_text()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        capsys.readouterr()
        with pytest.raises(SystemExit) as second:
            _pretrain_here(gpt2_data, run, "--max-steps", "100000", "--resume")
        refused = capsys.readouterr().err
        while not any("loss" in r for r in read_metrics(run)):    # in its loop, where SIGTERM stops it cleanly
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.value.code == 2 and refused.count("\n") == 1, refused
    assert str(run) in refused and f"process {first.pid} on " in refused, refused
    assert first.returncode == 0 and "stopped by SIGTERM" in out, out + err
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and json.loads((run / "checkpoint.json").read_text())["step"] == steps[-1]
    _pretrain_here(gpt2_data, run, "--max-steps", str(steps[-1] + 1), "--resume")
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == steps + [steps[-1] + 1]


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


_BATCH = ("--batch-size", "12", "--micro-batch-size", "2", "--decay", "constant")   # (a schedule that does not
                                                                                 # depend on --max-steps)
_LONG = ("--max-steps", "30", "--keep-last", "15")          # fsdp_runs: 30 steps, every checkpoint kept


@pytest.fixture(scope="module")
def fsdp_runs(gpt2_data, tmp_path_factory):
    """30 steps in one process (runs/one: this one) and under FSDP2 on 2 processes (runs/fsdp), every checkpoint
    kept (the other runs stop at 12 and compare with step 12's)."""
    root = tmp_path_factory.mktemp("runs")
    _pretrain_here(gpt2_data, root / "one", *_BATCH, *_LONG)
    fsdp = _pretrain(gpt2_data, root / "fsdp", *_BATCH, *_LONG, "--parallel", "fsdp", launcher=_torchrun(2))
    assert fsdp.stdout.count("done at step 30") == 1
    return root


def test_fsdp_matches_one_process_and_resumes_at_any_world_size(fsdp_runs, gpt2_data, tmp_path):
    """FSDP2 (gloo, CPU) on 2 processes gives one process's losses within 1e-5 for 30 steps, weights to 3e-5
    (gradients averaged over the processes, not summed), its checkpoints sharded (a file a process, read whole by
    duolm.load); a run resumes at another process count and kind — ddp 2 -> fsdp 3 -> fsdp 2 -> one process — with
    the global batch unchanged, and its losses continue as the uninterrupted run's."""
    ckpt = fsdp_runs / "fsdp" / "ckpt-00000030"
    assert sorted(p.name for p in ckpt.iterdir() if "model" in p.name or p.is_dir()) == ["shards"]
    assert sorted(p.name for p in (ckpt / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    run = tmp_path / "run"
    for n, parallel, steps in ((2, "ddp", 4), (3, "fsdp", 8), (2, "fsdp", 10)):
        _pretrain(gpt2_data, run, *_BATCH, "--parallel", parallel, "--max-steps", str(steps), "--resume",
                  launcher=_torchrun(n))
    _pretrain_here(gpt2_data, run, *_BATCH, "--resume")                     # to step 12 in one process (this one)
    want = _losses(read_metrics(fsdp_runs / "one"))
    for run, steps in ((fsdp_runs / "fsdp", 30), (run, 12)):
        rows = read_metrics(run)
        assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1)), run
        assert _losses(rows) == pytest.approx(want[:steps], abs=1e-5, rel=0), run
        # the weights at step 12 to 3e-5: the keys' bias gets gradients of ~0 (softmax ignores it), whose rounding
        # AdamW scales up to steps of ~lr, a drift that grows with the steps
        w, w1 = _weights(run / "ckpt-00000012"), _weights(fsdp_runs / "one" / "ckpt-00000012")
        assert w.keys() == w1.keys() and all(torch.allclose(w1[k], w[k], atol=3e-5, rtol=0) for k in w1), run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(data, run, *extra, crash=None, timeout=300) -> list[subprocess.CompletedProcess]:
    """`duolm pretrain` on two "nodes" of one process each: two torchrun launchers started together, meeting at a
    free port of 127.0.0.1 (c10d rendezvous), as two machines would. A launcher whose peer never joins gives up after
    60 s (the rendezvous' join timeout); both are stopped after `timeout` seconds in all (SIGTERM: torchrun stops its
    workers, SIGKILLing them 30 s later), killed 60 s after that: the suite never hangs on them."""
    port, procs = _free_port(), []
    try:
        for node in (0, 1):
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                        "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--rdzv-id", "two-nodes", "--rdzv-conf", "join_timeout=60"]
            cmd, env = _pretrain_command(data, run, *extra, launcher=launcher, crash=crash)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        deadline = time.monotonic() + timeout
        outs = [p.communicate(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.communicate(timeout=60)
                finally:
                    p.kill()


def test_fsdp_on_two_nodes_and_killed_resumes_bit_for_bit(fsdp_runs, gpt2_data, tmp_path):
    """The one-node 2-process FSDP2 run, bit for bit (losses, validation losses, final weights), made in three goes:
    on two "nodes" (torchrun's c10d rendezvous at 127.0.0.1), SIGKILLed after step 5; resumed on one node at 2
    processes and rank 0 killed inside the sharded save of step 8 (every shard written, the manifest still naming
    step 6); resumed again to the end. Same process count, so the same sums in the same order: nothing is rounded
    differently."""
    run = tmp_path / "run"
    nodes = _two_nodes(gpt2_data, run, *_BATCH, "--parallel", "fsdp", crash="5:step")
    assert all(p.returncode != 0 for p in nodes), [p.stdout + p.stderr for p in nodes]
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 4
    want = [r for r in read_metrics(fsdp_runs / "fsdp") if r["step"] <= 12]         # the run stops at 12
    assert _losses(read_metrics(run)) == _losses(want)[:4]      # two nodes == one node (kill after step 5)
    p = _pretrain(gpt2_data, run, *_BATCH, "--parallel", "fsdp", "--resume", crash="8:save", launcher=_torchrun(2),
                  check=False)
    assert p.returncode != 0 and json.loads((run / "checkpoint.json").read_text())["step"] == 6, p.stdout + p.stderr
    assert (run / ".tmp-ckpt-00000008" / "shards" / ".metadata").is_file()
    _pretrain(gpt2_data, run, *_BATCH, "--parallel", "fsdp", "--resume", launcher=_torchrun(2))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [r["step"] for r in want]            # every step once
    assert _losses(rows) == _losses(want)
    assert [r.get("val_loss") for r in rows] == [r.get("val_loss") for r in want]
    w, w2 = _weights(run / "ckpt-00000012"), _weights(fsdp_runs / "fsdp" / "ckpt-00000012")
    assert w.keys() == w2.keys() and all(torch.equal(w[k], w2[k]) for k in w)
    assert not list(run.glob(".tmp-*"))


def test_fsdp_bf16_computes_with_bf16_parameters_and_keeps_fp32_shards():
    """FSDP2 under precision bf16 (MixedPrecisionPolicy): the forward computes with bf16 parameters, the shards and
    their gradients stay fp32; under fp32 all is fp32. (A process group of one: the policy is the same at any size.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from duolm.train.parallel import shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            model, seen = shard(tiny_gpt2(), init_device_mesh("cpu", (1,)), precision), []
            model.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
            model(Windows().batch(0, 2)["x"]).float().sum().backward()
            assert seen == [dtype]
            assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    finally:
        dist.destroy_process_group()


def test_fsdp_bf16_with_activation_checkpointing_runs_as_one_process(gpt2_data, tmp_path):
    """--precision bf16 under FSDP2 on 2 processes (gloo gathers the bf16 parameters), with --activation-checkpointing:
    the losses are one process's bf16 autocast run's to bf16's rounding, the checkpointed weights fp32."""
    bf16 = (*_BATCH, "--precision", "bf16", "--max-steps", "6")
    _pretrain_here(gpt2_data, tmp_path / "one", *bf16)
    _pretrain(gpt2_data, tmp_path / "fsdp", *bf16, "--parallel", "fsdp", "--activation-checkpointing",
              launcher=_torchrun(2))
    want, got = _losses(read_metrics(tmp_path / "one")), _losses(read_metrics(tmp_path / "fsdp"))
    assert len(got) == 6 and max(abs(a - b) for a, b in zip(want, got)) < 2e-2, (want, got)
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(tmp_path / "fsdp" / "ckpt-00000006" / "shards").read_metadata().state_dict_metadata
    assert {m.properties.dtype for k, m in saved.items() if k.startswith("model.")} == {torch.float32}


def test_bert_under_fsdp_is_one_process(tmp_path):
    """A tiny BERT pretrained (MLM + NSP, the MLM decoder tied to the token embedding) under FSDP2 on 2 processes
    gives one process's losses within 1e-5 in fp32, MLM's and NSP's apart."""
    from duolm.data import prepare
    from duolm.tokenizers import WordPiece

    rng = random.Random(0)
    words = "the king and queen of a small land said that all men must go to sea when winter comes".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + " ." for _ in range(1000)]
    (tmp_path / "docs.txt").write_text("\n\n".join("\n".join(lines[i:i + 10]) for i in range(0, 1000, 10)))
    prepare([tmp_path / "docs.txt"], WordPiece.train(lines, vocab_size=200), tmp_path / "data", val_fraction=0.1,
            chunk_chars=4096)
    bert = (*_BATCH, "--max-steps", "6", "--dropout", "0")
    _pretrain_here(tmp_path / "data", tmp_path / "one", *bert, family="bert")
    _pretrain(tmp_path / "data", tmp_path / "fsdp", *bert, "--parallel", "fsdp", launcher=_torchrun(2), family="bert")
    one, fsdp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp")
    for key in ("loss", "mlm_loss", "nsp_loss", "val_loss"):
        want, got = [r[key] for r in one if key in r], [r[key] for r in fsdp if key in r]
        assert len(got) == len(want) > 1 and got == pytest.approx(want, abs=1e-5, rel=0), key


def test_sharded_checkpoint_converts_to_hf_and_a_broken_shard_is_one_line(fsdp_runs, tmp_path, capsys):
    """`duolm convert` of an FSDP run's sharded checkpoint writes an HF directory whose transformers logits are
    duolm.load's of the sharded checkpoint within 1e-5; a shard cut short or missing is a one-line error naming it."""
    import shutil

    import transformers

    import duolm
    from duolm.cli import main

    ckpt = fsdp_runs / "fsdp" / "ckpt-00000012"
    main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"])
    ours, _ = duolm.load(ckpt)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), atol=1e-5, rtol=0)
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    shard = broken / "shards" / "__1_0.distcp"
    capsys.readouterr()
    for damage, says in ((lambda: os.truncate(shard, shard.stat().st_size // 2), "cut short"),
                         (shard.unlink, "missing")):
        damage()
        with pytest.raises(SystemExit) as e:
            main(["convert", str(broken), str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and f"{shard}: {says}" in err, err


# --- tiny models learn real text (through `duolm pretrain`, in process) --------------------------------

def test_tiny_gpt2_and_bert_learn(data_dir, tmp_path, one_thread):
    from duolm.cli import main
    from duolm.data import prepare
    from duolm.tokenizers import ByteLevelBPE, WordPiece

    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    (tmp_path / "shakespeare.txt").write_text(text)
    prepare([tmp_path / "shakespeare.txt"], ByteLevelBPE.train([text], vocab_size=512), tmp_path / "gd",
            val_fraction=0.1, chunk_chars=8192)
    main(["pretrain", "gpt2", "--data", str(tmp_path / "gd"), "-o", str(tmp_path / "gpt2"), "--block-size", "64",
          "--batch-size", "16", "--max-steps", "150", "--lr", "3e-3", "--warmup-steps", "10", "--eval-every", "50",
          "--eval-batches", "4", "--quiet"])
    val = [r["val_loss"] for r in read_metrics(tmp_path / "gpt2") if "val_loss" in r]
    assert val[0] > 6.0 and val[-1] < val[0] - 1.5, val          # ln(512) = 6.24 at the start

    # PTB: one sentence per line; every 10 lines a document (blank line between), as BERT's data format
    lines = (data_dir / "ptb" / "ptb.train.txt").read_text().splitlines()[:4000]
    docs = "\n\n".join("\n".join(s.strip() for s in lines[i:i + 10]) for i in range(0, len(lines), 10))
    (tmp_path / "ptb.txt").write_text(docs)
    prepare([tmp_path / "ptb.txt"], WordPiece.train(lines, vocab_size=1000), tmp_path / "bd", val_fraction=0.1,
            chunk_chars=8192)
    main(["pretrain", "bert", "--data", str(tmp_path / "bd"), "-o", str(tmp_path / "bert"), "--block-size", "64",
          "--batch-size", "32", "--max-steps", "100", "--lr", "3e-3", "--warmup-steps", "10", "--eval-every", "50",
          "--eval-batches", "4", "--quiet"])
    rows = [r for r in read_metrics(tmp_path / "bert") if "val_loss" in r]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.9          # 7.63 at the start (ln 1000 + ln 2)
    assert rows[-1]["val_mlm_acc"] > rows[0]["val_mlm_acc"] + 0.02
    # the picture: MLM's losses in the left panel, NSP's in the right, each with its training curve (blue)
    from matplotlib.image import imread
    picture = (imread(tmp_path / "bert" / "loss.png")[..., :3] * 255).round().astype(int)
    assert picture.shape[:2] == (400, 1280)
    for half in (picture[:, :640], picture[:, 640:]):
        assert half.reshape(-1, 3).tolist().count([31, 119, 180]) > 20
    import duolm
    model, tok = duolm.load(tmp_path / "bert")
    assert type(model).__name__ == "BertForPreTraining" and tok.vocab_size == model.config.vocab_size
