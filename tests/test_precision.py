"""duolm.precision: the fp32 path through oneDNN against plain F.linear (logits of both families, decoding,
heads, weights that change), bf16 / int8 matmuls against fp32, bf16 training (autocast) against fp32,
the choice of "auto", and the precision a run records and resumes under."""
from __future__ import annotations

import contextlib
import dataclasses
import doctest
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from duolm.generation import generate
from duolm.models import GPT2, Bert, BertConfig, GPT2Config
from duolm.models.heads import HeadConfig, attach_head
from duolm import precision as precision_module
from duolm.precision import (Inference, Training, choose, dropout_keep, inference, int8_rows, native_bf16,
                             training)
from test_generation import _collect


def _gpt2():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():                     # far from uniform next-token distributions
        for p in model.parameters():
            p.mul_(4)
    return model


def _bert():
    torch.manual_seed(0)
    return Bert(BertConfig(vocab_size=120, block_size=40, n_layer=2, n_head=2, n_embd=32, n_inner=64)).eval()


def test_native_bf16_reads_what_the_cpu_reports():
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    assert native_bf16("cpu") == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_choose():
    assert choose("auto", "cpu", training=False) == "fp32"          # inference: exact unless asked
    assert choose("auto", "cpu", training=True) == ("bf16" if native_bf16("cpu") else "fp32")
    assert choose("bf16", "cpu", training=True) == "bf16" and choose("int8", "cpu", training=False) == "int8"
    with pytest.raises(ValueError, match="inference only"):
        choose("int8", "cpu", training=True)
    with pytest.raises(ValueError, match="fp16"):
        choose("fp16", "cpu", training=False)
    with pytest.raises(ValueError, match="CPU only"):
        inference("int8", "meta")


def test_int8_rows_worked_example():
    q, s = int8_rows(torch.tensor([[0.5, -1.27], [0.0, 0.0]]))
    assert q.tolist() == [[50, -127], [0, 0]] and q.dtype == torch.int8
    torch.testing.assert_close(s, torch.tensor([0.01, 0.0]))
    assert doctest.testmod(precision_module).failed == 0          # int8_rows' and row_affine's worked examples


def test_int8_row_keeps_its_steps_beside_a_row_of_large_values():
    """The int8 kernel quantizes its whole input on one scale; a row of 100x larger values in the same batch
    (another request, a padding position) would make a row's steps 100x coarser. Mapped per row, its numbers
    beside that row are the ones it gets alone."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x, loud = torch.randn(1, 64), 100 * torch.randn(1, 64)
    with torch.no_grad():
        ref = lin(x)
        with Inference("int8"):
            alone, quiet, beside = lin(x), lin(torch.cat([x, -x]))[:1], lin(torch.cat([x, loud]))[:1]
    assert 0 < ((alone - ref).norm() / ref.norm()).item() < 0.02
    assert torch.equal(beside, quiet)                  # the same numbers whatever the other row holds
    assert ((beside - ref).norm() / ref.norm()).item() < 0.02


def test_onednn_fp32_equals_plain_gpt2_logits_and_decoding():
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = Inference("fp32", engine="onednn")
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        ref = model(idx)
        with fast:
            got = model(idx)
            one = model(idx[:1, :1])                  # one row: the shape of batch-1 decoding
            # the oneDNN path was taken for every linear and the tied output layer: 4 matrices x 2 blocks + wte
            assert len(fast.forms) == 9
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(one, model(idx[:1, :1]).detach(), atol=1e-5, rtol=0)
    for prompts in ([idx[0].tolist()], [idx[0].tolist(), idx[1, :7].tolist()]):
        want = _collect(generate(model, prompts, 12, temperature=0), len(prompts))
        with fast:
            assert _collect(generate(model, prompts, 12, temperature=0), len(prompts)) == want
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_onednn_fp32_equals_plain_bert_and_heads():
    bert = _bert()
    idx = torch.randint(5, 120, (3, 17))
    seg = torch.zeros_like(idx)
    mask = torch.ones_like(idx)
    mask[2, 10:] = 0
    fast = Inference("fp32", engine="onednn")
    with torch.no_grad():
        ref = bert(idx, seg, mask)
        with fast:
            got = bert(idx, seg, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # a classifier reads [CLS] through Bert.pooled(), whose last layer multiplies slices of c_attn's weight
    clf = attach_head(bert, HeadConfig(kind="classify", task="t", labels=["a", "b", "c"]), 0.1).eval()
    with torch.no_grad():
        ref = clf(idx, seg, mask)
        with fast:
            got = clf(idx, seg, mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_onednn_fp32_packed_weights_equal_plain_at_gpt2_shapes():
    """GPT-2 124M's matrices in oneDNN's blocked layout (its AVX-512 kernels; tiny models' shapes may take
    others) at decoding's row counts and a prefill's, a 3-D input and a padded bucket (100 rows run as 104)."""
    torch.manual_seed(0)
    fast = Inference("fp32", engine="onednn")
    for n, k in ((2304, 768), (768, 3072), (50304, 768)):
        w, b = torch.randn(n, k) * 0.02, torch.randn(n)
        for shape in ((1, k), (8, k), (100, k), (2, 37, k)):
            x = torch.randn(shape)
            with torch.no_grad(), fast:
                got = F.linear(x, w, b)
            torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=0)
    assert len(fast.forms) == 3


def test_onednn_forms_live_with_the_instance_and_leave_autograd_alone():
    """The packed forms live as long as the Inference object: one made after an optimizer step (fused AdamW,
    which changes weights in place without bumping their version counters) sees the new weights. With autograd
    (training) F.linear runs as it is, bit for bit."""
    model = _gpt2()
    idx = torch.randint(0, 97, (2, 9))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        fast = Inference("fp32", engine="onednn")
        with torch.no_grad(), fast:
            got = model(idx)
        with torch.no_grad():
            torch.testing.assert_close(got, model(idx), atol=1e-5, rtol=0)
        with fast:
            loss = model(idx).logsumexp(-1).mean()
        assert loss.requires_grad
        plain = model(idx).logsumexp(-1).mean()
        assert torch.equal(loss, plain)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set size from Linux's /proc")
def test_onednn_row_counts_are_bucketed_so_varied_shapes_do_not_grow_memory():
    """oneDNN keeps ~1 MB for every (rows, weight shape) it has run: over inputs of 480 new row counts the memory
    would grow by hundreds of MB. Bucketed (onednn_rows), they reuse the buckets a first sweep made, in fp32, bf16
    and training alike; the padded rows change no result (3-D inputs included)."""
    w, b = torch.randn(256, 128), torch.randn(256)
    for precision in ("fp32", "bf16"):
        mode = Inference(precision, engine="onednn" if precision == "fp32" else None)
        with torch.no_grad(), mode:
            for m in range(65, 1025, 2):                           # the first sweep: every bucket
                F.linear(torch.randn(m, 128), w, b)
            before = _rss_mb()
            for m in range(66, 1025, 2):                           # 480 row counts not seen yet
                x = torch.randn(m, 128)
                got = F.linear(x, w, b)
            grew = _rss_mb() - before
            x3 = torch.randn(3, 37, 128)                           # 111 rows, run as 112
            for x, y in ((x, got), (x3, F.linear(x3, w, b))):     # bf16: bf16-rounded inputs and product
                rounded = (lambda t: t) if precision == "fp32" else (lambda t: t.bfloat16().float())
                torch.testing.assert_close(y - b, rounded(x) @ rounded(w).T, atol=1e-4,
                                           rtol=0 if precision == "fp32" else 2 ** -7)
        assert grew < 40, (precision, grew)
    x = torch.randn(3, 37, 128, requires_grad=True)
    wp = w.clone().requires_grad_()
    with Training("fp32", engine="onednn"):
        y = F.linear(x, wp, b)
    (y * y).sum().backward()
    want_x, want_w = torch.autograd.grad((F.linear(x, wp, b) ** 2).sum(), (x, wp))
    torch.testing.assert_close(x.grad, want_x, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(wp.grad, want_w, atol=1e-3, rtol=1e-4)


# int8 also quantizes each matmul's input (per tensor): on this tiny model's large activations that costs more
@pytest.mark.parametrize("precision,tol,max_kl", [("int8", 0.05, 5e-3), ("bf16", 0.03, 1e-3)])
def test_narrow_precisions_close_to_fp32(precision, tol, max_kl):
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 97, (2, 20))
    mode = Inference(precision)
    with torch.no_grad():
        ref = model(idx)
        with mode:
            got = model(idx)
    assert got.shape == ref.shape and got.dtype == torch.float32
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < tol                       # not exact, but close
    p, r = got.log_softmax(-1), ref.log_softmax(-1)
    assert (r.exp() * (r - p)).sum(-1).mean() < max_kl
    # decoding through the cache gives what a full forward in the same mode gives
    with mode:
        out = _collect(generate(model, [idx[0].tolist()], 6, temperature=0), 1)[0]
        with torch.no_grad():
            assert model(torch.tensor([idx[0].tolist() + out]))[0, 19:25].argmax(-1).tolist() == out
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_int8_sentence_embeddings_of_minilm_match_fp32(data_dir):
    """all-MiniLM-L6-v2 (real weights) on 100 real sentences: int8 mean-pooled embeddings have
    cosine >= 0.99 with fp32's (the issue's quality bar); the benchmark prints the full figures."""
    from conftest import minilm_dir
    from duolm.checkpoint import load
    from duolm.tasks.base import pad

    model, tok = load(minilm_dir())
    lines = (data_dir / "glue" / "STS-B" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:51]
    sentences = [s for line in lines for s in line.split("\t")[7:9]]
    ids = [tok.encode_with_offsets(s, max_length=128).ids for s in sentences]
    idx, mask = pad(ids, 0)
    with torch.no_grad():
        def embed():
            h = model(idx, torch.zeros_like(idx), mask)[0]
            m = mask[..., None].float()
            return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)
        ref = embed()
        with Inference("int8"):
            q = embed()
    cos = (ref * q).sum(-1)
    assert len(sentences) == 100 and cos.min() >= 0.99 and cos.mean() < 1.0


def test_bf16_training_tracks_fp32():
    """The same 30 steps of a tiny GPT-2 in fp32 and under bf16 autocast: fp32 master weights (the
    parameters stay fp32), losses in fp32, and loss curves that agree to bf16's precision."""
    from duolm.objectives import causal_lm_loss

    torch.manual_seed(0)
    data = torch.randint(0, 97, (8, 33))
    losses = {}
    for precision in ("fp32", "bf16"):
        model = _gpt2().train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[precision] = []
        for _ in range(30):
            with training(precision, "cpu"):
                logits = model(data[:, :-1])
            loss, _ = causal_lm_loss(logits, {"y": data[:, 1:]})
            assert loss.dtype == torch.float32
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[precision].append(loss.item())
        assert all(p.dtype == torch.float32 for p in model.parameters())
        if precision == "bf16":
            assert logits.dtype == torch.bfloat16       # autocast did run the matmuls in bf16
    a, b = torch.tensor(losses["fp32"]), torch.tensor(losses["bf16"])
    assert a[-1] < 0.7 * a[0] and b[-1] < 0.7 * b[0]
    assert ((a - b).abs() / a).max() < 0.05 and not torch.equal(a, b)


def test_run_records_its_precision_and_resumes_only_under_it(tmp_path):
    """The manifest says what "auto" became; resuming in another precision is refused (it would not continue the
    run exactly). Exact resume under bf16 after a SIGKILL: tests/test_train.py."""
    from duolm.objectives import CAUSAL_LM
    from duolm.train.loop import TrainConfig, train

    class Batches:
        def batch(self, step, batch_size, rank=0, world_size=1):
            x = torch.randint(0, 97, (batch_size, 17), generator=torch.Generator().manual_seed(step))
            return {"x": x[:, :-1], "y": x[:, 1:]}

    cfg = TrainConfig(max_steps=2, batch_size=4, warmup_steps=1, eval_every=0, precision="auto")
    out = train(_gpt2().train(), CAUSAL_LM, Batches(), cfg, tmp_path, tensorboard=False)
    chosen = choose("auto", "cpu", training=True)
    assert out["precision"] == chosen
    assert json.loads((tmp_path / "checkpoint.json").read_text())["precision"] == chosen
    other = "fp32" if chosen == "bf16" else "bf16"
    with pytest.raises(ValueError, match=f"trained in {chosen}"):
        train(_gpt2().train(), CAUSAL_LM, Batches(), dataclasses.replace(cfg, max_steps=4, precision=other), tmp_path,
              resume=True, tensorboard=False)


def _loss_and_grads(model, loss_of, mode):
    model.zero_grad(set_to_none=True)
    with mode:
        loss = loss_of()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_training_onednn_linear_equals_plain_losses_and_gradients():
    """fp32 training through oneDNN (Training's linear: forward and input gradient on oneDNN, weight gradient on
    MKL) gives the plain path's loss and every parameter's gradient, for both families (heads included)."""
    from duolm.objectives import causal_lm_loss

    gpt = _gpt2().train()
    x = torch.randint(0, 97, (3, 25))
    bert = _bert().train()
    clf = attach_head(bert, HeadConfig(kind="classify", task="t", labels=["a", "b", "c"]), 0.0).train()
    idx = torch.randint(5, 120, (3, 17))
    mask = torch.ones_like(idx)
    mask[2, 10:] = 0
    y = torch.tensor([0, 2, 1])
    cases = [(gpt, lambda: causal_lm_loss(gpt(x[:, :-1]), {"y": x[:, 1:]})[0]),
             (clf, lambda: F.cross_entropy(clf(idx, torch.zeros_like(idx), mask), y))]
    for model, loss_of in cases:
        ref_loss, ref = _loss_and_grads(model, loss_of, contextlib.nullcontext())
        fast = Training("fp32", engine="onednn")
        assert fast.linear
        loss, got = _loss_and_grads(model, loss_of, fast)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
        assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_dropout_keep_drops_p_and_keeps_the_mean():
    torch.manual_seed(0)
    keep, scale = dropout_keep((1000, 1000), 0.1)
    p = 6554 / 65536                                   # 0.1 to 1/65536 (dropout_cut's worked example)
    assert keep.dtype == torch.bool and scale == 1 / (1 - p)
    assert abs((~keep).float().mean().item() - p) < 5 * (p * (1 - p) / 1e6) ** 0.5
    # both 16-bit halves of a 32-bit draw are fair and independent: at p = 0.5 an element keeps its sign bit
    torch.manual_seed(1)
    low, high = dropout_keep((500_000, 2), 0.5)[0].float().unbind(1)
    for share in (low.mean(), high.mean(), (low == high).float().mean()):
        assert abs(share.item() - 0.5) < 0.003           # 4 standard deviations
    torch.manual_seed(0)
    assert torch.equal(dropout_keep((1000, 1000), 0.1)[0], keep)        # torch's generator: reproducible


def test_training_dropout_is_keep_times_scale_forward_and_backward():
    """F.dropout (nn.Dropout) inside Training: y = x * keep * scale with the mask dropout_keep draws from the same
    generator state, gradient keep * scale; off in eval mode, p = 0 untouched."""
    x = torch.randn(4, 7, 33, requires_grad=True)
    drop = torch.nn.Dropout(0.25)
    torch.manual_seed(5)
    with Training("fp32"):
        y = drop(x)
    torch.manual_seed(5)
    keep, scale = dropout_keep(x.shape, 0.25)
    assert 0 < keep.sum() < keep.numel()
    torch.testing.assert_close(y, x.detach() * keep * scale, atol=0, rtol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep * scale * torch.ones_like(x), atol=0, rtol=0)
    with Training("fp32"):
        assert torch.equal(drop.eval()(x), x) and torch.equal(F.dropout(x, 0.0), x)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal", "float"])
def test_training_attention_with_dropout_is_sdpa_math_with_the_drawn_mask(mask_kind):
    """SDPA with dropout inside Training: softmax(q k^T / sqrt(d) + mask) with dropout_keep's mask, times v — the
    math PyTorch's CPU SDPA runs with dropout on, here with the faster mask; without dropout SDPA itself."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    kwargs = {"none": {}, "causal": {"is_causal": True},
              "bool": {"attn_mask": torch.rand(2, 1, 1, 6) > 0.3},
              "float": {"attn_mask": torch.randn(2, 1, 6, 6)}}[mask_kind]
    torch.manual_seed(7)
    with Training("fp32"):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, **kwargs)
        plain = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.manual_seed(7)
    keep, scale = dropout_keep((2, 3, 6, 6), 0.2)
    att = q @ k.transpose(-2, -1) / 8 ** 0.5
    if mask_kind == "bool":
        att = att.masked_fill(~kwargs["attn_mask"], float("-inf"))
    elif mask_kind == "causal":
        att = att.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    elif mask_kind == "float":
        att = att + kwargs["attn_mask"]
    want = (att.softmax(-1) * keep * scale) @ v
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(plain, F.scaled_dot_product_attention(q, k, v, **kwargs), atol=0, rtol=0)
    torch.testing.assert_close(plain, att.softmax(-1) @ v, atol=1e-6, rtol=1e-5)    # the same formula


def test_fp32_engine_is_a_rule_by_vendor(monkeypatch):
    """oneDNN on x86 CPUs not made by Intel (MKL's slower paths there), MKL on Intel's: the same answer in every
    process, so a resumed run and its evaluations compute the same numbers."""
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "x86_64")
    for vendor, engine in (("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("HygonGenuine", "onednn")):
        monkeypatch.setattr(precision_module, "_cpuinfo", lambda field, v=vendor: v)
        assert precision_module.fp32_engine() == engine
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "aarch64")
    assert precision_module.fp32_engine() == "mkl"


def test_training_attention_with_dropout_under_bf16_autocast():
    """Under training("bf16"): bf16 out, as SDPA under autocast, and the fp32 formula's numbers to bf16's precision
    (the softmax is taken in fp32)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    torch.manual_seed(7)
    with training("bf16", "cpu"):
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    torch.manual_seed(7)
    with Training("fp32"):
        want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
